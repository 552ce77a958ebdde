"""``python manage.py bench_worker_memory``: does the worker give memory back after an unload?

Starts its own ``manage.py serve --parallel-jobs --ui-management`` (embedded
Redis, a temporary SQLite database, lazy loading, no configured model; see
``gate.servers.Server``) and runs ``--cycles`` cycles of, through the HTTP API:

1. ``POST /v1/models/load`` of one model of ``--family`` with ``--slots``
   slots (a management token from ``manage.py issue_token``);
2. ``--requests`` requests sent at once to ``POST /v1/tasks/run`` with the
   shipped sample (``samples/librispeech_test_clean_6930-75918-0000.wav``,
   3.5 s); every answer must be 200;
3. ``POST /v1/models/unload``, which returns once the worker has destroyed
   the pool;

and after each unload reads the worker's ``VmRSS``, ``RssAnon`` and
``Threads`` from ``/proc/<pid>/status`` (Linux only; the pid comes from the
``as:wpid`` hash the worker publishes, ``Keys.worker_pid``). It prints one
row per cycle and the verdict: the RSS after the last cycle
is within 15 % of the RSS after cycle 5 (PASS/FAIL). The report is also
written as JSON (``--out``, default ``var/bench_worker_memory.json``).

The worker's environment is ``serve``'s, so an allocator variable set in the
calling shell (e.g. ``MALLOC_ARENA_MAX``) reaches it unless ``serve`` sets
its own; the report records what the worker really had.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from inference.runtime.context import KEYS

from gate.servers import Server

from bench.common import SAMPLE, task_body

BASELINE_CYCLE = 5  # the issue's reference point: the allocator has settled after a few cycles
TOLERANCE_PCT = 15.0  # last-cycle RSS within 15 % of the cycle-5 RSS
MODEL_ID = "mem"
ALLOCATOR_ENV = ("MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "LD_PRELOAD")


def process_status(pid: int) -> dict:
    """Memory and thread figures of a live process, from ``/proc/<pid>/status``.

    Returns:
        ``{"rss_mb", "rss_anon_mb", "rss_file_mb"}`` in MiB (the kernel reports
        kB = KiB) and ``{"threads"}`` as a count.

    Raises:
        OSError: no such process, or not Linux.
    """
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        fields[name] = value.split()
    return {"rss_mb": round(int(fields["VmRSS"][0]) / 1024, 1),
            "rss_anon_mb": round(int(fields["RssAnon"][0]) / 1024, 1),
            "rss_file_mb": round(int(fields["RssFile"][0]) / 1024, 1),
            "threads": int(fields["Threads"][0])}


def process_environ(pid: int) -> dict[str, str]:
    """The environment a process was started with, from ``/proc/<pid>/environ`` (Linux)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


class Command(BaseCommand):
    help = "Worker RSS after each of N load → requests → unload cycles, and whether it stays flat."

    def add_arguments(self, parser):
        parser.add_argument("--cycles", type=int, default=50, help=f"cycles to run (≥ {BASELINE_CYCLE}; default 50)")
        parser.add_argument("--family", default="whisper", choices=["whisper", "silero_vad"])
        parser.add_argument("--slots", type=int, default=1, help="slots of the loaded pool (default 1)")
        parser.add_argument("--requests", type=int, default=4, help="requests per cycle, sent at once (default 4)")
        parser.add_argument("--out", default=str(Path(settings.VAR_DIR) / "bench_worker_memory.json"))

    def handle(self, *args, **opts):
        if opts["cycles"] < BASELINE_CYCLE:
            raise CommandError(f"--cycles must be at least {BASELINE_CYCLE} (the verdict compares with cycle "
                               f"{BASELINE_CYCLE})")
        if not Path("/proc/self/status").exists():
            raise CommandError("this benchmark reads /proc/<pid>/status and needs Linux")
        logging.getLogger("httpx").setLevel(logging.WARNING)
        self.wav = SAMPLE.read_bytes()
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
            server = Server(Path(tmp), [], parallel=True, extra_config={"ui_management": True, "backend": "cpu"})
            try:
                server.token = server.issue_token("bench")
                report = asyncio.run(self._cycles(server, opts))
            finally:
                server.stop()
        report["seconds"] = round(time.monotonic() - started)
        report["load_average"] = [round(x, 2) for x in os.getloadavg()]
        Path(opts["out"]).parent.mkdir(parents=True, exist_ok=True)
        Path(opts["out"]).write_text(json.dumps(report, indent=2))
        self._print(report)

    @staticmethod
    def _worker_pid(server: Server) -> int:
        pids = list(server.redis.hgetall(KEYS.worker_pid).values())
        if len(pids) != 1:
            raise CommandError(f"expected one worker in {KEYS.worker_pid}, found {pids}")
        return int(pids[0])

    async def _cycles(self, server: Server, opts: dict) -> dict:
        pid = self._worker_pid(server)
        environ = process_environ(pid)
        entry = {"id": MODEL_ID, "family": opts["family"], "slots": opts["slots"], "lazy": False}
        rows = [{"cycle": 0, **process_status(pid)}]
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     headers={"Authorization": f"Token {server.token}"}) as c:
            for cycle in range(1, opts["cycles"] + 1):
                r = await c.post("/v1/models/load", json=entry)
                if r.status_code != 200 or r.json().get("loaded") is not True:
                    raise CommandError(f"cycle {cycle}: load answered {r.status_code} {r.text}")
                answers = await asyncio.gather(*[c.post("/v1/tasks/run", json=task_body(MODEL_ID, self.wav))
                                                 for _ in range(opts["requests"])])
                bad = [a for a in answers if a.status_code != 200]
                if bad:
                    raise CommandError(f"cycle {cycle}: a request answered {bad[0].status_code} {bad[0].text}")
                r = await c.post("/v1/models/unload", json={"id": MODEL_ID})
                if r.status_code != 200:
                    raise CommandError(f"cycle {cycle}: unload answered {r.status_code} {r.text}")
                rows.append({"cycle": cycle, **process_status(pid)})
                self.stderr.write(f"cycle {cycle}: {rows[-1]['rss_mb']} MB, {rows[-1]['threads']} threads")
        base, last = rows[BASELINE_CYCLE]["rss_mb"], rows[-1]["rss_mb"]
        change_pct = 100 * (last - base) / base
        return {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
                "date": datetime.now(UTC).strftime("%Y-%m-%d"),
                "family": opts["family"], "slots": opts["slots"], "requests_per_cycle": opts["requests"],
                "worker_allocator_env": {k: environ[k] for k in ALLOCATOR_ENV if k in environ},
                "rows": rows, "baseline_cycle": BASELINE_CYCLE, "change_pct": round(change_pct, 1),
                "pass": abs(change_pct) <= TOLERANCE_PCT}

    def _print(self, report: dict) -> None:
        w = self.stdout.write
        rows = report["rows"]
        w(f"{report['family']}, {report['slots']} slot(s), {report['requests_per_cycle']} requests per cycle; "
          f"worker allocator env: {report['worker_allocator_env'] or 'none'}")
        w("| cycle | RSS MB | anon MB | threads |")
        w("|---|---|---|---|")
        for row in rows:
            w(f"| {row['cycle'] or 'before'} | {row['rss_mb']} | {row['rss_anon_mb']} | {row['threads']} |")
        last = rows[-1]
        base = rows[report["baseline_cycle"]]
        per_cycle = (last["rss_mb"] - base["rss_mb"]) / (last["cycle"] - base["cycle"]) if last["cycle"] > base[
            "cycle"] else 0.0
        w(f"growth from cycle {base['cycle']} to {last['cycle']}: {last['rss_mb'] - base['rss_mb']:+.1f} MB "
          f"({report['change_pct']:+.1f} %, {per_cycle:+.2f} MB/cycle)")
        verdict = "PASS" if report["pass"] else "FAIL"
        w(f"RSS after cycle {last['cycle']} within {TOLERANCE_PCT:g} % of cycle {base['cycle']}: {verdict}")
        w(f"({report['seconds']} s, {report['machine']['cpus']} CPUs, load average "
          f"{' '.join(str(x) for x in report['load_average'])}, {report['date']})")
