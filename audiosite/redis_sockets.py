"""The TCP options of every Redis connection audiosite's processes open (no Django: settings use it)."""
from __future__ import annotations

import socket

REDIS_USER_TIMEOUT_MS = 8000
"""How long data sent to Redis may stay unacknowledged by its host before the connection is dropped
(``TCP_USER_TIMEOUT``): a command sent into a silent partition (packets dropped, nothing reset) fails
with ``ConnectionError`` after this, instead of waiting on TCP's retransmissions for up to about 15
minutes. The Redis host's kernel acknowledges at once, however long Redis takes to answer, so a slow
command or a long script is not cut."""
REDIS_KEEPALIVE_IDLE_S = 5
REDIS_KEEPALIVE_INTERVAL_S = 1
REDIS_KEEPALIVE_PROBES = 3
"""TCP keepalive of the Redis connections: an idle connection (the pub/sub subscription waiting for
a message, a pooled one) whose peer is gone is noticed after about 5 + 3 x 1 s (redis-py's own
defaults, 30 s and 3 x 5 s, take 45 s)."""


def redis_socket_kwargs(url: str) -> dict:
    """redis-py keyword arguments for the TCP options of audiosite's Redis connections to ``url``:
    keepalive on, with :data:`REDIS_USER_TIMEOUT_MS` and the keepalive timing above (set with
    ``IPPROTO_TCP``; an option this platform lacks is left out: ``TCP_USER_TIMEOUT`` is Linux's).
    Empty for a unix socket URL (redis-py's unix connections take no keepalive arguments)."""
    if not url.startswith(("redis://", "rediss://")):
        return {}
    wanted = {"TCP_USER_TIMEOUT": REDIS_USER_TIMEOUT_MS, "TCP_KEEPIDLE": REDIS_KEEPALIVE_IDLE_S,
              "TCP_KEEPINTVL": REDIS_KEEPALIVE_INTERVAL_S, "TCP_KEEPCNT": REDIS_KEEPALIVE_PROBES}
    return {"socket_keepalive": True,
            "socket_keepalive_options": {getattr(socket, name): value for name, value in wanted.items()
                                         if hasattr(socket, name)}}
