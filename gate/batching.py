"""The batch model checks of the validation gate (``validate_slots --mode batch``; VALIDATION.md M6:
"native batching needs concurrent batches with independent results").

A batch run is the offline procedure (``model_checks.py``, the offline workload and client) with the
model registered to batch: at count ``b`` (a **batch size**) the model gets ``max_batch`` ``b``, a
``batch_window_ms`` of :data:`BATCH_WINDOW_MS` and ``min(2 b, capacity)`` slots (capacity: the
advertised one within the offline row's admitted counts). A batch holds one lease
per member, so when M2 sees all those slots busy at once, at least two batches are running together
wherever ``2 b`` fits the capacity. What changes in the checks:

- **M1** is the offline M1: each item's serial answer, the reference every later answer must equal
  (a lone run on a batching model is not batched, ``inference.worker.batching``).
- **M2, M3, M5** as offline: their concurrent waves are served in batches, so "equals the serial
  reference" is the independent-results rule (each answer equals its serial answer, no tolerance).
- **M4** adds :func:`batches_are_formed_and_a_bad_request_fails_alone`: a wave of one request per
  slot must be served by session calls of ``b`` requests (``audiosite_batch_calls_total`` from
  ``/metrics``), and, for a family with a request that passes the web's checks but fails inside the
  model (``Workload.batch_invalid_options``: whisper's ``language`` on an English-only checkpoint), a
  wave with that request among healthy ones: it alone gets a 4xx inside a batch, the others their
  exact answers.
- **M6** is PASS when every count's M4 holds those waves: batch evidence admits batch sizes only.

The admission table's ``<task>/batch`` row lists the admitted batch sizes; a registration's
``max_batch`` above the largest one is refused (``inference.specs.batch_size_problem``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable

from prometheus_client.parser import text_string_to_metric_families

from .evidence import FAIL, NOT_APPLICABLE, PASS, check
from .model_checks import MODEL_ID, Client, ModeChecks, Plan, Run, _drained, _pick, _problem_list, \
    serial_answers_repeat_and_match_across_runtimes

BATCH_WINDOW_MS = 200
"""How long a batch's first run waits for more (ms): M3's waves arrive 20 ms apart, so a wave of one
request per slot fits in one window."""


def slots_for_batch_size(batch_size: int, capacity: int) -> int:
    """The slots of the model at batch size ``batch_size``: room for two batches, within ``capacity`` (the
    advertised capacity clipped to the slot counts admitted for offline serving)."""
    return max(1, min(2 * batch_size, capacity))


def batch_registration(batch_size: int) -> dict:
    """The registration keys of a batch run at ``batch_size``."""
    return {"max_batch": batch_size, "batch_window_ms": BATCH_WINDOW_MS}


def batch_calls_in(exposition: str) -> dict[str, dict[int, int]]:
    """``audiosite_batch_calls_total`` in a ``/metrics`` text, parsed by ``prometheus_client``:
    ``{model: {size: calls}}``."""
    out: dict[str, dict[int, int]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == "audiosite_batch_calls_total":
                out.setdefault(sample.labels["model"], {})[int(sample.labels["size"])] = int(sample.value)
    return out


def calls_since(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    """The calls by size counted between two readings of one model (sizes with none left out)."""
    return {size: n - before.get(size, 0) for size, n in after.items() if n > before.get(size, 0)}


COUNTED_WITHIN_S = 5.0
"""How long a batch call's count may trail its last answer (s). The worker counts a call after it handed
the members their replies (``inference.worker.batching.Batcher._call``: a metric never delays an
answer), so ``/metrics`` read right after the last answer can lack the call's count."""


async def calls_counted(read: Callable[[], Awaitable[dict[int, int]]], before: dict[int, int], requests: int,
                        within_s: float = COUNTED_WITHIN_S) -> dict[int, int]:
    """The calls by size counted since ``before`` once they cover ``requests`` requests
    (``sum(size * calls)``), reading ``read()`` (one model's ``{size: calls}``) every 20 ms; after
    ``within_s`` seconds, whatever was counted by then (a check on the result then names the shortfall)."""
    deadline = time.monotonic() + within_s
    while True:
        calls = calls_since(before, await read())
        if sum(size * n for size, n in calls.items()) >= requests or time.monotonic() >= deadline:
            return calls
        await asyncio.sleep(0.02)


async def batch_calls(client: Client, model_id: str = MODEL_ID) -> dict[int, int]:
    """``audiosite_batch_calls_total`` of ``model_id`` from the server's ``/metrics``: ``{size: calls}``."""
    return batch_calls_in((await client.http.get("/metrics")).text).get(model_id, {})


async def batches_are_formed_and_a_bad_request_fails_alone(run: Run, client: Client, slots: int
                                                           ) -> tuple[dict, list[str]]:
    """M4's batch waves at ``slots`` slots (see the module docstring). Returns ``(evidence, problems)``."""
    wl = run.workload
    entry = await client.entry(MODEL_ID)
    batch_size = int(entry.get("max_batch") or 1)
    problems: list[str] = []
    ev: dict = {"batch_size": batch_size, "slots": slots}
    if batch_size < 2:
        return {"batch": {**ev, "note": "batch size 1 is no batching"}}, []
    before = await batch_calls(client)
    items = _pick(wl.items, slots, 4)
    outs = list(await asyncio.gather(*[client.ask(MODEL_ID, it) for it in items]))
    for o in outs:
        o.match = o.status == 200 and o.sha == run.references.get(o.item)
    calls = await calls_counted(lambda: batch_calls(client), before, len(items))
    ev["wave"] = {"items": [o.item for o in outs], "exact": [o.match for o in outs], "calls_by_size": calls}
    problems += _problem_list(outs, "batch wave")
    if max(calls, default=0) != min(batch_size, slots):
        problems.append(f"a wave of {slots} requests was served by calls of sizes {sorted(calls)}, none of "
                        f"{min(batch_size, slots)} (batching not shown)")
    if wl.batch_invalid_options is None:
        ev["bad_request_in_batch"] = (f"{NOT_APPLICABLE}: every invalid {wl.family} request is refused by the "
                                      "web process before admission (no request fails inside the model)")
    else:
        ev["bad_request_in_batch"], more = await _bad_request_in_batch(run, client, slots)
        problems += more
    ev["drained_after"] = await _drained(client)
    if not ev["drained_after"]["drained"]:
        problems.append(f"counters not drained after the batch waves: {ev['drained_after']}")
    return {"batch": ev}, problems


async def _bad_request_in_batch(run: Run, client: Client, slots: int) -> tuple[dict, list[str]]:
    """One request with the workload's ``batch_invalid_options`` among ``slots - 1`` healthy ones, sent
    together: it gets a 4xx, they their exact answers, and every request went through batch calls."""
    wl = run.workload
    invalid = wl.batch_invalid_options or {}
    healthy = _pick(wl.items, max(1, slots - 1), 5)
    bad_item = dataclasses.replace(healthy[0], name="batch-invalid",
                                   options={**healthy[0].options, **invalid})
    before = await batch_calls(client)
    bad, *good = await asyncio.gather(client.ask(MODEL_ID, bad_item), *[client.ask(MODEL_ID, it) for it in healthy])
    for o in good:
        o.match = o.status == 200 and o.sha == run.references.get(o.item)
    calls = await calls_counted(lambda: batch_calls(client), before, len(good) + 1)
    problems = _problem_list(good, "beside a bad request in a batch")
    error = (bad.payload or {}).get("error") if isinstance(bad.payload, dict) else None
    if not 400 <= bad.status < 500:
        problems.append(f"the bad request in a batch got HTTP {bad.status}, not a 4xx")
    served = sum(size * n for size, n in calls.items())
    if served != len(good) + 1 or max(calls, default=0) < 2:
        problems.append(f"the bad request's wave was not served in batches: calls by size {calls}")
    return {"options": wl.batch_invalid_options, "status": bad.status, "error": error, "calls_by_size": calls,
            "healthy": [{"item": o.item, "status": o.status, "exact": o.match} for o in good]}, problems


def batch_admits_batch_sizes_only(plan: Plan, spec: dict, record: dict) -> dict:
    """M6 of a batch run: batch evidence admits batch sizes only; PASS when every count's M4 holds the
    batch waves (concurrent batches with independent results are M2/M3's)."""
    served = spec.get("modes", [])
    modes = {m: ("validated by this run; admits batch sizes only" if m == "batch" else
                 f"NOT_APPLICABLE: the family does not serve mode {m}" if m not in served else
                 f"not validated by this run (run --mode {m})") for m in ("offline", "streaming", "batch")}
    if "batch" not in served:
        return check(NOT_APPLICABLE, modes, f"family {plan.family} does not batch")
    missing = [n for n, entry in record["counts"].items()
               if not (entry["model_checks"].get("M4", {}).get("evidence") or {}).get("batch")]
    if missing:
        return check(FAIL, modes, f"no batch waves at count(s) {', '.join(missing)}")
    return check(PASS, modes, "batch evidence admits batch sizes only (independent results in concurrent "
                              "batches: M2/M3; batching shown and a bad request failing alone: M4)")


BATCH = ModeChecks(Client, serial_answers_repeat_and_match_across_runtimes, batch_admits_batch_sizes_only,
                   batches_are_formed_and_a_bad_request_fails_alone, slots_at=slots_for_batch_size,
                   registration_extra=batch_registration)
"""The batch procedure (module docstring); ``validate_slots --mode batch`` runs with it."""
