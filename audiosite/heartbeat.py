"""The event-loop heartbeat of a web process, read by ``manage.py serve`` (``audiosite.supervision``).

``serve`` starts its web process with the write end of a pipe, named by the environment variable
:data:`HEARTBEAT_FD_ENV`. A task on the web process's event loop (the asyncio loop under daphne's
reactor) writes one line to it every :data:`BEAT_EVERY_S`:

- ``.`` — the loop turned (the line is written by a task of the loop, so it stops when the loop
  stops turning: a coroutine that never yields, a blocking call, a stopped process);
- ``chan <channel>`` — once, as soon as the process's scheduler listener exists: the pub/sub
  channel its queued tickets name (``Keys.process_channel``), so that ``serve`` can end the
  process's liveness key (R7.5) at once when the process dies or is killed.

This is a liveness check of the loop, not of the port: a process whose loop spins still accepts
TCP connections (the kernel completes the handshake) but answers nothing. Without the variable
(a web process not started by ``serve``) nothing is written.
"""
from __future__ import annotations

import asyncio
import logging
import os

from inference.runtime.context import async_context

log = logging.getLogger("audiosite.web")

HEARTBEAT_FD_ENV = "AUDIOSITE_WEB_HEARTBEAT_FD"
"""Environment variable: the file descriptor (an inherited pipe's write end) the beats go to."""
BEAT_EVERY_S = 0.25
"""How often the loop writes a beat, in seconds (``web_stall_timeout_ms`` is at least 2000: 8 beats)."""
CHANNEL_RETRY_S = 1.0
"""How long to wait before asking again for the listener's channel when Redis could not be reached."""


def _write(fd: int, line: bytes) -> bool:
    """Write one line without blocking; False once the reader is gone (``serve`` exited)."""
    try:
        os.write(fd, line)
    except BlockingIOError:  # serve is behind on reading: a beat lost is no harm, the next one comes
        pass
    except OSError:  # EPIPE: nobody reads any more
        return False
    return True


async def _beat(fd: int) -> None:
    while _write(fd, b".\n"):
        await asyncio.sleep(BEAT_EVERY_S)


async def _announce_channel(fd: int) -> None:
    while True:
        try:
            ctx = await async_context()
        except Exception as exc:  # Redis not reachable yet: the beats go on, the channel comes later
            log.warning("heartbeat: no scheduler listener yet (%s); retrying", exc)
            await asyncio.sleep(CHANNEL_RETRY_S)
            continue
        _write(fd, f"chan {ctx.listener.channel}\n".encode())
        return


def start() -> list[asyncio.Task]:
    """Start the beat on the running event loop (call from the loop: daphne's reactor calls it once it
    runs). Returns the tasks started (none when :data:`HEARTBEAT_FD_ENV` is unset).

    Raises:
        ValueError: :data:`HEARTBEAT_FD_ENV` is set but not an integer.
    """
    raw = os.environ.get(HEARTBEAT_FD_ENV)
    if not raw:
        return []
    fd = int(raw)
    os.set_blocking(fd, False)
    tasks = [asyncio.ensure_future(_beat(fd)), asyncio.ensure_future(_announce_channel(fd))]
    _TASKS.extend(tasks)  # the loop keeps only weak references to tasks
    return tasks


_TASKS: list[asyncio.Task] = []
