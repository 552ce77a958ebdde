"""``python manage.py bench_model_processes``: what running each model in a process of its own costs.

Starts two ``manage.py serve`` (legacy runtime, embedded Redis, SQLite; ``gate.servers.Server``) side
by side with the same models: one with ``model_processes`` on (each loaded model in a
process of its own, ``inference.worker.pool_process``), one with it off (the pools in the worker
process, as before). Both load ``vad`` (Silero VAD), ``asr`` (Whisper tiny.en) and ``noop`` (the
fixture family, whose run does nothing: its latency is the serving path alone).

Per request: ``--rounds`` rounds; each round sends ``--requests`` requests one after another to each
model of each server, the servers alternating (same machine, same moment, same noise), with the
shipped sample (3.5 s of speech) for ``vad`` and ``asr`` and 0.1 s of it for ``noop``. Reported per
model: median and p90 wall time (client side, ms) on each server and the ratio isolated ÷ in-process
of the medians (the issue's bound: < 1.05).

Per model (memory): each model's process's RSS, USS and PSS (``psutil``; USS = pages only that
process holds, PSS = its share of the shared ones), the fork server's RSS, and the two workers' RSS.
Linux only. The report is also written as JSON (``--out``).
"""
from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import sys
import tempfile
import time
import wave
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psutil
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from inference.runtime.context import KEYS

from gate.servers import Server

from bench.common import SAMPLE, quantile, task_body

MODELS = [{"id": "vad", "family": "silero_vad", "lazy": False}, {"id": "asr", "family": "whisper", "lazy": False},
          {"id": "noop", "family": "fixture", "lazy": False}]
BOUND_RATIO = 1.05


def _short_wav(wav: bytes, seconds: float) -> bytes:
    """The first ``seconds`` of a WAV file, as a WAV file."""
    with wave.open(io.BytesIO(wav)) as source:
        params = source.getparams()
        frames = source.readframes(int(params.framerate * seconds))
    out = io.BytesIO()
    with wave.open(out, "wb") as target:
        target.setparams(params)
        target.writeframes(frames)
    return out.getvalue()


def memory_mb(pid: int) -> dict:
    """RSS, USS and PSS of process ``pid`` in MiB (``psutil.Process.memory_full_info``)."""
    info = psutil.Process(pid).memory_full_info()
    return {"rss_mb": round(info.rss / 2**20, 1), "uss_mb": round(info.uss / 2**20, 1),
            "pss_mb": round(info.pss / 2**20, 1)}


class Command(BaseCommand):
    help = "Per-request latency and per-model memory of models in processes of their own, against in-process pools."

    def add_arguments(self, parser):
        parser.add_argument("--rounds", type=int, default=10, help="rounds (default 10)")
        parser.add_argument("--requests", type=int, default=10, help="requests per model and server per round")
        parser.add_argument("--out", default=str(Path(settings.VAR_DIR) / "bench_model_processes.json"))

    def handle(self, *args, **opts):
        if not Path("/proc/self/status").exists():
            raise CommandError("this benchmark reads process memory through /proc and needs Linux")
        logging.getLogger("httpx").setLevel(logging.WARNING)
        speech = SAMPLE.read_bytes()
        self.inputs = {"vad": speech, "asr": speech, "noop": _short_wav(speech, 0.1)}
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="bench-processes-") as tmp:
            servers = {}
            try:
                for name, isolated in (("isolated", True), ("in_process", False)):
                    folder = Path(tmp) / name
                    folder.mkdir()
                    servers[name] = Server(folder, MODELS, parallel=False,
                                           extra_config={"backend": "cpu", "model_processes": isolated})
                report = asyncio.run(self._measure(servers, opts))
            finally:
                for server in servers.values():
                    server.stop()
        report["seconds"] = round(time.monotonic() - started)
        report["load_average"] = [round(x, 2) for x in os.getloadavg()]
        Path(opts["out"]).parent.mkdir(parents=True, exist_ok=True)
        Path(opts["out"]).write_text(json.dumps(report, indent=2))
        self._print(report)

    async def _measure(self, servers: dict[str, Server], opts: dict) -> dict:
        walls: dict[str, dict[str, list[float]]] = {name: {model: [] for model in self.inputs} for name in servers}
        clients = {name: httpx.AsyncClient(base_url=server.url, timeout=120) for name, server in servers.items()}
        try:
            for name, client in clients.items():  # warm-up: one request per model, not counted
                for model in self.inputs:
                    await self._one(client, model, name)
            for round_index in range(opts["rounds"]):
                order = list(clients) if round_index % 2 == 0 else list(reversed(clients))
                for model in self.inputs:
                    for name in order:
                        for _ in range(opts["requests"]):
                            walls[name][model].append(await self._one(clients[name], model, name))
        finally:
            for client in clients.values():
                await client.aclose()
        latency: dict[str, dict] = {}
        for model in self.inputs:
            row: dict = {name: {"median_ms": round(quantile(walls[name][model], 0.5), 2),
                          "p90_ms": round(quantile(walls[name][model], 0.9), 2)} for name in servers}
            row["ratio"] = round(row["isolated"]["median_ms"] / row["in_process"]["median_ms"], 4)
            latency[model] = row
        return {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
                "date": datetime.now(UTC).strftime("%Y-%m-%d"), "requests_per_model": len(walls["isolated"]["vad"]),
                "latency": latency, "memory": self._memory(servers)}

    async def _one(self, client: httpx.AsyncClient, model: str, server: str) -> float:
        started = time.perf_counter()
        resp = await client.post("/v1/tasks/run", json=task_body(model, self.inputs[model]))
        if resp.status_code != 200:
            raise CommandError(f"{server} {model}: {resp.status_code} {resp.text[:300]}")
        return (time.perf_counter() - started) * 1000

    @staticmethod
    def _memory(servers: dict[str, Server]) -> dict:
        out: dict = {}
        for name, server in servers.items():
            (host, pid), = server.redis.hgetall(KEYS.worker_pid).items()
            worker = psutil.Process(int(pid))
            entry: dict = {"worker": memory_mb(worker.pid)}
            pools = {int(p): model for model, p in server.redis.hgetall(KEYS.pool_pids(host)).items()}
            for child in worker.children(recursive=True):
                if child.pid in pools:
                    entry[f"model {pools[child.pid]}"] = memory_mb(child.pid)
                else:
                    command = " ".join(child.cmdline())
                    label = ("fork server" if "forkserver" in command else
                             "resource tracker" if "resource_tracker" in command else f"child {child.pid}")
                    entry[label] = memory_mb(child.pid)
            out[name] = entry
        return out

    def _print(self, report: dict) -> None:
        w = self.stdout.write
        w(f"{report['requests_per_model']} requests per model and server, one at a time, servers alternating")
        w("| model | in-process median / p90 ms | isolated median / p90 ms | ratio (isolated / in-process) |")
        w("|---|---|---|---|")
        for model, row in report["latency"].items():
            w(f"| {model} | {row['in_process']['median_ms']} / {row['in_process']['p90_ms']} | "
              f"{row['isolated']['median_ms']} / {row['isolated']['p90_ms']} | {row['ratio']} |")
        worst = max(row["ratio"] for row in report["latency"].values())
        w(f"worst ratio {worst}: {'PASS' if worst < BOUND_RATIO else 'FAIL'} (bound {BOUND_RATIO})")
        w("| server | process | RSS MB | USS MB | PSS MB |")
        w("|---|---|---|---|---|")
        for name, entry in report["memory"].items():
            for process, figures in entry.items():
                w(f"| {name} | {process} | {figures['rss_mb']} | {figures['uss_mb']} | {figures['pss_mb']} |")
        w(f"({report['seconds']} s, {report['machine']['cpus']} CPUs, load average "
          f"{' '.join(str(x) for x in report['load_average'])}, {report['date']})")
