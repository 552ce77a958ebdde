"""``bench_slots --batch [--family silero_vad|whisper]``: what native batching buys, in one run.

Through HTTP (a ``manage.py serve --parallel-jobs`` stack, the LibriSpeech sample, ``requests`` requests
per row sent by closed-loop clients): one client to a 1-slot model (**serial**); N clients to an N-slot
model without batching (**N slots**); N clients to a model with ``slots`` N, ``max_batch`` N and a
``batch_window_ms`` of :data:`BATCH_WINDOW_MS` (**batch N**), for N = 2 and 4. Then the model alone in
this process on one thread: N requests one after the other vs one batched pass (silero_vad:
``VadSession.probabilities_many``; whisper: ``whisper_batching.transcribe_together``) at N = 1/2/4/8
(8 only here: the capacities admit at most 4 slots, and a batch holds one lease per member). Each row
gives throughput (requests/s), p50/p95 latency (nearest rank) and the ratio to the serial row; the
report is written as ``<out>/<backend>/<family>/<task>-batch/performance-<stamp>/performance.json``
(``backend``: the one the server resolves, ``cuda`` on a GPU machine; the model-alone rows run on the
CPU),
beside the batch evidence and never read by admission.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import soundfile

from bench.common import SAMPLE, quantile, task_body
from gate import evidence
from gate.batching import batch_calls_in, calls_counted
from gate.servers import Server
from inference import specs
from inference.adapters import get_adapter
from inference.adapters.base import AudioRequest, LoadContext
from inference.backend import resolve_backend

BATCH_WINDOW_MS = 10
"""``batch_window_ms`` of the batched models: long enough for closed-loop clients' requests to meet,
short beside one run of the sample (silero_vad about 100 ms, whisper tiny.en about 500 ms on 2 cores)."""

FAMILIES = {"silero_vad": ("vad", 48), "whisper": ("asr", 16)}
"""The families that batch: their task and the default requests per HTTP row."""

SIZES = (1, 2, 4, 8)
"""Batch sizes of the model-alone rows."""


def batch_report(family: str, requests: int | None, out: Path, write=print) -> dict:
    """Run the whole report for ``family`` (module docstring) and write it under ``out``; returns it.

    Raises:
        KeyError: ``family`` does not batch (not in :data:`FAMILIES`).
    """
    task, default_requests = FAMILIES[family]
    logging.getLogger("httpx").setLevel(logging.WARNING)
    requests = requests or default_requests
    samples, rate = soundfile.read(SAMPLE, dtype="float32")
    wav = Path(SAMPLE).read_bytes()
    started = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    backend = resolve_backend("auto")  # the server's: cuda where onnxruntime and CTranslate2 see a GPU
    report: dict[str, Any] = {"family": family, "task": task, "mode": "batch", "backend": backend,
                              "machine": {"cpus": os.cpu_count(), "load_average_start": round(os.getloadavg()[0], 2)},
                              "input_s": round(len(samples) / rate, 3), "requests_per_row": requests,
                              "batch_window_ms": BATCH_WINDOW_MS}
    write(f"{family}: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; input "
          f"{len(samples) / rate:.1f} s of speech, {requests} requests per HTTP row")
    models: list[dict] = [{"id": f"m{n}", "family": family, "slots": n} for n in (1, 2, 4)]
    models += [{"id": f"b{n}", "family": family, "slots": n, "max_batch": n, "batch_window_ms": BATCH_WINDOW_MS}
               for n in (2, 4)]
    with tempfile.TemporaryDirectory() as tmp:
        admission = _admission_with_batches(Path(tmp) / "admission", family, task, backend)
        server = Server(Path(tmp), models, True, {}, {specs.ADMISSION_DIR_ENV: str(admission)})
        try:
            report["http"] = asyncio.run(_http_rows(server, wav, requests))
        finally:
            server.stop()
    report["model_alone"] = _model_alone_rows(family, samples, rate)
    report["machine"]["load_average_end"] = round(os.getloadavg()[0], 2)
    _print(report, write)
    folder = out / backend / family / f"{task}-batch" / f"performance-{started}-{family}-batch-{backend}"
    folder.mkdir(parents=True, exist_ok=True)
    report["revision"] = evidence.code_revision()
    (folder / "performance.json").write_text(json.dumps(report, indent=1) + "\n")
    write(f"report written to {folder / 'performance.json'}")
    return report


def _admission_with_batches(folder: Path, family: str, task: str, backend: str) -> Path:
    """An admission table for the bench's server: the checked-in one of ``backend`` with offline slot
    counts and batch sizes 1..4 of ``family`` (the report measures them whether or not records admit
    them there yet)."""
    base = specs.ADMISSION_DIR / f"{backend}.json"
    table = json.loads(base.read_text()) if base.exists() else {}
    table.setdefault(family, {})[f"{task}/batch"] = [1, 2, 3, 4]
    table[family][f"{task}/offline"] = [1, 2, 3, 4]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{backend}.json").write_text(json.dumps(table))
    return folder


async def _http_rows(server: Server, wav: bytes, requests: int) -> list[dict]:
    """The HTTP rows: ``{"row", "model", "clients", "wall_ms", "rps", "p50_ms", "p95_ms", "calls_by_size"}``."""
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        for model in ("m1", "m2", "m4", "b2", "b4"):  # load and warm each model
            for _ in range(2):
                (await client.post("/v1/tasks/run", json=task_body(model, wav))).raise_for_status()
        before = batch_calls_in((await client.get("/metrics")).text)

        async def row(name: str, model: str, clients: int) -> dict:
            left = list(range(requests))
            latencies: list[float] = []

            async def one_client() -> None:
                while left:
                    left.pop()
                    t = time.perf_counter()
                    (await client.post("/v1/tasks/run", json=task_body(model, wav))).raise_for_status()
                    latencies.append((time.perf_counter() - t) * 1000)
            t0 = time.perf_counter()
            await asyncio.gather(*(one_client() for _ in range(clients)))
            wall_s = time.perf_counter() - t0
            return {"row": name, "model": model, "clients": clients, "wall_ms": round(wall_s * 1000),
                    "rps": round(requests / wall_s, 2), "p50_ms": round(statistics.median(latencies), 1),
                    "p95_ms": round(quantile(latencies, 0.95), 1)}
        rows = [await row("serial", "m1", 1), await row("2 slots", "m2", 2), await row("batch 2", "b2", 2),
                await row("4 slots", "m4", 4), await row("batch 4", "b4", 4)]

        async def calls_of(model: str) -> dict[int, int]:
            return batch_calls_in((await client.get("/metrics")).text).get(model, {})
        for r in rows:  # a plain model's row waits for nothing: it counts no batch call
            model = r["model"]
            r["calls_by_size"] = await calls_counted(functools.partial(calls_of, model), before.get(model, {}),
                                                     requests if model.startswith("b") else 0)
    return rows


def _model_alone_rows(family: str, samples, rate: int, repeats: int = 3) -> list[dict]:
    """N requests one after the other vs one batched call, in this process on one thread; median of
    ``repeats``: ``{"size", "serial_ms", "batched_ms", "speedup"}``."""
    adapter = get_adapter(family)
    ctx = LoadContext(specs.resolve_checkpoint(family, None), "cpu", 0, 1, {}, {})
    session = adapter.new_session(adapter.load(specs.require_spec(family), ctx), 0)
    defaults = specs.request_defaults(family)
    rows = []
    for size in SIZES:
        batch = [AudioRequest(samples, rate, dict(defaults)) for _ in range(size)]
        serial, batched = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            for request in batch:
                session.run(request)
            serial.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            session.run_batch(batch)
            batched.append((time.perf_counter() - t) * 1000)
        s_ms, b_ms = statistics.median(serial), statistics.median(batched)
        rows.append({"size": size, "serial_ms": round(s_ms, 1), "batched_ms": round(b_ms, 1),
                     "speedup": round(s_ms / b_ms, 2)})
    return rows


def _print(report: dict, write) -> None:
    serial_rps = report["http"][0]["rps"]
    write(f"{'row':<8} {'clients':>7} {'req/s':>7} {'p50 ms':>8} {'p95 ms':>8} {'vs serial':>9}  calls by size")
    for r in report["http"]:
        calls = ", ".join(f"{k}:{v}" for k, v in sorted(r["calls_by_size"].items())) or "-"
        write(f"{r['row']:<8} {r['clients']:>7} {r['rps']:>7} {r['p50_ms']:>8} {r['p95_ms']:>8} "
              f"{r['rps'] / serial_rps:>8.2f}x  {calls}")
    write(f"model alone, one thread: {'size':>4} {'serial ms':>10} {'batched ms':>11} {'speedup':>8}")
    for r in report["model_alone"]:
        write(f"{'':>24} {r['size']:>4} {r['serial_ms']:>10} {r['batched_ms']:>11} {r['speedup']:>7.2f}x")
    write(f"load average {report['machine']['load_average_end']:.2f} at the end")
