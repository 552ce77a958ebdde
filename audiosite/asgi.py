"""ASGI entry point: ``daphne audiosite.asgi:application``.

HTTP goes to Django (DRF async views). ``get_asgi_application()`` runs before
anything that imports models, as Channels requires.
"""
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "audiosite.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402

application = ProtocolTypeRouter({"http": django_asgi_app})
