"""ASGI app of the minimal adrf reference: Django's stock ``get_asgi_application()``."""
import os

from django.core.asgi import get_asgi_application

os.environ["DJANGO_SETTINGS_MODULE"] = "bench.reference.settings"
application = get_asgi_application()
