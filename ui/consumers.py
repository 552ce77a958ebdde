"""WebSocket ``/ui/ws/status``: the live status of every model, pushed on each change (``ui.live``).

Access follows the pages: with ``ui`` off the handshake is refused; a visitor
who is not logged in is refused when ``ui_anonymous`` is ``none``, and is sent
status messages only (no audit rows, no activity rows: they name users and
client addresses) when it is ``status``. The client sends
nothing; what it sends is ignored.
"""
from __future__ import annotations

import asyncio

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from audiosite.serverconfig import get_config

from .live import status_hub


class StatusConsumer(AsyncJsonWebsocketConsumer):
    """Forwards :class:`ui.live.StatusHub` messages to one browser (see the module doc)."""

    async def connect(self) -> None:
        config = get_config()
        user = self.scope.get("user")
        self.logged_in = bool(user is not None and user.is_authenticated)
        if not config.ui or (not self.logged_in and config.ui_anonymous == "none"):
            await self.close()  # before accept: the handshake is refused (HTTP 403)
            return
        await self.accept()
        self.hub = status_hub()
        self.queue = await self.hub.subscribe()
        self.pump = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        while True:
            message = await self.queue.get()
            if message["type"] in ("event", "activity") and not self.logged_in:
                continue
            await self.send_json(message)

    async def receive_json(self, content, **kwargs) -> None:
        """Clients have nothing to say on this stream."""

    async def disconnect(self, code) -> None:
        pump = getattr(self, "pump", None)
        if pump is not None:
            pump.cancel()
            self.hub.unsubscribe(self.queue)
