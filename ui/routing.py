"""WebSocket routes of the UI, included by ``audiosite.asgi`` (beside the API's own)."""
from django.urls import path

from .consumers import StatusConsumer

websocket_urlpatterns = [
    path("ui/ws/status", StatusConsumer.as_asgi()),
]
