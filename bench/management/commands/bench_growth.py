"""``python manage.py bench_growth``: how a stack's costs grow with registered models, queued requests,
open realtime sessions and idle time, printed as one table (docs/benchmarks.md, "How cost grows with
work").

Starts its own ``manage.py serve`` stacks (legacy runtime, CPU, temporary SQLite, embedded Redis,
``lease_ttl_ms`` 5000; ``gate.servers.Server``) and stops every one of them at the end, also on Ctrl-C or SIGTERM:

1. **request overhead**: two stacks side by side, one with one registered model (``vad``, Silero VAD,
   loaded at start) and one with the same model and ``--models`` − 1 more silero_vad entries in its
   config file (``lazy``: registered, never loaded). ``--requests`` short silero_vad requests
   (``POST /v1/tasks/run``, the first ``CLIP_S`` s of the shipped sample) to each, the two stacks
   alternating request by request, on a keep-alive connection from this process; p50 wall time.
2. **idle CPU** of the same two stacks: after a few seconds of rest, user + system time from
   ``/proc/<pid>/stat`` of every process of each stack (serve, web, worker, fork server, model
   processes, Redis) over ``--idle-seconds`` in which nothing is sent, per minute.
3. **queued requests**, on a third stack (``vad``; ``held``, a fixture model, one slot as every model of
   the legacy runtime; ``whisper``, registered, never loaded, so that realtime sessions have a
   transcription model): ``held``'s only slot
   is taken by a request whose run waits at a fixture barrier; then, for each count of ``--queued``,
   requests to ``held`` are sent on sockets of their own until that many wait in its queue (counted in
   Redis; the requests come from a client, the queue is the server's). At each count:
   - the short silero_vad request to ``vad`` (p50 of ``--admission-requests``, whole request) and a
     request to ``held`` with ``busy_timeout_ms`` 1, which the admission probe refuses at once with 503
     (the holder has run longer than 1 ms: overdue): p50 of its whole round trip, i.e. the admission
     step of a request to the model with the queue, alternating with the silero_vad requests;
   - the web process's RSS (``VmRSS``) before and after the requests were queued: growth per request;
   - the CPU of the whole stack per minute over ``--wait-seconds`` while the requests wait.
   The waiting requests are then withdrawn by closing their connections, and the barrier released.
4. **realtime sessions** on the third stack, before the hold: ``--sessions`` WebSockets to
   ``/v1/realtime?intent=transcription`` (``websockets``), each with a ``session.update`` answered and
   one append of 0.1 s of silence (so its resampler and VAD state exist); the web process's RSS before
   they opened and while all are open: growth per session.

RSS is the median of ten ``/proc`` reads over half a second. The machine's other load moves every
figure; the ratios compare figures of one run.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import os
import signal
import socket
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import soundfile
import websockets
from django.core.management.base import BaseCommand, CommandError

from inference.runtime.context import KEYS

from gate.servers import Server

from bench.common import SAMPLE, KeepAliveConn, proc_cpu_s, proc_status_kb, quantile, stack_processes, task_body

CLIP_S = 1.0
"""Seconds of the shipped sample in every request this benchmark sends (a 32 KB WAV)."""
HELD, VAD, ASR = "held", "vad", "whisper"
BARRIER = "bench-growth-hold"
HOLD_LIMIT_S = 110
"""A fixture barrier gives up after 120 s (``inference.adapters.fixture_barrier``): the queued phase must
end before this much time has passed since the hold began, or its figures would be of a freed slot."""
REST_S = 5.0
"""Seconds a stack rests before its idle CPU is measured."""
LEASE_TTL_MS = 5000
"""``lease_ttl_ms`` of every stack (as ``gate.servers.Server`` starts them; the server's default is 30000). A
waiting request checks the holder's lease when it would expire, so this sets how often the waiters wake."""
OVERHEAD, ADMISSION, MEMORY, CPU = range(4)
"""The table's parts, in the order printed."""


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _clip() -> bytes:
    samples, rate = soundfile.read(SAMPLE, dtype="int16")
    buf = io.BytesIO()
    soundfile.write(buf, samples[: int(rate * CLIP_S)], rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _rss_bytes(pid: int) -> int:
    """Median ``VmRSS`` of ten reads over half a second."""
    values = []
    for _ in range(10):
        values.append(proc_status_kb(pid, "VmRSS") * 1024)
        time.sleep(0.05)
    return int(statistics.median(values))


def _stack_cpu_s(server: Server) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far) of every process of ``server``'s stack."""
    out = {}
    for pid, role in stack_processes(server.proc.pid).items():
        try:
            out[pid] = (role, proc_cpu_s(pid))
        except OSError:  # it exited meanwhile
            continue
    return out


def _cpu_used(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per role between two :func:`_stack_cpu_s` readings (processes alive at both)."""
    used: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        if pid in before:
            used[role] = used.get(role, 0.0) + seconds - before[pid][1]
    return used


def _start_all(tmp: Path, stacks: dict[str, list[dict]]) -> dict[str, Server]:
    """Start a stack (legacy runtime, CPU) per entry of ``stacks`` (name -> models) at once, each in a folder
    ``tmp/models-<name>``; if one fails or the start is interrupted, the others are stopped too."""
    with ThreadPoolExecutor(len(stacks)) as pool:
        futures = {}
        for name, models in stacks.items():
            (tmp / f"models-{name}").mkdir()
            futures[name] = pool.submit(Server, tmp / f"models-{name}", models, False,
                                        {"backend": "cpu", "lease_ttl_ms": LEASE_TTL_MS})
        try:
            return {name: future.result() for name, future in futures.items()}
        except BaseException:
            started = []
            for future in futures.values():
                try:
                    started.append(future.result())
                except BaseException:  # that one stopped itself (Server does on a failed start)
                    continue
            _stop_all(started)
            raise


def _stop_all(servers: list[Server]) -> None:
    """Stop ``servers`` at once (each: Ctrl-C, its drain, then kill after 60 s)."""
    with ThreadPoolExecutor(max(1, len(servers))) as pool:
        for done in [pool.submit(server.stop) for server in servers]:
            done.result()


class _Waiting:
    """Requests to ``held`` sent whole on connections of their own and never read: they wait in its queue
    until their connection is closed (a client that leaves withdraws its ticket, R8.1)."""

    def __init__(self, server: Server, body: bytes):
        self.server = server
        head = (f"POST /v1/tasks/run HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json"
                f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        self.request = head + body
        self.sockets: list[socket.socket] = []

    def queued(self) -> int:
        return int(self.server.redis.zcard(KEYS.queue(HELD)))

    def grow_to(self, count: int, base: int = 0, timeout_s: float = 120) -> None:
        """Send requests until ``count`` wait in ``held``'s queue (``base`` other tickets wait there too)."""
        while len(self.sockets) < count:
            sock = socket.create_connection(("127.0.0.1", self.server.port), timeout=30)
            self.sockets.append(sock)
            sock.sendall(self.request)
        self.wait_for(count + base, timeout_s)

    def wait_for(self, count: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while self.queued() != count:
            if time.monotonic() > deadline:
                raise CommandError(f"{self.queued()} requests wait in {HELD}'s queue, not {count}")
            time.sleep(0.05)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
        self.sockets.clear()


class Command(BaseCommand):
    help = "How request time, admission, memory and idle CPU grow with models, queued requests and sessions."

    def add_arguments(self, parser):
        parser.add_argument("--models", type=int, default=1000, help="registered models of the large stack "
                                                                     "(default 1000; one loaded, the rest never)")
        parser.add_argument("--requests", type=int, default=150,
                            help="silero_vad requests to each of the two stacks, alternating (default 150)")
        parser.add_argument("--queued", type=int, nargs="+", default=[0, 100, 1000],
                            help="counts of requests waiting on the held model, ascending (default 0 100 1000)")
        parser.add_argument("--admission-requests", type=int, default=100,
                            help="at each queued count: silero_vad requests and 503 refusals each (default 100)")
        parser.add_argument("--wait-seconds", type=float, default=10.0,
                            help="at each queued count: seconds over which the stack's CPU is read (default 10)")
        parser.add_argument("--sessions", type=int, default=100, help="realtime sessions open at once (default 100)")
        parser.add_argument("--idle-seconds", type=float, default=60.0,
                            help="seconds over which the idle stacks' CPU is read (default 60)")

    def handle(self, *args, **opts):
        logging.getLogger("httpx").setLevel(logging.WARNING)
        queued = opts["queued"]
        if opts["models"] < 2 or opts["requests"] < 1 or opts["admission_requests"] < 1 or opts["sessions"] < 1:
            raise CommandError("--models must be ≥ 2; --requests, --admission-requests and --sessions ≥ 1")
        if not queued or queued != sorted(queued) or queued[0] < 0:
            raise CommandError("--queued takes ascending counts ≥ 0")
        began = time.monotonic()
        clip = _clip()
        rows: list[tuple[int, tuple[str, ...]]] = []  # (item of the table, row)
        loads = [os.getloadavg()]
        previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM unwinds like Ctrl-C: servers stopped
        try:
            with tempfile.TemporaryDirectory(prefix="bench-growth-") as tmp:
                self.stdout.write(f"two stacks: 1 and {opts['models']} registered models ...")
                rows += self._registry_and_idle(Path(tmp), clip, opts)
                loads.append(os.getloadavg())
                self.stdout.write("a stack with a held model: realtime sessions, then queued requests ...")
                rows += self._queue_stack(Path(tmp), clip, opts)
                loads.append(os.getloadavg())
        except KeyboardInterrupt:
            raise CommandError("interrupted: every server this command started was stopped") from None
        finally:
            signal.signal(signal.SIGTERM, previous)
        self._print([row for _item, row in sorted(rows, key=lambda entry: entry[0])], loads,
                    time.monotonic() - began)

    # -- 1 and 2: registered models, idle CPU -------------------------------------------------------
    def _registry_and_idle(self, tmp: Path, clip: bytes, opts: dict) -> list[tuple]:
        count = opts["models"]
        vad = {"id": VAD, "family": "silero_vad", "lazy": False}
        others = [{"id": f"vad-{i:04d}", "family": "silero_vad", "lazy": True} for i in range(1, count)]
        servers = _start_all(tmp, {"1": [vad], str(count): [vad, *others]})
        try:
            body = json.dumps(task_body(VAD, clip)).encode()
            times = self._alternate({name: server.url for name, server in servers.items()}, body, opts["requests"])
            time.sleep(min(REST_S, opts["idle_seconds"]))
            before = {name: _stack_cpu_s(server) for name, server in servers.items()}
            time.sleep(opts["idle_seconds"])
            idle = {name: _cpu_used(before[name], _stack_cpu_s(server)) for name, server in servers.items()}
        finally:
            _stop_all(list(servers.values()))
        p50 = {name: statistics.median(values) for name, values in times.items()}
        one, many = p50["1"], p50[str(count)]
        how = (f"{opts['requests']} requests to each stack, alternating; {CLIP_S:g} s clip, "
               f"POST /v1/tasks/run, keep-alive; the other {count - 1} models lazy silero_vad entries in "
               "server.json, never loaded")
        per_min = 60 / opts["idle_seconds"]
        idle_how = (f"utime + stime from /proc/<pid>/stat of every process of the stack over "
                    f"{opts['idle_seconds']:g} s with nothing sent, both stacks at once")
        totals = {name: sum(used.values()) * per_min for name, used in idle.items()}
        rows = [(OVERHEAD, ("silero_vad request p50 (wall time)", "1 registered model", f"{one:.2f} ms", "1.00",
                            how)),
                (OVERHEAD, ("", f"{count:,} registered models", f"{many:.2f} ms", f"{many / one:.2f}",
                            f"p90 {quantile(times['1'], 0.9):.2f} / {quantile(times[str(count)], 0.9):.2f} ms"))]
        for index, (name, used) in enumerate(idle.items()):
            parts = ", ".join(f"{role} {seconds * per_min:.2f}" for role, seconds in sorted(
                used.items(), key=lambda item: -item[1]))
            rows.append((CPU, ("idle CPU of a whole stack, per minute" if index == 0 else "",
                               f"{int(name):,} registered model{'s' if name != '1' else ''}", f"{totals[name]:.2f} s",
                               f"{totals[name] / totals['1']:.2f}" if totals["1"] else "",
                               (idle_how + "; " if index == 0 else "") + parts)))
        return rows

    @staticmethod
    def _alternate(urls: dict[str, str], body: bytes, repeats: int) -> dict[str, list[float]]:
        """``repeats`` POSTs of ``body`` to each of ``urls`` (name -> URL), one to each in turn, after 10
        warm-ups each; wall milliseconds per name."""
        conns = {name: KeepAliveConn(url) for name, url in urls.items()}
        times: dict[str, list[float]] = {name: [] for name in urls}
        try:
            for index in range(10 + repeats):
                for name, conn in conns.items():
                    status, data, ms = conn.post_json("/v1/tasks/run", body)
                    if status != 200:
                        raise CommandError(f"silero_vad on the {name}-model stack answered {status}: {data[:300]!r}")
                    if index >= 10:
                        times[name].append(ms)
        finally:
            for conn in conns.values():
                conn.close()
        return times

    # -- 3 and 4: queued requests, realtime sessions ------------------------------------------------
    def _queue_stack(self, tmp: Path, clip: bytes, opts: dict) -> list[tuple]:
        (tmp / "queue").mkdir()
        models = [{"id": VAD, "family": "silero_vad", "lazy": False},
                  {"id": HELD, "family": "fixture", "lazy": False},
                  {"id": ASR, "family": "whisper", "task": "asr", "lazy": True}]
        server = Server(tmp / "queue", models, parallel=False,
                        extra_config={"backend": "cpu", "lease_ttl_ms": LEASE_TTL_MS})
        holder: socket.socket | None = None
        waiting = _Waiting(server, json.dumps(task_body(HELD, clip, busy_timeout_ms=600000)).encode())
        try:
            web = server.web().pid
            sessions = asyncio.run(self._sessions(server, web, opts["sessions"]))
            vad_body = json.dumps(task_body(VAD, clip)).encode()
            refused_body = json.dumps(task_body(HELD, clip, busy_timeout_ms=1)).encode()
            conn = KeepAliveConn(server.url)
            try:
                for _ in range(10):  # warm: the models' first runs, a queued request and its withdrawal
                    for body in (vad_body, json.dumps(task_body(HELD, clip)).encode()):
                        status, data, _ms = conn.post_json("/v1/tasks/run", body)
                        if status != 200:
                            raise CommandError(f"a warm-up request answered {status}: {data[:300]!r}")
                holder = self._hold(server, json.dumps(task_body(HELD, clip, barrier=BARRIER,
                                                                 busy_timeout_ms=600000)).encode())
                held_at = time.monotonic()
                waiting.grow_to(20)
                waiting.close()
                waiting.wait_for(0)
                phases = []
                for count in opts["queued"]:
                    rss_before = _rss_bytes(web)
                    waiting.grow_to(count)
                    time.sleep(0.5)
                    rss_after = _rss_bytes(web)
                    cpu_before = _stack_cpu_s(server)
                    time.sleep(opts["wait_seconds"])
                    cpu = _cpu_used(cpu_before, _stack_cpu_s(server))
                    vad_ms, refused_ms = self._admission(conn, vad_body, refused_body, opts["admission_requests"])
                    if waiting.queued() != count or time.monotonic() - held_at > HOLD_LIMIT_S:
                        raise CommandError(f"the hold did not last the phase of {count} queued requests "
                                           f"({waiting.queued()} waiting after {time.monotonic() - held_at:.0f} s; "
                                           "lower --queued, --admission-requests or --wait-seconds)")
                    phases.append({"count": count, "vad": vad_ms, "refused": refused_ms, "cpu": cpu,
                                   "rss": (rss_before, rss_after)})
            finally:
                conn.close()
            waiting.close()
            waiting.wait_for(0)
            server.redis.lpush(KEYS.fixture_release(BARRIER), "go")
            answer = holder.recv(64)
            if not answer.startswith(b"HTTP/1.1 200"):
                raise CommandError(f"the held request answered {answer!r}")
        finally:
            waiting.close()
            if holder is not None:
                server.redis.lpush(KEYS.fixture_release(BARRIER), "go")  # a second "go" finds no waiter: harmless
                holder.close()
            server.stop()
        return self._queue_rows(phases, sessions, opts, len(waiting.request))

    @staticmethod
    def _hold(server: Server, body: bytes) -> socket.socket:
        """Send a request to ``held`` whose run waits at ``BARRIER``; return its connection once it waits."""
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=HOLD_LIMIT_S + 30)
        sock.sendall((f"POST /v1/tasks/run HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: "
                      f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
        deadline = time.monotonic() + 30
        while int(server.redis.get(KEYS.fixture_arrived(BARRIER)) or 0) < 1:
            if time.monotonic() > deadline:
                sock.close()
                raise CommandError(f"the request holding {HELD} did not reach its barrier within 30 s")
            time.sleep(0.02)
        return sock

    @staticmethod
    def _admission(conn: KeepAliveConn, vad_body: bytes, refused_body: bytes,
                   repeats: int) -> tuple[list[float], list[float]]:
        """``repeats`` rounds of one silero_vad request (200) and one request refused at admission (503)."""
        vad_ms: list[float] = []
        refused_ms: list[float] = []
        for _ in range(repeats):
            for body, expected, times in ((vad_body, 200, vad_ms), (refused_body, 503, refused_ms)):
                status, data, ms = conn.post_json("/v1/tasks/run", body)
                if status != expected or (status == 503 and b"overdue" not in data):
                    raise CommandError(f"expected {expected}{' overdue' if expected == 503 else ''}, got {status}: "
                                       f"{data[:300]!r}")
                times.append(ms)
        return vad_ms, refused_ms

    @staticmethod
    async def _sessions(server: Server, web: int, count: int) -> tuple[int, int]:
        """Open one realtime session and close it (warm: the web process's VAD), then ``count`` at once;
        the web process's RSS before they opened and while all are open."""
        url = server.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
        silence = base64.b64encode(np.zeros(2400, dtype="<i2").tobytes()).decode()  # 0.1 s at 24 kHz

        async def open_one() -> websockets.ClientConnection:
            ws = await websockets.connect(url, max_size=None)
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {
                "input": {"transcription": {"model": ASR, "language": "en"}}}}}))
            while json.loads(await ws.recv())["type"] != "session.updated":
                pass
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": silence}))
            return ws

        await (await open_one()).close()
        await asyncio.sleep(0.5)
        before = await asyncio.to_thread(_rss_bytes, web)
        opened: list = []
        try:
            for _ in range(count):
                opened.append(await open_one())
            await asyncio.sleep(0.5)  # the appends are handled
            during = await asyncio.to_thread(_rss_bytes, web)
        finally:
            await asyncio.gather(*(ws.close() for ws in opened), return_exceptions=True)
        return before, during

    @staticmethod
    def _queue_rows(phases: list[dict], sessions: tuple[int, int], opts: dict, request_bytes: int) -> list[tuple]:
        wait_s = opts["wait_seconds"]
        rows = []
        base = phases[0]
        how = {"vad": f"{opts['admission_requests']} requests to the free model vad, whole round trip, "
                      f"alternating with the refusals below; the waiting requests are HTTP requests to {HELD} from "
                      f"this process, each on its own connection, behind a request held at a fixture barrier",
               "refused": f"{opts['admission_requests']} requests to {HELD} with busy_timeout_ms 1, refused by the "
                          "admission probe (the holder is overdue for them) before their audio is read; whole "
                          "round trip"}
        for key, what in (("vad", "silero_vad request p50 on another model"),
                          ("refused", "admission p50 on the model with the queue (503 at once)")):
            first = statistics.median(base[key])
            for index, phase in enumerate(phases):
                p50 = statistics.median(phase[key])
                rows.append((ADMISSION, (what if index == 0 else "", f"{phase['count']:,} queued", f"{p50:.2f} ms",
                                         f"{p50 / first:.2f}", how[key] if index == 0 else "")))
        previous = 0
        first_memory = True
        for phase in phases:
            added = phase["count"] - previous
            previous = phase["count"]
            if added <= 0:
                continue
            rss_before, rss_after = phase["rss"]
            rows.append((MEMORY, ("web process RSS per queued request" if first_memory else "",
                                  f"{phase['count']:,} queued (+{added:,})",
                                  f"{(rss_after - rss_before) / added / 1000:.1f} KB", "",
                                  f"VmRSS after − before the {added:,} were queued, ÷ {added:,}; each request "
                                  f"{request_bytes / 1000:.1f} KB on the wire")))
            first_memory = False
        base_cpu = sum(base["cpu"].values())
        for index, phase in enumerate(phases):
            total = sum(phase["cpu"].values()) * 60 / wait_s
            parts = ", ".join(f"{role} {seconds * 60 / wait_s:.2f}" for role, seconds in sorted(
                phase["cpu"].items(), key=lambda item: -item[1]) if seconds * 60 / wait_s >= 0.005)
            rows.append((CPU, ("CPU of the stack per minute while requests wait" if index == 0 else "",
                               f"{phase['count']:,} queued", f"{total:.2f} s",
                               f"{total / (base_cpu * 60 / wait_s):.2f}" if base_cpu else "",
                               (f"/proc over {wait_s:g} s, nothing else sent, lease_ttl_ms {LEASE_TTL_MS}; "
                                if index == 0 else "") + parts)))
        before, during = sessions
        rows.insert(0, (MEMORY, ("web process RSS per open realtime session", f"{opts['sessions']:,} sessions",
                                 f"{(during - before) / opts['sessions'] / 1000:.1f} KB", "",
                                 f"VmRSS with all open − before, ÷ {opts['sessions']}; websockets, session.update "
                                 "answered, one 0.1 s append each")))
        return rows

    def _print(self, rows: list[tuple[str, ...]], loads: list[tuple[float, float, float]], elapsed_s: float) -> None:
        out = self.stdout.write
        out("\n| what | with | figure | ratio | how |\n|---|---|---|---|---|")
        for row in rows:
            out("| " + " | ".join(row) + " |")
        shown = "; ".join(" ".join(f"{x:.2f}" for x in load) for load in loads)
        out(f"\n({elapsed_s:.0f} s, {os.cpu_count()} CPUs, load average at the start, after the two stacks, "
            f"at the end: {shown})")
