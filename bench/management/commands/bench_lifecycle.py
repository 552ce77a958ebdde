"""``python manage.py bench_lifecycle``: how long lifecycle operations take, and what they cost traffic.

Starts its own ``manage.py serve --parallel-jobs --ui-management`` servers
(embedded Redis, temporary SQLite, fixture family enabled) and prints, from
one run:

- management latency on an idle deployment (fixture family, no weights, so
  the numbers are the server's own cost): register+load, reconfigure
  (count change), unload (p50 of 10 each), and one bulk unload of 8 models;
- reconfiguration under traffic: four clients send silero_vad requests
  without pause while the model is resized 1→4→2; request latency p50/max
  during vs before, and how many answers were not 200;
- the cold-load guard (``max_loaded_models`` = 2): warm request p50 to a
  loaded model while another model's cold load is held, divided by the p50
  without it (1.0 = warm traffic does not wait on the guard);
- eviction cost: a cold load that must evict an idle model vs one that need not;
- worker RSS growth when loading silero_vad and whisper with 1 and 2 slots
  (the basis of the ``memory_mb`` estimates in ``model_specs``).

Also written as JSON (``--out``, default ``var/bench_lifecycle.json``).
"""
from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import soundfile
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from inference.runtime.context import KEYS

from gate.servers import Server

from bench.common import SAMPLE, quantile, task_body

REPEATS = 10


def _fx(model_id: str, slots: int = 1, **load_options) -> dict:
    return {"id": model_id, "family": "fixture", "slots": slots, "lazy": False, "load_options": load_options}


class Command(BaseCommand):
    help = "Lifecycle report: management latency, reconfiguration under traffic, cold-load guard, eviction, memory."

    def add_arguments(self, parser):
        parser.add_argument("--out", default=str(Path(settings.VAR_DIR) / "bench_lifecycle.json"))

    def handle(self, *args, **opts):
        self.wav = SAMPLE.read_bytes()
        soundfile.info(SAMPLE)  # fail early on a missing sample
        report = {}
        with tempfile.TemporaryDirectory(prefix="bench-lifecycle-") as tmp:
            server = self._start(Path(tmp) / "a", {"ui_management": True},
                                 [{"id": "vad", "family": "silero_vad", "slots": 1}])
            try:
                report["management_ms"] = asyncio.run(self._management(server))
                report["reconfigure_under_traffic"] = asyncio.run(self._under_traffic(server))
                report["rss_mb"] = asyncio.run(self._memory(server))
            finally:
                server.stop()
            # min_residency_ms 0: the eviction measured is the mechanism's cost, not the wait for residency.
            server = self._start(Path(tmp) / "b", {"ui_management": True, "max_loaded_models": 2,
                                                   "min_residency_ms": 0},
                                 [{"id": "warm", "family": "fixture", "slots": 1}])
            try:
                report["cold_load_guard"] = asyncio.run(self._guard(server))
                report["eviction"] = asyncio.run(self._eviction(server))
            finally:
                server.stop()
        Path(opts["out"]).parent.mkdir(parents=True, exist_ok=True)
        Path(opts["out"]).write_text(json.dumps(report, indent=2))
        self._print(report)

    def _start(self, workdir: Path, extra: dict, models: list[dict]) -> Server:
        workdir.mkdir()
        server = Server(workdir, models, parallel=True, extra_config=extra)
        try:
            server.token = server.issue_token("bench")
        except CommandError:
            server.stop()
            raise
        return server

    def _client(self, server: Server) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=server.url, timeout=300, headers={"Authorization": f"Token {server.token}"},
                                 limits=httpx.Limits(max_connections=32))

    @staticmethod
    async def _timed(coro) -> tuple[float, httpx.Response]:
        t = time.perf_counter()
        resp = await coro
        return (time.perf_counter() - t) * 1000, resp

    async def _management(self, server: Server) -> dict:
        out: dict = {}
        async with self._client(server) as c:
            register, reconfigure, unload = [], [], []
            for i in range(REPEATS):
                ms, r = await self._timed(c.post("/v1/models/load", json=_fx(f"m{i}")))
                assert r.json()["loaded"] is True, r.text
                register.append(ms)
                ms, r = await self._timed(c.post("/v1/models/load", json=_fx(f"m{i}", 2)))
                assert r.json() == {"id": f"m{i}", "loaded": True, "reconfigured": True}, r.text
                reconfigure.append(ms)
                ms, r = await self._timed(c.post("/v1/models/unload", json={"id": f"m{i}"}))
                assert r.status_code == 200, r.text
                unload.append(ms)
            for i in range(8):
                await c.post("/v1/tasks/run", json=task_body(f"m{i}", self.wav))
            ms, r = await self._timed(c.post("/v1/tasks/unload_models",
                                             json={"model_ids": [f"m{i}" for i in range(8)]}))
            assert len(r.json()["unloaded"]) == 8, r.text
            out = {"register_load_p50": round(statistics.median(register), 1),
                   "reconfigure_p50": round(statistics.median(reconfigure), 1),
                   "unload_p50": round(statistics.median(unload), 1), "bulk_unload_8_loaded": round(ms, 1)}
            for i in range(REPEATS):
                await c.delete(f"/v1/models/m{i}")
        return out

    async def _under_traffic(self, server: Server) -> dict:
        latencies: list[tuple[float, float, int]] = []  # (start, ms, status)
        async with self._client(server) as c:
            stop = asyncio.Event()

            async def client():
                while not stop.is_set():
                    t = time.perf_counter()
                    r = await c.post("/v1/tasks/run", json=task_body("vad", self.wav))
                    latencies.append((t, (time.perf_counter() - t) * 1000, r.status_code))

            await c.post("/v1/tasks/run", json=task_body("vad", self.wav))
            tasks = [asyncio.create_task(client()) for _ in range(4)]
            await asyncio.sleep(3)
            began = time.perf_counter()
            steps = []
            for n in (4, 2):
                ms, r = await self._timed(c.post("/v1/models/load", json={"id": "vad", "family": "silero_vad",
                                                                          "slots": n, "lazy": False}))
                assert r.status_code == 200, r.text
                steps.append(round(ms, 1))
            ended = time.perf_counter()
            await asyncio.sleep(1)
            stop.set()
            await asyncio.gather(*tasks)
        before = [ms for t, ms, _ in latencies if t < began]
        during = [ms for t, ms, _ in latencies if began <= t <= ended]
        return {"reconfigure_1_to_4_ms": steps[0], "reconfigure_4_to_2_ms": steps[1],
                "requests": len(latencies), "not_200": sum(1 for *_, s in latencies if s != 200),
                "before_p50_ms": round(statistics.median(before), 1), "before_max_ms": round(max(before), 1),
                "during_p50_ms": round(statistics.median(during), 1) if during else None,
                "during_max_ms": round(max(during), 1) if during else None}

    async def _memory(self, server: Server) -> dict:
        worker = server.worker()
        out = {}
        async with self._client(server) as c:
            for family in ("silero_vad", "whisper"):
                for n in (1, 2):
                    await c.post("/v1/tasks/unload_all_models")
                    await asyncio.sleep(1)
                    before = worker.memory_info().rss
                    r = await c.post("/v1/models/load", json={"id": f"{family}-mem{n}", "family": family, "slots": n,
                                                                   "lazy": False})
                    assert r.json()["loaded"] is True, r.text
                    out[f"{family}_{n}_slot_load_delta"] = round((worker.memory_info().rss - before) / 2**20, 1)
        return out

    async def _guard(self, server: Server) -> dict:
        async with self._client(server) as c:
            for name in ("coldA",):
                r = await c.post("/v1/models/load", json=_fx(name, load_barrier="bench-cold") | {"lazy": True})
                assert r.status_code == 200, r.text
            await c.post("/v1/tasks/run", json=task_body("warm", self.wav))

            async def warm_p50() -> float:
                times = []
                for _ in range(20):
                    ms, r = await self._timed(c.post("/v1/tasks/run", json=task_body("warm", self.wav)))
                    assert r.status_code == 200, r.text
                    times.append(ms)
                return statistics.median(times)

            baseline = await warm_p50()
            cold = asyncio.create_task(c.post("/v1/tasks/run", json=task_body("coldA", self.wav)))
            while int(server.redis.get(KEYS.fixture_arrived("bench-cold")) or 0) < 1:
                await asyncio.sleep(0.01)
            held = await warm_p50()
            server.redis.lpush(KEYS.fixture_release("bench-cold"), "go")
            assert (await cold).status_code == 200
        return {"warm_p50_ms": round(baseline, 1), "warm_p50_during_cold_load_ms": round(held, 1),
                "ratio": round(held / baseline, 2)}

    async def _eviction(self, server: Server) -> dict:
        async with self._client(server) as c:
            await c.post("/v1/tasks/unload_all_models")
            plain, evicting = [], []
            for _ in range(REPEATS):
                for name in ("e1", "e2", "e3"):
                    await c.post("/v1/models/load", json=_fx(name) | {"lazy": True})
                await c.post("/v1/tasks/unload_all_models")
                ms, r = await self._timed(c.post("/v1/tasks/run", json=task_body("e1", self.wav)))
                assert r.status_code == 200, r.text
                plain.append(ms)  # 1 loaded of 2: no eviction
                await c.post("/v1/tasks/run", json=task_body("e2", self.wav))
                ms, r = await self._timed(c.post("/v1/tasks/run", json=task_body("e3", self.wav)))
                assert r.status_code == 200, r.text
                evicting.append(ms)  # 2 loaded of 2: evicts e1
        return {"cold_request_p50_ms": round(statistics.median(plain), 1),
                "cold_request_with_eviction_p50_ms": round(statistics.median(evicting), 1),
                "eviction_cost_p50_ms": round(statistics.median(evicting) - statistics.median(plain), 1),
                "max_with_eviction_ms": round(quantile(evicting, 1.0), 1)}

    def _print(self, report: dict) -> None:
        w = self.stdout.write
        m = report["management_ms"]
        w(f"idle management (fixture, p50 of {REPEATS}): register+load {m['register_load_p50']} ms, "
          f"reconfigure {m['reconfigure_p50']} ms, unload {m['unload_p50']} ms; bulk unload of 8 loaded "
          f"models {m['bulk_unload_8_loaded']} ms")
        t = report["reconfigure_under_traffic"]
        w(f"silero_vad resized 1→4 in {t['reconfigure_1_to_4_ms']} ms and 4→2 in {t['reconfigure_4_to_2_ms']} ms "
          f"under 4 clients: {t['requests']} requests, {t['not_200']} not 200; latency p50 {t['before_p50_ms']} ms "
          f"(max {t['before_max_ms']}) before, p50 {t['during_p50_ms']} ms (max {t['during_max_ms']}) during")
        g = report["cold_load_guard"]
        w(f"cold-load guard: warm p50 {g['warm_p50_ms']} ms alone, {g['warm_p50_during_cold_load_ms']} ms while "
          f"another model's cold load holds the guard (ratio {g['ratio']})")
        e = report["eviction"]
        w(f"eviction: cold request p50 {e['cold_request_p50_ms']} ms without, {e['cold_request_with_eviction_p50_ms']} "
          f"ms with one eviction (cost {e['eviction_cost_p50_ms']} ms)")
        r = report["rss_mb"]
        w("worker RSS growth on load (MB): " + ", ".join(f"{k.replace('_load_delta', '')} +{v}" for k, v in r.items()))
