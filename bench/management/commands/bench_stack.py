"""``python manage.py bench_stack``: how long a whole ``serve`` takes to start and to stop.

Each cycle starts ``manage.py serve`` on the embedded default (private Redis, a fresh SQLite
file, one eager ``silero_vad`` model on the CPU) in a temporary folder, as an operator starts it
(``gate.servers.Server``, as the validation gate does),
waits for its "listening on" line, answers one ``/health``, then sends Ctrl-C (SIGINT) and waits
for it to exit. Printed per cycle, then as medians:

- start: from the spawn to "listening on" (imports, migrate of the new database, the registry
  sync, the web process and the worker up, the eager model loaded);
- stop: from SIGINT to serve's exit, and when each child (web, worker, Redis) exited, measured
  by polling every 10 ms (so each figure is late by up to that much).

The test suite starts and stops about a hundred such stacks, so this is most of what a stack
costs the suite beyond its tests (docs/benchmarks.md, "Stopping and starting a stack").
"""
from __future__ import annotations

import os
import signal
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
from django.core.management.base import BaseCommand, CommandError

from gate.servers import Server

from bench.common import process_role

POLL_S = 0.01
STOP_TIMEOUT_S = 60.0
ROLES = ("web", "worker", "redis")


class Command(BaseCommand):
    help = "Start and stop a one-model serve N times; print the start time, the stop time and each child's exit."

    def add_arguments(self, parser):
        parser.add_argument("--cycles", type=int, default=5, help="start/stop cycles (default 5)")

    def handle(self, *args, **opts):
        if opts["cycles"] < 1:
            raise CommandError("--cycles must be ≥ 1")
        starts, stops = [], []
        exits: dict[str, list[float]] = {role: [] for role in ROLES}
        for cycle in range(1, opts["cycles"] + 1):
            with tempfile.TemporaryDirectory(prefix="bench-stack-") as tmp:
                start_s, stop_s, child_exit_s = self._cycle(Path(tmp))
            starts.append(start_s)
            stops.append(stop_s)
            for role in ROLES:
                if role in child_exit_s:
                    exits[role].append(child_exit_s[role])
            parts = ", ".join(f"{role} {child_exit_s[role]:.2f}" for role in ROLES if role in child_exit_s)
            self.stdout.write(f"cycle {cycle}: start {start_s:.2f} s, stop {stop_s:.2f} s (exited after SIGINT: "
                              f"{parts} s)")
        medians = ", ".join(f"{role} {statistics.median(v):.2f}" for role, v in exits.items() if v)
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        self.stdout.write(f"median of {len(starts)}: start {statistics.median(starts):.2f} s, stop "
                          f"{statistics.median(stops):.2f} s (children: {medians} s); {os.cpu_count()} CPUs, "
                          f"load average {load}")

    def _cycle(self, tmp: Path) -> tuple[float, float, dict[str, float]]:
        """One start and stop: (start seconds, stop seconds, seconds after SIGINT at which each child exited).

        Raises:
            CommandError: serve did not start (from :class:`Server`) or did not stop within
                ``STOP_TIMEOUT_S`` (it is then stopped by :meth:`Server.stop`); the end of its log is
                in the message.
        """
        server = Server(tmp, [{"id": "vad", "family": "silero_vad"}], parallel=False,
                        extra_config={"backend": "cpu", "lazy_load": False})
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=10) as resp:
                resp.read()
            children = {c: process_role(c.cmdline()) for c in psutil.Process(server.proc.pid).children()}
            stopped = time.monotonic()
            server.proc.send_signal(signal.SIGINT)
            exited: dict[str, float] = {}
            while server.proc.poll() is None:
                for child, role in children.items():
                    if role in ROLES and role not in exited and not _alive(child):
                        exited[role] = time.monotonic() - stopped
                if time.monotonic() - stopped > STOP_TIMEOUT_S:
                    raise CommandError("serve did not stop:\n" + server.log.read_text(errors="replace")[-3000:])
                time.sleep(POLL_S)
            stop_s = time.monotonic() - stopped
            for role in children.values():
                if role in ROLES and role not in exited:
                    exited[role] = stop_s
            if server.proc.returncode != 0:
                raise CommandError(f"serve exited {server.proc.returncode}:\n"
                                   + server.log.read_text(errors="replace")[-3000:])
            return server.start_s, stop_s, exited
        finally:
            server.stop()


def _alive(proc: psutil.Process) -> bool:
    """Whether ``proc`` still runs (a zombie waiting for serve to reap it counts as exited)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
