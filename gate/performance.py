"""The performance report of VALIDATION.md for one family (``bench_slots --family F``), separate from
admission: it never changes an evidence record or an admission table.

Measured in one run on real servers, with the validation gate's workload of the family
(``workloads.py``), every request compared with the legacy runtime's answer (failures are counted,
never hidden):

- ``legacy``: server start time (s), first (cold) request time (ms, includes the load), then at
  least three warm repeats of one request (ms, each kept, median reported);
- ``parallel_one_slot``: the same on the parallel runtime with one slot;
- ``n_requests``: for each N, the same N requests (different inputs/options) on the one-slot model
  (served one after the other by its FIFO: the measured serial time) and on an N-slot model (completion
  time), each the median of ``repeats`` warm repeats after one warm-up; time saved
  ``100 * (serial - parallel) / serial`` (VALIDATION.md), the throughput of each (requests per second:
  N over the median completion time) and the per-request latency's p50/p95 (nearest rank over every
  request of the repeats; for streams also the time to the first frame); the cold first wave of the
  N-slot model and its load are reported separately;
- ``memory_mb``: the worker's RSS before any load and after each model's first wave.

The mode is the workload's: a streaming workload (``workloads.STREAMING_WORKLOADS``) is sent as streams by
``client`` (``gate.streaming.StreamClient``: SSE and realtime turns for whisper, speech streams for piper),
and each stream's result is compared with the legacy runtime's streamed result of the same item.

Rejection latency (a 503 while every slot is overdue, with and without a waiting manager) is measured
by ``bench_slots`` without ``--family`` on the fixture family and reported on its own there: a quicker
503 is not quicker inference.
"""
from __future__ import annotations

import asyncio
import math
import statistics
import time
from pathlib import Path

from inference import specs

from .model_checks import Client, Outcome, Plan, admission_table_for
from .servers import Server
from .workloads import Item, Workload, digest

REPEATS = 3


async def _timed(client: Client, model_id: str, items: list[Item]) -> tuple[float, list[Outcome]]:
    started = time.perf_counter()
    outs = await asyncio.gather(*[client.ask(model_id, it) for it in items])
    return (time.perf_counter() - started) * 1000, list(outs)


def _summary(times: list[float]) -> dict:
    return {"median": round(statistics.median(times), 1), "all": [round(t, 1) for t in times]}


def _rank(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile ``p`` (0..100) of ``values``; None when empty."""
    ordered = sorted(values)
    return round(ordered[max(0, math.ceil(len(ordered) * p / 100) - 1)], 1) if ordered else None


def _latencies(outs: list[list[Outcome]], n: int, median_ms: float) -> dict:
    """Throughput (requests/s over the median completion time) and latency p50/p95 (ms) of repeated waves;
    for streams also the time to the first frame."""
    every = [o.ms for wave in outs for o in wave]
    first = [o.steps_ms[0] for wave in outs for o in wave if o.steps_ms]
    out = {"throughput_rps": round(n / (median_ms / 1000), 3) if median_ms else None,
           "latency_p50_ms": _rank(every, 50), "latency_p95_ms": _rank(every, 95)}
    if first:
        out.update(first_frame_p50_ms=_rank(first, 50), first_frame_p95_ms=_rank(first, 95))
    return out


def family_report(workload: Workload, counts: list[int], backend: str, workdir: Path, repeats: int = REPEATS,
                  client: type[Client] = Client) -> dict:
    """Measure the report above, sending every item with ``client`` (its ``ask``); returns it as a JSON-ready
    dict.

    Raises:
        CommandError (from :class:`Server`): a server did not start.
    """
    client_class = client
    plan = Plan(workload.family, workload.task, workload.mode, counts, 1, backend, workdir, 0)
    admission = admission_table_for(plan, workload, workdir / "admission")
    env = {specs.ADMISSION_DIR_ENV: str(admission)}
    item = workload.items[0]
    report: dict = {"family": workload.family, "task": workload.task, "mode": workload.mode, "backend": backend,
                    "counts": counts, "repeats": repeats, "unit": "ms unless named",
                    "workload": [i.name for i in workload.items]}
    references: dict[str, str] = {}
    failures: list[str] = []

    def judge(outs: list[Outcome], where: str) -> None:
        for o in outs:
            if o.status != 200:
                failures.append(f"{where}: {o.item} HTTP {o.status}")
            elif o.item in references and references[o.item] != o.sha:
                failures.append(f"{where}: {o.item} answer differs from the legacy runtime's")

    (workdir / "legacy").mkdir()
    legacy = Server(workdir / "legacy", [*workload.component_registrations(None), workload.registration("m", None)],
                    False, {"backend": backend}, env)
    try:
        async def on_legacy() -> dict:
            client = client_class(legacy, workload)
            try:
                cold_ms, cold = await _timed(client, "m", [item])
                judge(cold, "legacy cold")
                for it in workload.items:  # the references for every later comparison
                    out = await client.ask("m", it)
                    judge([out], "legacy reference")
                    if out.sha:
                        references[it.name] = out.sha
                warm = []
                for _ in range(repeats):
                    ms, outs = await _timed(client, "m", [item])
                    judge(outs, "legacy warm")
                    warm.append(ms)
                return {"server_start_s": round(legacy.start_s, 2), "cold_first_request_ms": round(cold_ms, 1),
                        "warm_one_request_ms": _summary(warm)}
            finally:
                await client.aclose()
        report["legacy"] = asyncio.run(on_legacy())
    finally:
        legacy.stop()

    models = [*workload.component_registrations(max(counts)), workload.registration("p1", 1),
              *[workload.registration(f"p{n}", n) for n in counts if n > 1]]
    (workdir / "parallel").mkdir()
    par = Server(workdir / "parallel", models, True, {"backend": backend}, env)
    try:
        worker = par.worker()

        async def on_parallel() -> dict:
            client = client_class(par, workload)
            out: dict = {"server_start_s": round(par.start_s, 2)}
            memory = {"worker_before_any_load_mb": round(worker.memory_info().rss / 2**20, 1)}
            try:
                cold_ms, cold = await _timed(client, "p1", [item])
                judge(cold, "parallel one-slot cold")
                memory["after_p1_first_request_mb"] = round(worker.memory_info().rss / 2**20, 1)
                warm = []
                for _ in range(repeats):
                    ms, outs = await _timed(client, "p1", [item])
                    judge(outs, "parallel one-slot warm")
                    warm.append(ms)
                out["parallel_one_slot"] = {"cold_first_request_ms": round(cold_ms, 1),
                                            "warm_one_request_ms": _summary(warm)}
                rows = {}
                for n in counts:
                    if n == 1:
                        continue
                    batch = [workload.items[k % len(workload.items)] for k in range(n)]
                    first_ms, outs = await _timed(client, f"p{n}", batch)
                    judge(outs, f"p{n} cold wave")
                    memory[f"after_p{n}_first_wave_mb"] = round(worker.memory_info().rss / 2**20, 1)
                    row: dict = {"cold_first_wave_ms (includes the load)": round(first_ms, 1)}
                    for model, key in (("p1", "serial_on_one_slot_ms"), (f"p{n}", "on_n_slots_ms")):
                        await _timed(client, model, batch)  # warm-up
                        times, latencies, waves = [], [], []
                        for _ in range(repeats):
                            ms, outs = await _timed(client, model, batch)
                            judge(outs, f"{model} x{n}")
                            times.append(ms)
                            latencies.append([round(o.ms, 1) for o in outs])
                            waves.append(outs)
                        row[key] = _summary(times)
                        row[key.replace("_ms", "_request_latencies_ms")] = latencies
                        row[key.replace("_ms", "")] = _latencies(waves, n, row[key]["median"])
                    base, cand = row["serial_on_one_slot_ms"]["median"], row["on_n_slots_ms"]["median"]
                    row["time_saved_pct"] = round(100 * (base - cand) / base, 1)
                    rows[str(n)] = row
                out["n_requests"] = rows
                out["memory_mb"] = memory
                return out
            finally:
                await client.aclose()
        report.update(asyncio.run(on_parallel()))
    finally:
        par.stop()
    report["failures"] = failures
    report["reference_sha256"] = references
    report["comparison"] = {"rule": workload.rule(), "digest_of_rule": digest(workload.rule())}
    return report
