"""WebSocket routes of the UI, included by ``audiosite.asgi`` (beside the API's own)."""
from channels.auth import AuthMiddlewareStack
from channels.security.websocket import AllowedHostsOriginValidator
from django.urls import path

from .consumers import StatusConsumer

websocket_urlpatterns = [
    # The session user (AuthMiddlewareStack), and an Origin check against ALLOWED_HOSTS, so another
    # site's page cannot open it with our cookies.
    path("ui/ws/status", AllowedHostsOriginValidator(AuthMiddlewareStack(StatusConsumer.as_asgi()))),
]
