"""``python manage.py bench_residency``: does eviction thrash a model in steady use?

The scenario of ``docs/management.md`` ("Choosing the victim"): three models
under ``max_loaded_models`` 2. Client A asks model A, waits for the answer,
then thinks ``--think-ms`` (200 ms) before asking again; client BC asks B,
then C, then B..., ``--bc-think-ms`` (50 ms) after each answer, with a
``--bc-timeout-ms`` busy timeout. For each eviction policy (``--policies``, default ``recent_use``,
``lru``, and ``unlimited``: no ``max_loaded_models`` at all, so nothing is
ever evicted: what B/C's traffic alone costs A) it starts its own
``manage.py serve --parallel-jobs`` (embedded
Redis, temporary SQLite, fixture family: each request busy ``--work-ms``, each
load ``--load-ms``, a sleep standing for a real model's load time, without its
CPU) and measures, in that one run:

- A's latency alone (its baseline: p50, p99) and A's latency while BC takes
  turns (p50, p99, and p99 over the baseline's p99): ``--rounds`` rounds of
  ``--seconds`` alone then ``--seconds`` with BC, the samples of each kind
  pooled, so a machine whose load drifts during the run weighs on both alike;
- how often each model was evicted (``audiosite_evictions_total``) and how many
  pools served A (1 = never evicted);
- BC's answers (200, 503 ``residency_full``, anything else) and their wall time.

Prints one block per policy; also written as JSON (``--out``, default
``var/bench_residency.json``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand

from gate.servers import Server

from bench.common import SAMPLE, quantile, task_body

_EVICTIONS = re.compile(r'^audiosite_evictions_total\{model="([^"]+)"\} ([0-9.e+]+)$', re.M)


class Command(BaseCommand):
    help = "Residency thrash report: a steady model's p99 beside two models taking turns, per eviction policy."

    def add_arguments(self, parser):
        parser.add_argument("--seconds", type=float, default=15.0, help="length of each phase")
        parser.add_argument("--rounds", type=int, default=4, help="rounds of (A alone, A beside BC)")
        parser.add_argument("--think-ms", type=int, default=200, help="A's pause between requests")
        parser.add_argument("--bc-think-ms", type=int, default=50, help="BC's pause between requests")
        parser.add_argument("--work-ms", type=int, default=100, help="busy time of each request")
        parser.add_argument("--load-ms", type=int, default=1000, help="time of each load")
        parser.add_argument("--bc-timeout-ms", type=int, default=5000, help="busy_timeout_ms of B and C")
        parser.add_argument("--policies", default="recent_use,lru,unlimited")
        parser.add_argument("--out", default=str(Path(settings.VAR_DIR) / "bench_residency.json"))

    def handle(self, *args, **opts):
        self.opts = opts
        self.wav = SAMPLE.read_bytes()
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
        report = {"settings": {k: opts[k] for k in ("seconds", "rounds", "think_ms", "bc_think_ms", "work_ms",
                                                   "load_ms", "bc_timeout_ms")}}
        with tempfile.TemporaryDirectory(prefix="bench-residency-") as tmp:
            for policy in opts["policies"].split(","):
                models = [{"id": name, "family": "fixture", "slots": 1, "lazy": True,
                           "load_options": {"load_ms": opts["load_ms"]}} for name in ("A", "B", "C")]
                workdir = Path(tmp) / policy
                workdir.mkdir()
                limits = {"max_loaded_models": 0} if policy == "unlimited" else {"max_loaded_models": 2,
                                                                                  "eviction_policy": policy}
                server = Server(workdir, models, parallel=True, extra_config=limits)
                try:
                    report[policy] = asyncio.run(self._scenario(server))
                finally:
                    server.stop()
        Path(opts["out"]).parent.mkdir(parents=True, exist_ok=True)
        Path(opts["out"]).write_text(json.dumps(report, indent=2))
        self._print(report)

    async def _ask(self, c: httpx.AsyncClient, model: str, **extra) -> tuple[float, httpx.Response]:
        started = time.perf_counter()
        resp = await c.post("/v1/tasks/run", json=task_body(model, self.wav, sleep_ms=self.opts["work_ms"], **extra))
        return (time.perf_counter() - started) * 1000, resp

    async def _steady(self, c: httpx.AsyncClient, stop: asyncio.Event) -> list[tuple[float, httpx.Response]]:
        answers = []
        while not stop.is_set():
            answers.append(await self._ask(c, "A"))
            await asyncio.sleep(self.opts["think_ms"] / 1000)
        return answers

    async def _turns(self, c: httpx.AsyncClient, stop: asyncio.Event) -> list[tuple[float, httpx.Response]]:
        answers, turn = [], 0
        while not stop.is_set():
            answers.append(await self._ask(c, "BC"[turn % 2], busy_timeout_ms=self.opts["bc_timeout_ms"]))
            turn += 1
            await asyncio.sleep(self.opts["bc_think_ms"] / 1000)
        return answers

    async def _phase(self, c: httpx.AsyncClient, with_turns: bool) -> tuple[list, list]:
        stop = asyncio.Event()
        steady = asyncio.create_task(self._steady(c, stop))
        turns = asyncio.create_task(self._turns(c, stop)) if with_turns else None
        await asyncio.sleep(self.opts["seconds"])
        stop.set()
        return await steady, (await turns if turns else [])

    async def _scenario(self, server: Server) -> dict:
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=8)) as c:
            for _ in range(5):  # A loaded and in steady use before the baseline
                await self._ask(c, "A")
                await asyncio.sleep(self.opts["think_ms"] / 1000)
            alone, mixed, turns = [], [], []
            for _ in range(self.opts["rounds"]):
                alone += (await self._phase(c, with_turns=False))[0]
                steady, bc = await self._phase(c, with_turns=True)
                mixed += steady
                turns += bc
            await asyncio.sleep(1.5)  # counters are recorded in the background
            evictions = {m: int(float(n)) for m, n in _EVICTIONS.findall((await c.get("/metrics")).text)}
        return {"alone": _latencies(alone), "with_turns": _latencies(mixed),
                "p99_ratio": round(_latencies(mixed)["p99_ms"] / _latencies(alone)["p99_ms"], 3),
                "a_pools": len({r.json().get("pool_id") for _, r in alone + mixed if r.status_code == 200}),
                "a_not_200": sum(r.status_code != 200 for _, r in alone + mixed),
                "evictions": {m: evictions.get(m, 0) for m in ("A", "B", "C")}, "turns": _turn_outcomes(turns)}

    def _print(self, report: dict) -> None:
        w = self.stdout.write
        s = report["settings"]
        w(f"3 fixture models, max_loaded_models 2; A thinks {s['think_ms']} ms, BC {s['bc_think_ms']} ms; "
          f"work {s['work_ms']} ms, "
          f"load {s['load_ms']} ms; {s['rounds']} rounds of {s['seconds']:g} s alone + {s['seconds']:g} s beside BC; "
          f"B/C busy_timeout_ms {s['bc_timeout_ms']}")
        for policy, r in report.items():
            if policy == "settings":
                continue
            t = r["turns"]
            w(f"{policy}: A p50/p99 alone {r['alone']['p50_ms']}/{r['alone']['p99_ms']} ms "
              f"({r['alone']['n']} requests), with B/C {r['with_turns']['p50_ms']}/{r['with_turns']['p99_ms']} ms "
              f"({r['with_turns']['n']}); p99 ratio {r['p99_ratio']}; A's non-200 answers {r['a_not_200']}, "
              f"pools that served A {r['a_pools']}")
            w(f"  evictions A {r['evictions']['A']}, B {r['evictions']['B']}, C {r['evictions']['C']}; "
              f"B/C answers: {t['ok']} ok, {t['residency_full']} residency_full, {t['other']} other; "
              f"wall p50/max {t['p50_ms']}/{t['max_ms']} ms")


def _latencies(answers: list[tuple[float, httpx.Response]]) -> dict:
    """p50/p99 (ms, nearest rank) and count of ``answers``' wall times."""
    ms = [t for t, _ in answers]
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 1), "p99_ms": round(quantile(ms, 0.99), 1)}


def _turn_outcomes(answers: list[tuple[float, httpx.Response]]) -> dict:
    """How B's and C's requests ended: 200, 503 ``residency_full``, other; and their wall time (ms)."""
    full = sum(r.status_code == 503 and r.json()["error"].get("code") == "residency_full" for _, r in answers)
    ok = sum(r.status_code == 200 for _, r in answers)
    ms = [t for t, _ in answers] or [0.0]
    return {"ok": ok, "residency_full": full, "other": len(answers) - ok - full,
            "p50_ms": round(statistics.median(ms), 1), "max_ms": round(max(ms), 1)}
