"""ASGI entry point: ``daphne audiosite.asgi:application``.

WebSocket upgrades go to the Channels consumers: ``/v1/realtime`` (``inference.consumers``) and
``/ui/ws/status`` (``ui.routing``); any other path is closed cleanly with code 4404.
HTTP goes to Django (DRF async views): the API through
``audiosite.http.handler.ApiHandler`` (async-only middleware, no per-request
thread), the admin through Django's own handler with the full
``MIDDLEWARE``. ``get_asgi_application()`` runs before anything that imports
models, as Channels requires.

At import, ``settings.ALLOWED_HOSTS`` becomes the configuration's
:meth:`~audiosite.serverconfig.ServerConfig.allowed_host_names` (the bound
host's names plus ``allowed_hosts``), before the first request. The runtime check there (R1.4) needs
Redis: a web process started while Redis cannot be reached waits for it up to ``REDIS_START_WAIT_S``
(60 s), then exits 1 with one line saying so; one that finds another runtime recorded exits 1 at once
(``inference.runtime.startup.check_runtime_at_start``).
"""
import os

from django.conf import settings
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "audiosite.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import re_path  # noqa: E402

from audiosite.http.handler import http_application  # noqa: E402
from audiosite.serverconfig import get_config  # noqa: E402
from inference.consumers import HostOriginValidator, NoRouteConsumer, RealtimeConsumer  # noqa: E402
from inference.runtime.context import sync_scheduler  # noqa: E402
from inference.runtime.startup import check_runtime_at_start  # noqa: E402
from ui.routing import websocket_urlpatterns as ui_websocket_urlpatterns  # noqa: E402

# R1.4: refuse to serve when the deployment records another runtime; R1.5: warn on parallel. A Redis that
# cannot be reached yet (a deployment starting in another order) is waited for, up to 60 s.
check_runtime_at_start(sync_scheduler, "this web process")
settings.ALLOWED_HOSTS = get_config().allowed_host_names()

# WebSocket routes (Channels strips the leading slash); every other path gets a clean close (4404).
# Every handshake first passes HostOriginValidator: Host among ALLOWED_HOSTS, and an Origin (when
# there is one: browsers send it, API clients do not) that is this server's or in allowed_origins.
# The UI's routes add their session check and need an Origin naming an allowed host (ui/routing.py).
websocket_routes = HostOriginValidator(URLRouter([
    re_path(r"^v1/realtime/?$", RealtimeConsumer.as_asgi()),
    *ui_websocket_urlpatterns,
    re_path(r"", NoRouteConsumer.as_asgi()),
]))

application = ProtocolTypeRouter({"http": http_application(django_asgi_app), "websocket": websocket_routes})
