"""``python manage.py bench_slots``: the performance report of VALIDATION.md, from one run.

Starts its own servers with ``manage.py serve`` (embedded Redis, a temporary
SQLite database; first the legacy runtime, then ``--parallel-jobs`` with the
fixture family enabled for the scheduler measurements) and prints:

- admission round trip: acquire + release of a free slot, straight on the
  scheduler (p50/p99, ms);
- HTTP overhead: one warm request through HTTP vs the same adapter called
  in-process (p50, ms) for silero_vad and whisper;
- rejection latency: a 503 overdue fail-fast while every slot is overdue,
  without and with a waiting manager, divided by ``GET /health`` latency;
- queue-timeout lateness: how long after its ``busy_timeout_ms`` a queued
  request gets its 503 (p50/max, ms);
- completion time of N requests on 1 slot (served serially) vs on N slots,
  for whisper and silero_vad, N = 2 and 4 (median of 3 warm repeats), with
  time saved ``100 * (serial - parallel) / serial``; legacy one-request time
  and parallel one-slot time;
- worker RSS after loading whisper with 1 and with 4 slots.

The report is also written as JSON (``--out``, default ``var/bench_slots.json``).

``--family F [--counts 2 4]``: instead, the performance report of VALIDATION.md for one family with
the validation gate's workload (``gate/performance.py``), written beside the evidence
records (``--out``, default ``var/evidence``) and separate from admission.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import redis
import redis.asyncio as aioredis
import soundfile
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from bench.batching import FAMILIES, batch_report
from bench.common import SAMPLE, quantile, task_body
from inference import specs
from inference.adapters import get_adapter
from inference.adapters.base import AudioRequest, LoadContext
from inference.runtime.context import KEYS
from inference.scheduler import Keys, Listener, Scheduler
from gate.servers import Server
from gate import evidence
from gate.model_checks import Client
from gate.performance import family_report
from gate.streaming import StreamClient
from gate.workloads import get_workload

REPEATS = 3


class Command(BaseCommand):
    help = "Performance report: admission latency, HTTP overhead, rejection latency, N-slot vs serial, memory."

    def add_arguments(self, parser):
        parser.add_argument("--out", help="report file (default var/bench_slots.json); with --family the evidence "
                                          "root the report goes under (default var/evidence)")
        parser.add_argument("--family", help="the performance report of one family with the validation gate's "
                                             "workload (gate/workloads.py)")
        parser.add_argument("--counts", type=int, nargs="+", default=[2, 4], help="with --family: N of the N-slot runs")
        parser.add_argument("--mode", default="offline", choices=("offline", "streaming"),
                            help="with --family: the workload's mode (streaming: SSE, realtime turns, speech streams)")
        parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
        parser.add_argument("--repeats", type=int, default=REPEATS, help="warm repeats (at least 3)")
        parser.add_argument("--batch", action="store_true",
                            help="only the native batching report of --family (silero_vad by default, or whisper): "
                                 "serial, N slots, batch N through HTTP; the model alone at batch sizes 1/2/4/8 "
                                 "(bench/batching.py)")
        parser.add_argument("--requests", type=int, help="with --batch: requests per HTTP row (default: silero_vad "
                                                         "48, whisper 16)")

    def handle(self, *args, **opts):
        if opts["batch"]:
            family = opts["family"] or "silero_vad"
            if family not in FAMILIES:
                raise CommandError(f"--batch: family {family!r} does not batch; families that do: "
                                   f"{', '.join(sorted(FAMILIES))}")
            batch_report(family, opts["requests"], Path(opts["out"] or Path(settings.VAR_DIR) / "evidence"),
                         write=self.stdout.write)
            return None
        if opts["family"]:
            return self._family(opts)
        opts["out"] = opts["out"] or str(Path(settings.VAR_DIR) / "bench_slots.json")
        self._all(opts)

    def _family(self, opts) -> None:
        """``--family``: the per-family report of ``gate/performance.py``, written as
        ``<out>/<backend>/<family>/<task>-<mode>/performance-<stamp>/performance.json`` (beside the
        evidence records, never read by admission)."""

        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
        if opts["repeats"] < 3:
            raise CommandError("--repeats must be at least 3 (VALIDATION.md)")
        if specs.get_spec(opts["family"]) is None:
            raise CommandError(f"unknown family {opts['family']!r}")
        try:
            workload = get_workload(opts["family"], opts["mode"])
        except KeyError as exc:
            raise CommandError(str(exc.args[0])) from None
        if opts["mode"] not in specs.require_spec(opts["family"])["modes"]:
            raise CommandError(f"family {opts['family']} serves modes {specs.require_spec(opts['family'])['modes']}")
        counts = sorted({n for n in opts["counts"] if n > 1})
        cap = specs.advertised_capacity(workload.family, opts["backend"])
        if not counts or max(counts) > cap:
            raise CommandError(f"--counts must be 2..{cap} (the advertised capacity of {workload.family})")
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
            report = family_report(workload, counts, opts["backend"], Path(tmp), opts["repeats"],
                                   StreamClient if opts["mode"] == "streaming" else Client)
        report["manifest"] = evidence.manifest(opts["backend"], family=workload.family, task=workload.task,
                                               mode=workload.mode)
        report["duration_s"] = round(time.monotonic() - started, 1)
        root = Path(opts["out"] or Path(settings.VAR_DIR) / "evidence")
        folder = (root / opts["backend"] / workload.family / f"{workload.task}-{workload.mode}"
                  / f"performance-{evidence.run_id(workload.family, opts['backend'])}")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "performance.json").write_text(json.dumps(report, indent=1) + "\n")
        w = self.stdout.write
        w(f"{workload.family}: legacy one request {report['legacy']['warm_one_request_ms']['median']} ms "
          f"(cold {report['legacy']['cold_first_request_ms']} ms); parallel one slot "
          f"{report['parallel_one_slot']['warm_one_request_ms']['median']} ms "
          f"(cold {report['parallel_one_slot']['cold_first_request_ms']} ms)")
        w(f"{'N':>3} {'serial ms':>10} {'N slots ms':>11} {'saved %':>8} {'serial req/s':>13} {'N slots req/s':>14} "
          f"{'serial p50/p95 ms':>18} {'N slots p50/p95 ms':>19}")
        for n, row in report["n_requests"].items():
            s, p = row["serial_on_one_slot"], row["on_n_slots"]
            w(f"{n:>3} {row['serial_on_one_slot_ms']['median']:>10} {row['on_n_slots_ms']['median']:>11} "
              f"{row['time_saved_pct']:>8} {s['throughput_rps']:>13} {p['throughput_rps']:>14} "
              f"{str(s['latency_p50_ms']) + '/' + str(s['latency_p95_ms']):>18} "
              f"{str(p['latency_p50_ms']) + '/' + str(p['latency_p95_ms']):>19}")
        w(f"memory (worker RSS MiB): {report['memory_mb']}")
        w(f"failures: {len(report['failures'])}" + (f" ({report['failures'][:3]})" if report["failures"] else ""))
        w("rejection latency is reported on its own by bench_slots without --family")
        w(f"report written to {folder / 'performance.json'}")

    def _all(self, opts) -> None:

        logging.getLogger("httpx").setLevel(logging.WARNING)
        samples, rate = soundfile.read(SAMPLE, dtype="float32")
        inputs = [samples, np.concatenate([np.zeros(rate // 2, np.float32), samples]),
                  np.concatenate([samples, samples[: rate]]), samples[rate // 2:]]
        self.wavs = []
        for x in inputs:
            path = Path(tempfile.mkstemp(suffix=".wav")[1])
            soundfile.write(path, x, rate)
            self.wavs.append(path.read_bytes())
            path.unlink()
        report: dict = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
                        "input": "LibriSpeech 6930-75918-0000 (3.5 s) and three variants, 16 kHz"}
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "legacy").mkdir()
            legacy = Server(Path(tmp) / "legacy",
                            [{"id": "whisper", "family": "whisper"}, {"id": "vad", "family": "silero_vad"}], False)
            try:
                report["legacy_one_request_ms"] = asyncio.run(self._one_request(legacy, ["whisper", "vad"]))
            finally:
                legacy.stop()
            models: list[dict] = [{"id": "fx", "family": "fixture", "slots": 2},
                      *[{"id": f"whisper{n}", "family": "whisper", "slots": n} for n in (1, 2, 4)],
                      *[{"id": f"vad{n}", "family": "silero_vad", "slots": n} for n in (1, 2, 4)]]
            (Path(tmp) / "parallel").mkdir()
            par = Server(Path(tmp) / "parallel", models, True)
            try:
                report["rss_mb"] = asyncio.run(self._memory(par))  # first: before any whisper pool exists
                report["parallel_one_slot_one_request_ms"] = asyncio.run(self._one_request(par, ["whisper1", "vad1"]))
                report["admission_round_trip_ms"] = asyncio.run(self._admission(par))
                report["http_overhead_ms"] = asyncio.run(self._overhead(par))
                report["rejection"] = asyncio.run(self._rejection(par))
                report["queue_timeout_lateness_ms"] = asyncio.run(self._lateness(par))
                report["n_slots_vs_serial"] = asyncio.run(self._speedup(par))
            finally:
                par.stop()
        Path(opts["out"]).parent.mkdir(parents=True, exist_ok=True)
        Path(opts["out"]).write_text(json.dumps(report, indent=2))
        self._print(report)
        self.stdout.write(f"report written to {opts['out']}")

    # -- measurements ------------------------------------------------------------------
    async def _one_request(self, server: Server, models: list[str]) -> dict:
        out = {}
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            for model in models:
                (await c.post("/v1/tasks/run", json=task_body(model, self.wavs[0]))).raise_for_status()
                times = []
                for _ in range(REPEATS):
                    t = time.perf_counter()
                    (await c.post("/v1/tasks/run", json=task_body(model, self.wavs[0]))).raise_for_status()
                    times.append((time.perf_counter() - t) * 1000)
                out[model.rstrip("1")] = round(statistics.median(times), 1)
        return out

    async def _admission(self, server: Server) -> dict:


        client = aioredis.Redis.from_url(server.redis_url, decode_responses=True)
        scheduler = Scheduler(client, Keys("bench:"), 30000)
        listener = await Listener.start(client, Keys("bench:").process_channel)
        times = []
        for _ in range(1000):
            t = time.perf_counter()
            lease = await scheduler.acquire(listener, "m", 1000)
            await scheduler.release("m", lease.lease_id)
            times.append((time.perf_counter() - t) * 1000)
        await listener.close()
        await client.aclose()
        return {"p50": round(quantile(times, 0.5), 3), "p99": round(quantile(times, 0.99), 3), "n": len(times)}

    async def _overhead(self, server: Server) -> dict:

        out = {}
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            for family, model in (("silero_vad", "vad1"), ("whisper", "whisper1")):
                http = []
                for _ in range(10):
                    t = time.perf_counter()
                    (await c.post("/v1/tasks/run", json=task_body(model, self.wavs[0]))).raise_for_status()
                    http.append((time.perf_counter() - t) * 1000)
                ctx = LoadContext(specs.resolve_checkpoint(family, None), "cpu", 0, 1, {}, {})
                adapter = get_adapter(family)
                session = adapter.new_session(adapter.load(specs.get_spec(family), ctx), 0)
                samples, _ = soundfile.read(SAMPLE, dtype="float32")
                request = AudioRequest(samples, 16000, specs.request_defaults(family))
                session.run(request)
                direct = []
                for _ in range(10):
                    t = time.perf_counter()
                    session.run(request)
                    direct.append((time.perf_counter() - t) * 1000)
                hp, dp = statistics.median(http), statistics.median(direct)
                out[family] = {"http_p50": round(hp, 1), "direct_p50": round(dp, 1), "overhead_p50": round(hp - dp, 1)}
        return out

    async def _hold(self, server: Server, c: httpx.AsyncClient, barrier: str, count: int):

        r = redis.Redis.from_url(server.redis_url, decode_responses=True)
        tasks = [asyncio.create_task(c.post("/v1/tasks/run", json=task_body("fx", self.wavs[0], barrier=barrier)))
                 for _ in range(count)]
        while int(r.get(KEYS.fixture_arrived(barrier)) or 0) < count:
            await asyncio.sleep(0.01)
        return r, tasks

    async def _rejection(self, server: Server) -> dict:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            r, holders = await self._hold(server, c, "rej", 2)
            await asyncio.sleep(0.2)
            health, rejected = [], []
            for _ in range(30):
                t = time.perf_counter()
                (await c.get("/health")).raise_for_status()
                health.append((time.perf_counter() - t) * 1000)
                t = time.perf_counter()
                resp = await c.post("/v1/tasks/run", json=task_body("fx", self.wavs[0], busy_timeout_ms=50))
                rejected.append((time.perf_counter() - t) * 1000)
                assert resp.status_code == 503, resp.text
            manager = subprocess.Popen([sys.executable, "manage.py", "unload_model", "fx"], cwd=settings.BASE_DIR,
                                       env=server.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            while not r.hlen(KEYS.queued_managers("fx")):
                await asyncio.sleep(0.01)
            with_manager = []
            for _ in range(30):
                t = time.perf_counter()
                resp = await c.post("/v1/tasks/run", json=task_body("fx", self.wavs[0], busy_timeout_ms=50))
                with_manager.append((time.perf_counter() - t) * 1000)
                assert resp.status_code == 503, resp.text
            r.lpush(KEYS.fixture_release("rej"), "go", "go")
            await asyncio.gather(*holders)
            await asyncio.to_thread(manager.wait, 60)
        h = statistics.median(health)
        return {"health_p50_ms": round(h, 2), "overdue_503_p50_ms": round(statistics.median(rejected), 2),
                "overdue_503_with_waiting_manager_p50_ms": round(statistics.median(with_manager), 2),
                "ratio_to_health": round(statistics.median(rejected) / h, 2),
                "ratio_to_health_with_manager": round(statistics.median(with_manager) / h, 2)}

    async def _lateness(self, server: Server) -> dict:
        """Fresh holders each time, so the queued request is not refused as overdue but times out."""
        timeout_ms = 300
        late = []
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            for i in range(10):
                r, holders = await self._hold(server, c, f"late{i}", 2)
                t = time.perf_counter()
                resp = await c.post("/v1/tasks/run", json=task_body("fx", self.wavs[0], busy_timeout_ms=timeout_ms))
                late.append((time.perf_counter() - t) * 1000 - timeout_ms)
                assert resp.status_code == 503 and resp.json()["error"]["code"] == "queue_timeout", resp.text
                r.lpush(KEYS.fixture_release(f"late{i}"), "go", "go")
                await asyncio.gather(*holders)
        return {"p50": round(statistics.median(late), 2), "max": round(max(late), 2), "timeout_ms": timeout_ms}

    async def _memory(self, server: Server) -> dict:
        worker = server.worker()
        out = {"worker_idle": round(worker.memory_info().rss / 2**20, 1)}
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            for n in (1, 4):
                before = worker.memory_info().rss
                (await c.post("/v1/tasks/run", json=task_body(f"whisper{n}", self.wavs[0]))).raise_for_status()
                out[f"whisper_{n}_slot_load_delta"] = round((worker.memory_info().rss - before) / 2**20, 1)
        return out

    async def _speedup(self, server: Server) -> dict:
        out = {}
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            for family in ("whisper", "vad"):
                for n in (2, 4):
                    batch = [self.wavs[i % len(self.wavs)] for i in range(n)]
                    row = {}
                    for model in (f"{family}1", f"{family}{n}"):
                        await asyncio.gather(*[c.post("/v1/tasks/run", json=task_body(model, w)) for w in batch])
                        times = []
                        for _ in range(REPEATS):
                            t = time.perf_counter()
                            resps = await asyncio.gather(*[c.post("/v1/tasks/run", json=task_body(model, w))
                                                           for w in batch])
                            times.append((time.perf_counter() - t) * 1000)
                            assert all(r.status_code == 200 for r in resps)
                        row["serial_ms" if model.endswith("1") else "parallel_ms"] = round(statistics.median(times), 1)
                    row["speedup"] = round(row["serial_ms"] / row["parallel_ms"], 2)
                    row["time_saved_pct"] = round(100 * (row["serial_ms"] - row["parallel_ms"]) / row["serial_ms"], 1)
                    out[f"{family}_n{n}"] = row
        return out

    def _print(self, report: dict) -> None:
        w = self.stdout.write
        w(f"machine: {report['machine']['cpus']} CPUs, Python {report['machine']['python']}")
        w(f"legacy one request (ms, median of {REPEATS}): {report['legacy_one_request_ms']}")
        w(f"parallel 1-slot one request (ms): {report['parallel_one_slot_one_request_ms']}")
        a = report["admission_round_trip_ms"]
        w(f"admission acquire+release round trip: p50 {a['p50']} ms, p99 {a['p99']} ms (n={a['n']})")
        for family, row in report["http_overhead_ms"].items():
            w(f"HTTP vs direct {family}: http p50 {row['http_p50']} ms, direct p50 {row['direct_p50']} ms, "
              f"overhead {row['overhead_p50']} ms")
        rj = report["rejection"]
        w(f"503 fail-fast p50 {rj['overdue_503_p50_ms']} ms = {rj['ratio_to_health']}x /health "
          f"({rj['health_p50_ms']} ms); with a waiting manager {rj['overdue_503_with_waiting_manager_p50_ms']} ms "
          f"= {rj['ratio_to_health_with_manager']}x")
        lt = report["queue_timeout_lateness_ms"]
        w(f"queue-timeout lateness after {lt['timeout_ms']} ms: p50 {lt['p50']} ms, max {lt['max']} ms")
        m = report["rss_mb"]
        w(f"worker RSS: idle {m['worker_idle']} MB; +{m['whisper_1_slot_load_delta']} MB loading whisper with 1 slot, "
          f"+{m['whisper_4_slot_load_delta']} MB with 4 slots")
        w(f"{'batch':<12} {'serial ms':>10} {'N slots ms':>11} {'speedup':>8} {'saved %':>8}")
        for name, row in report["n_slots_vs_serial"].items():
            w(f"{name:<12} {row['serial_ms']:>10} {row['parallel_ms']:>11} {row['speedup']:>8} "
              f"{row['time_saved_pct']:>8}")
