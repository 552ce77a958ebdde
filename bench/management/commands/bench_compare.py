"""``python manage.py bench_compare OTHER_CHECKOUT``: what a change to the request path costs, as a ratio
measured in one run.

Starts two ``manage.py serve`` stacks side by side, one from this checkout and one from
``OTHER_CHECKOUT`` (another clone or ``git worktree`` of the repository, e.g. the commit before a
change), both with this interpreter (so the same packages: only the code differs), each with Silero
VAD as its only model (CPU, a temporary SQLite database, its own embedded Redis). It then sends
silero_vad requests of the shipped 3.5 s sample to the two stacks in turn (one keep-alive connection
each, ``--gap-ms`` apart), in four blocks, and prints per stack the CPU time per request of its web
process, worker and Redis (user + system, ``/proc`` through ``psutil``, over each block divided by its
requests; the model's own process is left out: the model's work is the same on both) and the
latency p50, then the ratio of the other checkout to this one.

Measured one stack after the other, the web process's CPU per request moved by ±10 % between runs
on a 2-CPU machine; interleaved, request by request, a change in the machine's load weighs on both
alike, and the four blocks show how steady the figure is (docs/benchmarks.md).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from bench.common import SAMPLE, KeepAliveConn, quantile, stack_processes, task_body
from gate.servers import Server

MODEL = "silero-vad"
MODELS = [{"id": MODEL, "family": "silero_vad", "task": "vad"}]
ROLES = ("web", "worker", "redis")
BLOCKS = 4


class Command(BaseCommand):
    help = "Web, worker and Redis CPU per silero_vad request of this checkout against another, interleaved."

    def add_arguments(self, parser):
        parser.add_argument("other", help="another checkout of the repository (e.g. a git worktree of the "
                                          "commit before a change)")
        parser.add_argument("--requests", type=int, default=400, help="requests to each stack (default 400)")
        parser.add_argument("--gap-ms", type=float, default=20.0,
                            help="pause after each request, in ms (default 20: a client that is not flooding)")

    def handle(self, *args, **opts):
        other = Path(opts["other"]).resolve()
        if not (other / "manage.py").is_file():
            raise CommandError(f"{other} is not a checkout of audiosite (no manage.py)")
        checkouts = {"this": Path(settings.BASE_DIR).resolve(), "other": other}
        servers: list[Server] = []
        try:
            for path in checkouts.values():
                servers.append(Server(Path(tempfile.mkdtemp(prefix="bench-compare-")), MODELS, parallel=False,
                                      extra_config={"backend": "cpu", "lazy_load": False}, checkout=path))
            urls = {name: server.url for name, server in zip(checkouts, servers, strict=True)}
            roles = {name: self._roles(server.proc) for name, server in zip(checkouts, servers, strict=True)}
            cpu_ms, latency_ms = self._measure(urls, roles, opts["requests"], opts["gap_ms"] / 1000)
        finally:
            for server in servers:
                server.stop()
        self._report(checkouts, cpu_ms, latency_ms, opts["requests"])

    @staticmethod
    def _roles(proc: subprocess.Popen) -> dict[str, psutil.Process]:
        found: dict[str, psutil.Process] = {}
        for pid, role in stack_processes(proc.pid).items():
            if role in ROLES and role not in found:
                found[role] = psutil.Process(pid)
        return found

    def _measure(self, urls: dict[str, str], roles: dict[str, dict[str, psutil.Process]], requests: int,
                 gap_s: float) -> tuple[dict[str, dict[str, list[float]]], dict[str, list[float]]]:
        """CPU ms per request of each stack's processes, per block, and every request's latency (ms)."""
        body = json.dumps(task_body(MODEL, SAMPLE.read_bytes())).encode()
        conns = {name: KeepAliveConn(url) for name, url in urls.items()}

        def post(name: str) -> float:
            status, data, ms = conns[name].post_json("/v1/tasks/run", body)
            if status != 200:
                raise CommandError(f"silero_vad on {name} answered {status}: {data[:300]!r}")
            return ms

        def cpu_s() -> dict[str, dict[str, float]]:
            return {name: {role: sum(proc.cpu_times()[:2]) for role, proc in procs.items()}
                    for name, procs in roles.items()}

        try:
            for _ in range(20):  # warm-up: first requests, lazily built objects
                for name in urls:
                    post(name)
                    time.sleep(gap_s)
            cpu_ms: dict[str, dict[str, list[float]]] = {name: {role: [] for role in ROLES} for name in urls}
            latency_ms: dict[str, list[float]] = {name: [] for name in urls}
            per_block = max(1, requests // BLOCKS)
            for _ in range(BLOCKS):
                before = cpu_s()
                for _ in range(per_block):
                    for name in urls:
                        latency_ms[name].append(post(name))
                        time.sleep(gap_s)
                after = cpu_s()
                for name in urls:
                    for role in ROLES:
                        cpu_ms[name][role].append((after[name][role] - before[name][role]) * 1000 / per_block)
        finally:
            for conn in conns.values():
                conn.close()
        return cpu_ms, latency_ms

    def _report(self, checkouts: dict[str, Path], cpu_ms: dict[str, dict[str, list[float]]],
                latency_ms: dict[str, list[float]], requests: int) -> None:
        out = self.stdout.write
        out(f"\nsilero_vad, 3.5 s sample, {requests} requests to each stack, interleaved; CPU ms per request "
            f"(mean of {BLOCKS} blocks; the blocks in brackets)")
        out("| checkout | web | worker | redis | latency p50 (ms) |\n|---|---|---|---|---|")
        for name, path in checkouts.items():
            cells = [f"{statistics.mean(cpu_ms[name][role]):.2f} ["
                     + " ".join(f"{x:.2f}" for x in cpu_ms[name][role]) + "]" for role in ROLES]
            out(f"| {name}: {path} | " + " | ".join(cells) + f" | {quantile(latency_ms[name], 0.5):.2f} |")
        ratios = [statistics.mean(cpu_ms["other"][role]) / statistics.mean(cpu_ms["this"][role])
                  if statistics.mean(cpu_ms["this"][role]) > 0 else float("nan") for role in ROLES]
        out("| other / this | " + " | ".join(f"{r:.3f}" for r in ratios)
            + f" | {quantile(latency_ms['other'], 0.5) / quantile(latency_ms['this'], 0.5):.3f} |")
        out(f"\n({os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
