"""``python manage.py bench_decode_memory``: how much the web process grows for uploads that decode big.

Issue 9 item 2: "12 requests of an 89 KB FLAC holding 30 min of silence took
the web process from 328 MB to 2.1 GB for the whole busy timeout". Target:
the same 12 requests grow the web process's RSS by at most 150 MB.

Starts ``manage.py serve --parallel-jobs`` (embedded Redis, temporary SQLite,
fixture family enabled: its runs cost nothing, so the web process's decoding
is what is measured), unless ``--url`` names a running server that has the
same models (``MODELS`` below; find the web process with ``--web-pid``, or
by the port it listens on). The upload: 30 min of 16 kHz mono silence as a
16-bit FLAC (89 KB; 115.2 MB once decoded to float32). Two phases, each
sending 12 such requests at once while a thread samples the web process's
``VmRSS`` (``/proc/<pid>/status``) every 10 ms, and its ``VmHWM`` reset
first when the kernel allows (``/proc/<pid>/clear_refs``):

1. *queued* (the issue's case): ``bench-held`` (one slot) is kept busy by a
   request that sleeps on the worker; the 12 queue behind it for their
   ``busy_timeout_ms`` and get 503 ``queue_timeout``;
2. *granted* (the worst case for decoding): ``bench-wide-1..3`` (4 slots
   each) admit all 12 at once; the decode budget lets as many decode as fit
   (``max_decoded_bytes_in_flight``) and answers the rest 503 ``decode_budget``.

It prints the baseline (median RSS over the second before the requests), the
peak, the growth in MB (10^6 bytes), the answers, and PASS/FAIL against
``--limit-mb`` (150) per phase.
"""
from __future__ import annotations

import asyncio
import base64
import io
import logging
import os
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import psutil
import soundfile
from django.core.management.base import BaseCommand, CommandError

from gate.servers import Server

from bench.common import proc_status_kb

HELD = "bench-held"
WIDE = [f"bench-wide-{i}" for i in (1, 2, 3)]
MODELS = [{"id": HELD, "family": "fixture", "slots": 1},
          *[{"id": model_id, "family": "fixture", "slots": 4} for model_id in WIDE]]
MB = 1_000_000


def silent_flac(seconds: int, rate: int = 16000) -> bytes:
    """A 16-bit mono FLAC of ``seconds`` of digital silence, written in 10 s pieces."""
    buf = io.BytesIO()
    piece = np.zeros(rate * 10, dtype=np.float32)
    with soundfile.SoundFile(buf, "w", rate, 1, format="FLAC", subtype="PCM_16") as out:
        for start in range(0, seconds, 10):
            out.write(piece[: rate * min(10, seconds - start)])
    return buf.getvalue()


class RssSampler:
    """Samples ``VmRSS`` of ``pid`` every ``interval_s`` in a thread; ``VmHWM`` is reset at start when allowed."""

    def __init__(self, pid: int, interval_s: float = 0.01):
        self.pid = pid
        self.interval_s = interval_s
        self.samples_bytes: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.hwm_reset = False

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples_bytes.append(proc_status_kb(self.pid, "VmRSS") * 1024)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # reset the peak to the current RSS
            self.hwm_reset = True
        except OSError:
            pass
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def peak_bytes(self) -> int:
        """The highest RSS seen: the sampled maximum, or the kernel's peak when it could be reset."""
        peak = max(self.samples_bytes)
        if self.hwm_reset:
            peak = max(peak, proc_status_kb(self.pid, "VmHWM") * 1024)
        return peak


def _body(model: str, data: bytes, busy_timeout_ms: int | None = None, **options) -> dict:
    body: dict = {"model": model, "request": {"audio_base64": base64.b64encode(data).decode(), "options": options}}
    if busy_timeout_ms is not None:
        body["busy_timeout_ms"] = busy_timeout_ms
    return body


def _answer(resp: httpx.Response) -> str:
    if resp.status_code == 200:
        return "200"
    return f"{resp.status_code} {resp.json()['error'].get('code')}"


class Command(BaseCommand):
    help = "Web process RSS growth for 12 uploads of 30 min of silence (89 KB FLAC each): queued, then granted."

    def add_arguments(self, parser):
        parser.add_argument("--url", help="a running audiosite with the models of this command (default: start one)")
        parser.add_argument("--web-pid", type=int, help="the web process of --url (default: the one listening on "
                                                        "its port)")
        parser.add_argument("--requests", type=int, default=12)
        parser.add_argument("--seconds", type=int, default=1800, help="silence per upload (default 1800)")
        parser.add_argument("--busy-timeout-ms", type=int, default=8000, help="of the queued requests")
        parser.add_argument("--budget-bytes", type=int, help="max_decoded_bytes_in_flight of the started server "
                                                             "(default: the server's default)")
        parser.add_argument("--limit-mb", type=float, default=150.0)

    def handle(self, *args, **opts):
        logging.getLogger("httpx").setLevel(logging.WARNING)
        began = time.monotonic()
        data = silent_flac(opts["seconds"])
        server = None
        with tempfile.TemporaryDirectory(prefix="bench-decode-memory-") as tmp:
            try:
                if opts["url"]:
                    url = opts["url"].rstrip("/")
                    pid = opts["web_pid"] or self._listening_pid(url)
                else:
                    extra = {"max_audio_seconds": max(1800, opts["seconds"])}
                    if opts["budget_bytes"] is not None:
                        extra["max_decoded_bytes_in_flight"] = opts["budget_bytes"]
                    self.stdout.write("starting audiosite (manage.py serve --parallel-jobs, fixture models, SQLite, "
                                      "embedded Redis) ...")
                    server = Server(Path(tmp), MODELS, parallel=True, extra_config=extra)
                    url, pid = server.url, server.web().pid
                phases = asyncio.run(self._measure(url, pid, data, opts))
            finally:
                if server is not None:
                    server.stop()
        self._report(phases, data, pid, opts, time.monotonic() - began)

    @staticmethod
    def _listening_pid(url: str) -> int:
        port = urlsplit(url).port
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return conn.pid
        raise CommandError(f"no process of this user listens on port {port}; give --web-pid")

    async def _baseline(self, pid: int) -> int:
        values = []
        for _ in range(50):
            values.append(proc_status_kb(pid, "VmRSS") * 1024)
            await asyncio.sleep(0.02)
        return int(statistics.median(values))

    async def _burst(self, client: httpx.AsyncClient, pid: int, bodies: list[dict]) -> dict:
        baseline = await self._baseline(pid)
        started = time.monotonic()
        with RssSampler(pid) as sampler:
            answers = await asyncio.gather(*(client.post("/v1/tasks/run", json=body) for body in bodies))
        return {"baseline": baseline, "peak": sampler.peak_bytes(), "seconds": time.monotonic() - started,
                "answers": Counter(_answer(resp) for resp in answers), "hwm": sampler.hwm_reset}

    async def _measure(self, url: str, pid: int, data: bytes, opts: dict) -> dict:
        tiny = silent_flac(1)
        count, timeout_ms = opts["requests"], opts["busy_timeout_ms"]
        phases = {}
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)) as client:
            for model_id in [HELD, *WIDE]:  # warm: loaded, and the first decode done (code pages in)
                resp = await client.post("/v1/tasks/run", json=_body(model_id, tiny))
                if resp.status_code != 200:
                    raise CommandError(f"{model_id}: {resp.status_code} {resp.text[:300]}")
            hold_ms = min(60000, timeout_ms + 5000)
            holder = asyncio.create_task(client.post("/v1/tasks/run", json=_body(HELD, tiny, sleep_ms=hold_ms)))
            deadline = time.monotonic() + 30
            while (await client.get(f"/v1/models/{HELD}")).json().get("active_slots") != 1:
                if time.monotonic() > deadline:
                    raise CommandError(f"{HELD} did not become busy")
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # the holder's input is in Redis and its run sleeps
            phases["queued"] = await self._burst(client, pid, [_body(HELD, data, timeout_ms) for _ in range(count)])
            (await holder).raise_for_status()
            phases["granted"] = await self._burst(client, pid, [_body(WIDE[i % len(WIDE)], data)
                                                                for i in range(count)])
        return phases

    def _report(self, phases: dict, data: bytes, pid: int, opts: dict, elapsed_s: float) -> None:
        out = self.stdout.write
        limit = opts["limit_mb"]
        decoded_mb = opts["seconds"] * 16000 * 4 / MB
        out(f"\n{opts['requests']} requests at once, each a {len(data) / 1000:.0f} KB FLAC of {opts['seconds']} s "
            f"of 16 kHz silence ({decoded_mb:.1f} MB decoded); web process {pid}; RSS in MB (10^6 bytes)")
        out("| phase | what | baseline | peak | growth | answers | verdict |\n|---|---|---|---|---|---|---|")
        what = {"queued": f"queued behind a busy 1-slot model, busy_timeout_ms={opts['busy_timeout_ms']}",
                "granted": "granted at once (3 models x 4 slots)"}
        for name, phase in phases.items():
            growth = (phase["peak"] - phase["baseline"]) / MB
            answers = ", ".join(f"{n} x {a}" for a, n in sorted(phase["answers"].items()))
            out(f"| {name} | {what[name]} | {phase['baseline'] / MB:.0f} | {phase['peak'] / MB:.0f} | "
                f"{growth:.1f} | {answers} | {'PASS' if growth <= limit else 'FAIL'} (≤ {limit:g}) |")
        sampled = "VmRSS every 10 ms and VmHWM" if all(p["hwm"] for p in phases.values()) else "VmRSS every 10 ms"
        out(f"\n(peak: {sampled}; {elapsed_s:.0f} s, {os.cpu_count()} CPUs, load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
