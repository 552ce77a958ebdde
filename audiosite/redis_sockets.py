"""The TCP options of every Redis connection audiosite's processes open (no Django: settings use it)."""
from __future__ import annotations

import socket

REDIS_USER_TIMEOUT_MS = 30000
"""How long data sent to Redis may stay unacknowledged before the connection is dropped
(``TCP_USER_TIMEOUT``; also when keepalive probes go unanswered): a command sent into a silent
partition (packets dropped, nothing reset) fails with ``ConnectionError`` after this, instead of
waiting on TCP's retransmissions for up to about 15 minutes. A Redis that is alive but does not read
(its process frozen, ``CLIENT PAUSE``) lets a large write stall at a zero window, and Linux counts
that against this timeout too: 30 s, three times the 10 s liveness TTL (``LIVENESS_TTL_MS``), so a
stall that this timeout cuts has already made the processes take one another for dead (an 8 s value
cut a 50 MB upload that Redis stopped reading for 12 s)."""
REDIS_KEEPALIVE_IDLE_S = 5
REDIS_KEEPALIVE_INTERVAL_S = 1
REDIS_KEEPALIVE_PROBES = 3
"""TCP keepalive of the Redis connections: an idle connection (the pub/sub subscription waiting for
a message, a pooled one) is probed after 5 s without traffic, then every second; with the user
timeout set, Linux drops it once :data:`REDIS_USER_TIMEOUT_MS` passed without an answer (redis-py's
own keepalive, 30 s idle and 3 probes 5 s apart, noticed a dead peer after 45 s)."""


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
