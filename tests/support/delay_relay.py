"""A TCP relay that adds latency and counts round trips: what ``tc netem`` would do to a link, for a
kernel without ``sch_netem`` (the test machine's has none), plus the count netem cannot give.

``python -m tests.support.delay_relay LISTEN UPSTREAM CONTROL`` (each ``host:port``) accepts
connections on ``LISTEN`` and joins each to a new connection to ``UPSTREAM``. Bytes from a client are
held ``delay_ms`` (± ``jitter_ms``, uniform) before they are sent on, in order; answers come back at
once, so each round trip between a client and the upstream takes ``delay_ms`` longer (netem's
``delay 20ms 5ms`` on the client's egress does the same). A **round trip** is counted each time a
client sends after the upstream last answered it (or first): a pipeline is one, a pub/sub message
pushed by the server is none.

The control port takes one line per connection and answers one line:
``delay <ms> <jitter_ms>`` → ``ok``; ``stats`` → ``round_trips <n> connections <n>``; ``reset`` (the
counters to zero) → ``ok``; ``abort <client ip>`` → ``aborted <n>``: every open connection of that client
is closed with a TCP reset (what a firewall that starts rejecting it sends). A connection whose upstream
closes is closed too (a Redis restart looks to its clients as it would without the relay).
"""
from __future__ import annotations

import asyncio
import random
import socket
import struct
import sys
import time

CHUNK_BYTES = 65536


class Relay:
    """The relay's state: the delay applied to client bytes and the counters of :meth:`stats`."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.delay_ms = 0.0
        self.jitter_ms = 0.0
        self.round_trips = 0
        self.connections = 0
        self.open: set[asyncio.StreamWriter] = set()

    def hold_s(self) -> float:
        """This chunk's delay in seconds (``delay_ms`` ± a uniform ``jitter_ms``, never below 0)."""
        return max(0.0, self.delay_ms + random.uniform(-self.jitter_ms, self.jitter_ms)) / 1000

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Join one client to a new upstream connection until either side closes."""
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        self.connections += 1
        self.open.add(writer)
        answered = [True]  # the upstream spoke last (or nobody yet): the client's next bytes start a round trip
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def client_to_queue() -> None:
            due = 0.0
            while data := await reader.read(CHUNK_BYTES):
                if answered[0]:
                    self.round_trips += 1
                    answered[0] = False
                due = max(due, time.monotonic() + self.hold_s())  # in order, as a link keeps it
                queue.put_nowait((due, data))
            queue.put_nowait((0.0, b""))

        async def queue_to_upstream() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    return
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                up_writer.write(data)
                await up_writer.drain()

        async def upstream_to_client() -> None:
            while data := await up_reader.read(CHUNK_BYTES):
                answered[0] = True
                writer.write(data)
                await writer.drain()

        tasks = [asyncio.ensure_future(t()) for t in (client_to_queue, queue_to_upstream, upstream_to_client)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.open.discard(writer)
            for w in (writer, up_writer):
                w.close()

    def abort(self, client_ip: str) -> int:
        """Reset (RST, not FIN) every open connection from ``client_ip``; how many."""
        victims = [w for w in self.open if w.get_extra_info("peername")[0] == client_ip]
        for writer in victims:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        return len(victims)

    async def control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer one control line (see the module doc)."""
        words = (await reader.readline()).decode().split()
        if words[:1] == ["delay"] and len(words) == 3:
            self.delay_ms, self.jitter_ms = float(words[1]), float(words[2])
            answer = "ok"
        elif words == ["stats"]:
            answer = f"round_trips {self.round_trips} connections {self.connections}"
        elif words == ["reset"]:
            self.round_trips = self.connections = 0
            answer = "ok"
        elif words[:1] == ["abort"] and len(words) == 2:
            answer = f"aborted {self.abort(words[1])}"
        else:
            answer = "error: delay <ms> <jitter_ms> | stats | reset | abort <client ip>"
        writer.write(answer.encode() + b"\n")
        await writer.drain()
        writer.close()


def _address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


async def main(listen: str, upstream: str, control: str) -> None:
    relay = Relay(_address(upstream))
    servers = [await asyncio.start_server(relay.serve, *_address(listen)),
               await asyncio.start_server(relay.control, *_address(control))]
    print("relay ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def ask(control: tuple[str, int], line: str, timeout_s: float = 5.0) -> str:
    """Send one control ``line`` to a relay's control address; its answer (one line, stripped)."""
    with socket.create_connection(control, timeout=timeout_s) as sock:
        sock.sendall(line.encode() + b"\n")
        return sock.makefile().readline().strip()


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python -m tests.support.delay_relay LISTEN UPSTREAM CONTROL (host:port each)")
    asyncio.run(main(*sys.argv[1:]))
