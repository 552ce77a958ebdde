"""The model checks M1–M6 of the validation gate (``../shared/spec/VALIDATION.md``), run against real
``manage.py serve`` processes over HTTP, for one family × task × mode × backend and several slot counts.

Order of a run (``validate_slots`` calls :func:`run_model_validation`):

1. M1 on two fresh servers: the legacy runtime, then the parallel runtime with one slot. On each, every
   workload item is sent serially three times (the first request of the run is cold: it loads the
   model); the serial repeat variation is measured first, on the legacy server, and the legacy answers
   become the serial references. M1 passes when no item varies on either server and the parallel
   one-slot answers equal the legacy ones under the workload's fixed rule (``workloads.py``).
2. Per count ``n``, ``starts`` fresh parallel servers, each with the model registered lazily at ``n``
   slots. Each start: M2 (a cold wave of ``n`` different requests sent together on the unloaded model,
   three mixed warm waves, an unload, a cold reload wave; every answer equal to its serial reference;
   the model's ``active_slots`` polled during every wave, the most seen recorded, never above ``n`` and
   equal to ``n`` at least once; ``active_slots`` and ``queued_requests`` back to 0 after), M3 (mixed
   warm waves with every slot on a different input/length/options, admission order reversed every other
   wave: two waves, ten at the largest count). The first start of each count also runs M4 (recovery)
   and M5 (memory, ``memory_cycles`` cycles).
3. M6 from the mode: an offline run admits offline only.

Every request's outcome (phase, wave, item, HTTP status, answer hash, match) is appended to
``requests.jsonl`` in the run directory; references and any mismatching answers are kept under
``outputs/`` (strings over 2,000 characters, e.g. audio, replaced by their SHA-256 and length).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from inference import specs
from inference.runtime.context import KEYS

from . import evidence
from .evidence import FAIL, NOT_APPLICABLE, PASS, UNSUPPORTED, check
from .servers import Server
from .workloads import Item, Workload, digest, fixtures_manifest

MODEL_ID = "val-model"
SERIAL_REPEATS = 3
WARM_WAVES = 3
MIXED_WAVES = 2
MIXED_WAVES_LARGEST = 10
POLL_INTERVAL_S = 0.01
DRAIN_WAIT_S = 10.0
REQUEST_TIMEOUT_S = 600.0
# M5 rule: the idle worker RSS after each unload, over the last ten cycles, must stay within the
# tolerance of its median, and the median of the last five must not exceed the median of the five
# before by more than the tolerance. Tolerance = max(floor, 4 x the median absolute difference between
# consecutive idle samples of the last ten cycles), i.e. derived from the run's own cycle-to-cycle noise.
MEMORY_FLOOR_MB = 8.0
MEMORY_NOISE_FACTOR = 4.0
MEMORY_WINDOW = 10
MB = 2**20
UNLOAD_DURING_LOAD_ATTEMPTS = 3


def _shrink(value: Any) -> Any:
    """A copy of an answer for the raw-output files: strings over 2,000 characters become
    ``"sha256:<hex> (<n> chars)"`` so audio and MIDI do not bloat the records."""
    if isinstance(value, str) and len(value) > 2000:
        return f"sha256:{hashlib.sha256(value.encode()).hexdigest()} ({len(value)} chars)"
    if isinstance(value, dict):
        return {k: _shrink(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shrink(v) for v in value]
    return value


@dataclass
class Outcome:
    """One answered request: HTTP status, comparable-answer hash (None unless 200), latency in ms;
    for a streamed answer, ``steps_ms``: the time to its first frame, then between consecutive frames."""

    item: str
    status: int
    sha: str | None
    ms: float
    payload: dict | None = None
    match: bool | None = None
    steps_ms: list[float] = field(default_factory=list)


@dataclass
class Run:
    """Shared state of one validation run (the run directory, the references, the request log)."""

    workload: Workload
    run_dir: Path
    backend: str
    references: dict[str, str] = field(default_factory=dict)
    log_lines: int = 0
    mismatches: int = 0
    notes: dict = field(default_factory=dict)  # what a mode's checks pass on (e.g. M1's serial step times)

    def log(self, **entry: Any) -> None:
        with open(self.run_dir / "requests.jsonl", "a") as handle:
            handle.write(json.dumps(entry, sort_keys=True) + "\n")
        self.log_lines += 1

    def keep(self, folder: str, name: str, payload: dict | None) -> None:
        target = self.run_dir / "outputs" / folder
        target.mkdir(parents=True, exist_ok=True)
        (target / f"{name}.json").write_text(json.dumps(_shrink(payload), indent=1, sort_keys=True) + "\n")


class Client:
    """HTTP to one server (management token when the server has one)."""

    def __init__(self, server: Server, workload: Workload):
        headers = {"Authorization": f"Token {server.token}"} if server.token else {}
        self.http = httpx.AsyncClient(base_url=server.url, timeout=REQUEST_TIMEOUT_S, headers=headers)
        self.workload = workload
        self.server = server

    async def aclose(self) -> None:
        await self.http.aclose()

    async def ask(self, model_id: str, item: Item) -> Outcome:
        """Send ``item`` to ``model_id``; the answer minus volatile fields, hashed."""
        started = time.perf_counter()
        resp = await self.http.post("/v1/tasks/run", json=self.workload.body(model_id, item))
        ms = (time.perf_counter() - started) * 1000
        try:
            payload = resp.json()
        except ValueError:
            payload = {"_body": resp.text[:2000]}
        if resp.status_code != 200:
            return Outcome(item.name, resp.status_code, None, ms, payload)
        comparable = self.workload.comparable(payload)
        return Outcome(item.name, 200, digest(comparable), ms, comparable)

    async def send_invalid(self, model_id: str) -> tuple[int, Any]:
        """Send the workload's invalid request to ``model_id``: ``(HTTP status, its error or body text)``."""
        resp = await self.http.post("/v1/tasks/run", json={"model": model_id, "request": self.workload.invalid})
        try:
            return resp.status_code, resp.json().get("error")
        except ValueError:
            return resp.status_code, resp.text[:300]

    async def entry(self, model_id: str) -> dict:
        """``GET /v1/models/<id>``; ``{"_status": code}`` when it is not 200 (e.g. 404 unknown)."""
        resp = await self.http.get(f"/v1/models/{model_id}")
        return resp.json() if resp.status_code == 200 else {"_status": resp.status_code}

    async def manage(self, path: str, body: dict | None = None) -> httpx.Response:
        return await self.http.post(path, json=body or {})


class LeaseWatch:
    """Polls ``GET /v1/models/<id>`` while a wave runs: the most ``active_slots`` and
    ``queued_requests`` seen, and the states seen."""

    def __init__(self, client: Client, model_id: str):
        self.client, self.model_id = client, model_id
        self.max_active = 0
        self.max_queued = 0
        self.states: set[str] = set()
        self.polls = 0
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()

    async def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                entry = await self.client.entry(self.model_id)
            except httpx.HTTPError:
                entry = {}
            self.polls += 1
            self.max_active = max(self.max_active, int(entry.get("active_slots") or 0))
            self.max_queued = max(self.max_queued, int(entry.get("queued_requests") or 0))
            if entry.get("state"):
                self.states.add(entry["state"])
            try:
                await asyncio.wait_for(self._stop.wait(), POLL_INTERVAL_S)
            except TimeoutError:
                pass

    async def __aenter__(self) -> LeaseWatch:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        if self._task:
            await self._task


async def _wave(run: Run, client: Client, items: list[Item], *, stagger_s: float = 0.0, watch: bool = True,
                model_id: str = MODEL_ID, **where: Any) -> tuple[list[Outcome], int, float]:
    """Send ``items`` together (or ``stagger_s`` apart, in list order, so they are admitted in that
    order); compare each 200 answer with its serial reference. Returns (outcomes, most active slots
    seen, wave wall time ms)."""
    async def one(index: int, item: Item) -> Outcome:
        if stagger_s:
            await asyncio.sleep(index * stagger_s)
        return await client.ask(model_id, item)

    started = time.perf_counter()
    if watch:
        async with LeaseWatch(client, model_id) as seen:
            outcomes = await asyncio.gather(*[one(i, it) for i, it in enumerate(items)])
        most = seen.max_active
    else:
        outcomes = await asyncio.gather(*[one(i, it) for i, it in enumerate(items)])
        most = -1
    wall_ms = (time.perf_counter() - started) * 1000
    for position, out in enumerate(outcomes):
        ref = run.references.get(out.item)
        out.match = out.status == 200 and out.sha == ref
        run.log(**where, position=position, item=out.item, status=out.status, sha256=out.sha, match=out.match,
                ms=round(out.ms, 1))
        if not out.match:
            run.mismatches += 1
            run.keep("mismatch", f"{'-'.join(str(v) for v in where.values())}-{position}-{out.item}", out.payload)
    return list(outcomes), most, wall_ms


def _pick(items: tuple[Item, ...], n: int, wave: int) -> list[Item]:
    """``n`` items for wave ``wave``: a rotation, so each slot gets a different input/options mix."""
    return [items[(wave + k) % len(items)] for k in range(n)]


async def _drained(client: Client, model_id: str = MODEL_ID) -> dict:
    """Whether ``model_id``'s ``active_slots`` and ``queued_requests`` reach 0 within ``DRAIN_WAIT_S``:
    ``{"active_slots", "queued_requests", "drained": bool}`` (the last values seen)."""
    deadline = time.monotonic() + DRAIN_WAIT_S
    entry: dict = {}
    while time.monotonic() < deadline:
        entry = await client.entry(model_id)
        if not entry.get("active_slots") and not entry.get("queued_requests"):
            break
        await asyncio.sleep(0.05)
    return {"active_slots": entry.get("active_slots"), "queued_requests": entry.get("queued_requests"),
            "drained": not entry.get("active_slots") and not entry.get("queued_requests")}


# -- M1 ---------------------------------------------------------------------------------------------

async def _serial(run: Run, client: Client, phase: str) -> dict[str, list[Outcome]]:
    """Every workload item sent ``SERIAL_REPEATS`` times, one request at a time: item name -> outcomes."""
    out: dict[str, list[Outcome]] = {}
    for item in run.workload.items:
        for repeat in range(SERIAL_REPEATS):
            got = await client.ask(MODEL_ID, item)
            out.setdefault(item.name, []).append(got)
            run.log(phase=phase, item=item.name, repeat=repeat, status=got.status, sha256=got.sha, ms=round(got.ms, 1))
    return out


def serial_answers_repeat_and_match_across_runtimes(run: Run, workdir: Path, admission_dir: Path) -> dict:
    """M1: every workload item, sent serially ``SERIAL_REPEATS`` times, gets the same answer each time on the
    legacy runtime (measured first) and on the parallel runtime at one slot, and the two runtimes agree.

    Starts one fresh server per runtime under ``workdir`` (the table under ``admission_dir``). Sets
    ``run.references`` (item -> SHA-256 of the legacy runtime's first answer: the serial references the
    later checks compare against). Returns the M1 check (FAIL names each varying or differing item).

    Raises:
        CommandError (from :class:`Server`): a server did not start.
    """
    wl = run.workload
    evidence_: dict = {"repeats_per_item": SERIAL_REPEATS, "items": [i.name for i in wl.items]}
    problems: list[str] = []
    answers: dict[str, dict[str, list[Outcome]]] = {}
    for runtime, parallel in (("legacy", False), ("parallel_one_slot", True)):
        folder = workdir / f"m1-{runtime}"
        folder.mkdir()
        slots = 1 if parallel else None
        models = [*wl.component_registrations(slots), wl.registration(MODEL_ID, slots)]
        server = Server(folder, models, parallel, {"backend": run.backend},
                        {specs.ADMISSION_DIR_ENV: str(admission_dir)})
        try:
            async def go(server: Server = server, runtime: str = runtime) -> dict[str, list[Outcome]]:
                client = Client(server, wl)
                try:
                    return await _serial(run, client, f"M1-{runtime}")
                finally:
                    await client.aclose()
            answers[runtime] = asyncio.run(go())
            evidence_[f"{runtime}_start_s"] = round(server.start_s, 2)
        finally:
            server.stop()
        variation = {}
        for name, outs in answers[runtime].items():
            statuses = sorted({o.status for o in outs})
            hashes = sorted({o.sha for o in outs if o.sha})
            variation[name] = {"statuses": statuses, "distinct_answers": len(hashes),
                               "cold_ms": round(outs[0].ms, 1), "warm_ms": [round(o.ms, 1) for o in outs[1:]]}
            if statuses != [200]:
                problems.append(f"{runtime} {name}: HTTP {statuses}: {outs[0].payload}")
            elif len(hashes) != 1:
                problems.append(f"{runtime} {name}: {len(hashes)} different answers in {SERIAL_REPEATS} serial repeats")
        evidence_[f"{runtime}_serial_variation"] = variation
        if runtime == "legacy":
            for name, outs in answers["legacy"].items():
                if outs[0].sha:
                    run.references[name] = outs[0].sha
                    run.keep("reference", name, outs[0].payload)
    parity = {}
    for name in answers["legacy"]:
        legacy = {o.sha for o in answers["legacy"][name]}
        par = {o.sha for o in answers["parallel_one_slot"][name]}
        parity[name] = legacy == par and None not in legacy
        if not parity[name]:
            problems.append(f"{name}: parallel one-slot answers differ from the legacy runtime's")
            for i, o in enumerate(answers["parallel_one_slot"][name]):
                run.keep("mismatch", f"M1-parallel-{name}-{i}", o.payload)
    evidence_["legacy_equals_parallel_one_slot"] = parity
    evidence_["reference_sha256"] = dict(run.references)
    return check(FAIL if problems else PASS, evidence_, "; ".join(problems))


# -- per count ----------------------------------------------------------------------------------------

def _problem_list(outcomes: list[Outcome], where: str) -> list[str]:
    """One problem line per outcome that is not an exact 200 (``Outcome.match`` false), prefixed by ``where``."""
    bad = [o for o in outcomes if not o.match]
    return [f"{where}: {o.item} HTTP {o.status}{'' if o.status != 200 else ' answer differs from the serial reference'}"
            for o in bad]


async def _concurrent_answers_match_serial(run: Run, client: Client, n: int, start: int,
                                           largest: bool) -> tuple[dict, dict]:
    """M2 and M3 on one fresh start at ``n`` slots: concurrent answers equal the serial references.

    M2: a cold wave of ``n`` different requests on the lazily registered, unloaded model, ``WARM_WAVES``
    warm waves, an unload, then a reload wave; ``active_slots`` is polled during every wave and must
    reach ``n`` at least once and never exceed it, and the counters must drain to 0 afterwards.
    M3: ``MIXED_WAVES`` (``MIXED_WAVES_LARGEST`` at the run's ``largest`` count) waves with every slot on a
    different input, length or options, sent staggered with the admission order reversed every other
    wave. Returns ``(m2, m3)`` evidence dicts, each with its ``problems`` list (empty = passed).
    """
    wl = run.workload
    m2: dict = {"waves": []}
    problems: list[str] = []
    most_seen = 0
    # a true concurrent cold wave: the model is registered lazily and nothing has loaded it yet
    before = await client.entry(MODEL_ID)
    m2["state_before_cold_wave"] = before.get("state")
    if before.get("loaded"):
        problems.append("the model was loaded before the cold wave")
    phases = [("cold", 0)] + [("warm", w) for w in range(1, WARM_WAVES + 1)]
    for kind, w in phases:
        outs, most, wall_ms = await _wave(run, client, _pick(wl.items, n, w), count=n, start=start,
                                          phase=f"M2-{kind}", wave=w)
        most_seen = max(most_seen, most)
        m2["waves"].append({"kind": kind, "items": [o.item for o in outs], "max_active_slots": most,
                            "wall_ms": round(wall_ms, 1), "all_exact": all(o.match for o in outs)})
        problems += _problem_list(outs, f"start {start} {kind} wave {w}")
    resp = await client.manage("/v1/models/unload", {"id": MODEL_ID})
    after_unload = await client.entry(MODEL_ID)
    m2["unload"] = {"status": resp.status_code, "loaded_after": after_unload.get("loaded")}
    if resp.status_code != 200 or after_unload.get("loaded"):
        problems.append(f"start {start}: unload answered {resp.status_code}, "
                        f"loaded after: {after_unload.get('loaded')}")
    outs, most, wall_ms = await _wave(run, client, _pick(wl.items, n, WARM_WAVES + 1), count=n, start=start,
                                      phase="M2-reload", wave=WARM_WAVES + 1)
    most_seen = max(most_seen, most)
    m2["waves"].append({"kind": "reload", "items": [o.item for o in outs], "max_active_slots": most,
                        "wall_ms": round(wall_ms, 1), "all_exact": all(o.match for o in outs)})
    problems += _problem_list(outs, f"start {start} reload wave")
    # M3: every slot a different input/length/options; admission order reversed every other wave
    m3: dict = {"waves": []}
    m3_problems: list[str] = []
    for w in range(MIXED_WAVES_LARGEST if largest else MIXED_WAVES):
        items = _pick(wl.items, n, 2 * w + 1)
        reverse = w % 2 == 1
        if reverse:
            items = items[::-1]
        outs, most, wall_ms = await _wave(run, client, items, stagger_s=0.02, count=n, start=start,
                                          phase="M3-mixed", wave=w)
        most_seen = max(most_seen, most)
        m3["waves"].append({"admission_order": [o.item for o in outs], "reversed": reverse,
                            "max_active_slots": most, "wall_ms": round(wall_ms, 1),
                            "all_exact": all(o.match for o in outs)})
        m3_problems += _problem_list(outs, f"start {start} mixed wave {w}")
    drained = await _drained(client)
    m2["drained_after"] = drained
    m2["max_active_slots_seen"] = most_seen
    if not drained["drained"]:
        problems.append(f"start {start}: counters not drained: {drained}")
    if most_seen > n:
        problems.append(f"start {start}: {most_seen} active slots seen, above the count {n}")
    elif most_seen < n:
        problems.append(f"start {start}: at most {most_seen} of {n} slots were seen busy at once (concurrency "
                        "not shown)")
    m2["problems"] = problems
    m3["problems"] = m3_problems
    return m2, m3


async def _lazy_unload(run: Run, client: Client, n: int, model_id: str, bulk: bool) -> tuple[dict, list[str]]:
    """Register ``model_id`` lazily, send ``n`` requests (its first lazy load), and unload it (targeted
    or bulk, with the main model) while that load runs; then it must serve exactly. A family with a
    ``hold_load`` load option (the fixture family's ``load_barrier``) has its load held at a barrier
    until the unload was sent; any other is unloaded as soon as its state leaves ``unloaded``."""
    wl = run.workload
    problems: list[str] = []
    kind = "bulk" if bulk else "targeted"
    registration = {**wl.registration(model_id, n), "lazy": True}
    barrier = f"{model_id}-load" if wl.hold_load else None
    if barrier:
        registration["load_options"] = {**registration.get("load_options", {}), wl.hold_load: barrier}
    reg = await client.manage("/v1/models/load", registration)
    if reg.status_code != 200:
        return {"register_status": reg.status_code, "body": reg.text[:500]}, [f"lazy registration {reg.status_code}"]
    # A realtime turn enters the FIFO only at its commit, after its session is set up, so it may queue
    # behind the unload and load the model again (as it should): the check sends the items that enter
    # the FIFO as they are sent (every offline item, the HTTP streams).
    items = _pick(tuple(i for i in wl.items if i.route != "realtime") or wl.items, n, 0)
    tasks = [asyncio.create_task(client.ask(model_id, it)) for it in items]
    states_seen = set()
    state = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # unload as soon as the first lazy load has begun
        if barrier and not int(client.server.redis.get(KEYS.fixture_arrived(barrier)) or 0):
            await asyncio.sleep(0.005)
            continue
        state = (await client.entry(model_id)).get("state")
        states_seen.add(state)
        if state != "unloaded" or all(t.done() for t in tasks):
            break
        await asyncio.sleep(0.005)
    state_at_unload = state
    if bulk:
        unload = asyncio.create_task(client.manage("/v1/tasks/unload_models", {"model_ids": [model_id, MODEL_ID]}))
    else:
        unload = asyncio.create_task(client.manage("/v1/models/unload", {"id": model_id}))
    if barrier:  # let the held load finish once the unload is waiting behind it
        await asyncio.sleep(0.3)
        client.server.redis.lpush(KEYS.fixture_release(barrier), "go")
    resp = await unload
    outs = await asyncio.gather(*tasks)
    for o in outs:
        o.match = o.status == 200 and o.sha == run.references.get(o.item)
        run.log(phase=f"M4-{kind}-unload-during-load", count=n, item=o.item,
                status=o.status, sha256=o.sha, match=o.match)
        if o.status >= 500 and o.status != 503 or (o.status == 200 and not o.match) or o.status < 200:
            problems.append(f"{kind} unload during a lazy load: {o.item} got HTTP "
                            f"{o.status}{' with a different answer' if o.status == 200 else ''}")
    after = await client.entry(model_id)
    if resp.status_code != 200:
        problems.append(f"{kind} unload answered {resp.status_code}: {resp.text[:300]}")
    if after.get("loaded"):
        problems.append(f"{model_id} still loaded after the unload returned")
    if barrier:  # the reload below passes the same barrier once: let it through in advance
        client.server.redis.lpush(KEYS.fixture_release(barrier), "go")
    outs_after, _, _ = await _wave(run, client, items, model_id=model_id, watch=False, count=n,
                                   phase=f"M4-after-{kind}-unload", wave=0)
    problems += _problem_list(outs_after, f"after the {kind} unload")
    await client.manage("/v1/models/unload", {"id": model_id})
    return {"model_id": model_id, "load_held_at_barrier": barrier, "state_when_unload_sent": state_at_unload,
            "states_seen_before": sorted(s for s in states_seen if s),
            "unload_status": resp.status_code,
            "unload_body": resp.json() if resp.status_code == 200 else resp.text[:300],
            "during": [{"item": o.item, "status": o.status, "exact": o.match} for o in outs],
            "after": [{"item": o.item, "status": o.status, "exact": o.match} for o in outs_after],
            "overlapped_the_load": state_at_unload == "loading"}, problems


async def _unload_during_first_load(run: Run, client: Client, n: int, base_id: str,
                                    bulk: bool) -> tuple[dict, list[str]]:
    """Up to ``UNLOAD_DURING_LOAD_ATTEMPTS`` fresh lazy registrations until an unload really meets a
    first load in progress; never meeting one is a failure (not shown), whatever the answers were."""
    attempts, problems = [], []
    for attempt in range(1, UNLOAD_DURING_LOAD_ATTEMPTS + 1):
        ev, more = await _lazy_unload(run, client, n, f"{base_id}{attempt}", bulk)
        attempts.append(ev)
        problems += more
        if ev.get("overlapped_the_load"):
            break
    overlapped = any(a.get("overlapped_the_load") for a in attempts)
    if not overlapped:
        problems.append(f"{'bulk' if bulk else 'targeted'} unload never met a first lazy load in progress in "
                        f"{len(attempts)} attempts (the load finished first): not shown")
    return {"overlapped_the_load": overlapped, "attempts": attempts}, problems


async def _serving_recovers_from_failures(run: Run, client: Client, n: int, workdir: Path,
                                          extra: ExtraRecovery | None = None) -> dict:
    """M4 at ``n`` slots: the model keeps serving exact answers through what goes wrong around it.

    In order: an invalid request beside ``n - 1`` healthy ones (a 4xx for it, exact answers for them); a
    registration whose checkpoint is broken (written under ``workdir``) fails to load without a 5xx other
    than 503, a request to it is refused, and a good registration of the same id then serves exactly; a
    targeted and a bulk unload sent while a first lazy load runs (each must really meet the load, see
    :func:`_unload_during_first_load`); ``unload_all_models``, after which the main model serves exactly
    again and the counters drain; then the mode's ``extra`` checks (``ModeChecks.m4_extra``: streams
    that disconnect or reset mid-stream), if any. Returns the M4 check (FAIL lists every problem).
    """
    wl = run.workload
    problems: list[str] = []
    ev: dict = {}
    # invalid input beside healthy work
    healthy = _pick(wl.items, max(1, n - 1), 2)
    bad_task = asyncio.create_task(client.send_invalid(MODEL_ID))
    good = list(await asyncio.gather(*[client.ask(MODEL_ID, it) for it in healthy]))
    invalid_status, invalid_error = await bad_task
    for o in good:
        o.match = o.status == 200 and o.sha == run.references.get(o.item)
        run.log(phase="M4-beside-invalid", count=n, item=o.item, status=o.status, sha256=o.sha, match=o.match)
    ev["invalid_beside_healthy"] = {"invalid_status": invalid_status, "invalid_error": invalid_error,
                                    "healthy": [{"item": o.item, "status": o.status, "exact": o.match} for o in good]}
    if not 400 <= invalid_status < 500:
        problems.append(f"invalid input got HTTP {invalid_status}, not a 4xx")
    problems += _problem_list(good, "beside invalid input")
    # load failure, then retry with a good registration
    bad_id = "val-badload"
    broken = workdir / ("broken-checkpoint" if wl.bad_load == "directory" else "broken-checkpoint.onnx")
    if wl.bad_load == "directory":
        broken.mkdir(exist_ok=True)
    else:
        broken.write_bytes(b"this is not a model checkpoint\n" * 8)
    if wl.bad_component:  # a pipeline: one of its components cannot load (registered lazily, so it registers)
        comp = await client.manage("/v1/models/load", {**wl.bad_component, "path": str(broken), "lazy": True})
        ev["broken_component_registration"] = {"status": comp.status_code, "body": comp.text[:300]}
    if isinstance(wl.bad_load, dict):
        bad_reg = wl.registration(bad_id, n, load_options=dict(wl.bad_load), lazy=False)
    else:
        bad_reg = wl.registration(bad_id, n, path=str(broken), lazy=False)
    load_bad = await client.manage("/v1/models/load", bad_reg)
    entry_bad = await client.entry(bad_id)
    probe = await client.ask(bad_id, wl.items[0])
    entry_probe = await client.entry(bad_id)
    # The good entry states the keys the bad one changed: a load applies only the keys sent to the
    # registration (a null path is the family's packaged checkpoint again).
    load_good = await client.manage("/v1/models/load", wl.registration(
        bad_id, n, path=None, load_options=dict(wl.load_options or {}), lazy=False))
    retry_outs, _, _ = await _wave(run, client, _pick(wl.items, n, 1), model_id=bad_id, watch=False, count=n,
                                   phase="M4-after-load-failure", wave=0)
    ev["load_failure_then_retry"] = {
        "bad_registration": _shrink(bad_reg), "bad_load_status": load_bad.status_code,
        "bad_load_body": load_bad.text[:500], "state_after": entry_bad.get("state"),
        "last_error": entry_bad.get("last_error"), "retry_at": entry_bad.get("retry_at"),
        "request_after_failure_status": probe.status, "state_after_request": entry_probe.get("state"),
        "request_after_failure_error": (probe.payload or {}).get("error"),
        "good_registration_status": load_good.status_code,
        "after_retry": [{"item": o.item, "status": o.status, "exact": o.match} for o in retry_outs]}
    if (not wl.bad_component and load_bad.status_code == 200
            and (entry_bad.get("loaded") or entry_bad.get("state") == "ready")):
        problems.append("the broken registration loaded")  # a pipeline has no weights: its components fail
    if load_bad.status_code >= 500 and load_bad.status_code != 503:
        problems.append(f"the failing load answered HTTP {load_bad.status_code}")
    if probe.status == 200 or (probe.status >= 500 and probe.status != 503):
        problems.append(f"a request to the failed model got HTTP {probe.status}")
    if load_good.status_code != 200:
        problems.append(f"the good registration after the failure answered {load_good.status_code}: "
                        f"{load_good.text[:300]}")
    problems += _problem_list(retry_outs, "after the load failure and retry")
    await client.manage("/v1/models/unload", {"id": bad_id})
    # targeted and bulk unload during a first lazy load
    ev["targeted_unload_during_lazy_load"], more = await _unload_during_first_load(run, client, n, "val-lazy-a",
                                                                                   bulk=False)
    problems += more
    ev["bulk_unload_during_lazy_load"], more = await _unload_during_first_load(run, client, n, "val-lazy-b",
                                                                               bulk=True)
    problems += more
    # bulk unload of everything, then the main model serves exactly again
    everything = await client.manage("/v1/tasks/unload_all_models")
    ev["unload_all"] = {"status": everything.status_code,
                        "body": everything.json() if everything.status_code == 200 else everything.text[:300]}
    if everything.status_code != 200:
        problems.append(f"unload_all_models answered {everything.status_code}")
    outs, _, _ = await _wave(run, client, _pick(wl.items, n, 3), count=n, phase="M4-after-unload-all", wave=0,
                             watch=False)
    problems += _problem_list(outs, "after unload_all_models")
    ev["after_unload_all"] = [{"item": o.item, "status": o.status, "exact": o.match} for o in outs]
    ev["drained_after"] = await _drained(client)
    if not ev["drained_after"]["drained"]:
        problems.append(f"counters not drained after M4: {ev['drained_after']}")
    if extra is not None:
        extra_ev, more = await extra(run, client, n)
        ev.update(extra_ev)
        problems += more
    return check(FAIL if problems else PASS, ev, "; ".join(problems))


class RssSampler:
    """Samples the worker's RSS (and the whole serve tree's) every 20 ms in a thread; ``peak`` is the
    most seen since the last ``reset`` (bytes)."""

    def __init__(self, server: Server):
        self.server = server
        self.worker = server.worker()
        self.peak = 0
        self.tree_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def now(self) -> int:
        try:
            return self.worker.memory_info().rss
        except Exception:  # the worker died: a new one is found on the next call
            self.worker = self.server.worker()
            return self.worker.memory_info().rss

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.now())
                self.tree_peak = max(self.tree_peak, self.server.tree_rss_bytes())
            except Exception:  # noqa: BLE001 - sampling must not kill the run; a dead worker shows in M2/M4
                pass
            self._stop.wait(0.02)

    def reset(self) -> None:
        self.peak = self.now()
        self.tree_peak = self.server.tree_rss_bytes()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def stabilisation(idle_mb: list[float]) -> dict:
    """The M5 verdict on a series of idle RSS samples (MB, one per cycle, after each unload).

    Rule (module constants): over the last ``MEMORY_WINDOW`` cycles, tolerance = max(``MEMORY_FLOOR_MB``,
    ``MEMORY_NOISE_FACTOR`` x median |idle[i] - idle[i-1]|); stable when every sample of the window is
    within the tolerance of the window's median, and the median of the window's last half exceeds the
    median of its first half by at most the tolerance (no upward trend).
    """
    window = idle_mb[-MEMORY_WINDOW:]
    if len(window) < MEMORY_WINDOW:
        return {"stable": False, "reason": f"only {len(idle_mb)} cycles (need at least {MEMORY_WINDOW})"}
    steps = [abs(b - a) for a, b in zip(window, window[1:], strict=False)]
    noise = statistics.median(steps)
    tolerance = max(MEMORY_FLOOR_MB, MEMORY_NOISE_FACTOR * noise)
    middle = statistics.median(window)
    spread = max(abs(v - middle) for v in window)
    half = MEMORY_WINDOW // 2
    trend = statistics.median(window[half:]) - statistics.median(window[:half])
    stable = spread <= tolerance and trend <= tolerance
    return {"stable": stable, "tolerance_mb": round(tolerance, 2), "noise_median_step_mb": round(noise, 2),
            "window_median_mb": round(middle, 1), "max_deviation_mb": round(spread, 2), "trend_mb": round(trend, 2),
            "rule": (f"last {MEMORY_WINDOW} idle samples within tolerance of their median and "
                     f"median(last {half}) - median(first {half}) <= tolerance; tolerance = max({MEMORY_FLOOR_MB} MB, "
                     f"{MEMORY_NOISE_FACTOR} x median step between consecutive idle samples)")}


async def _idle_memory_stabilises_over_load_cycles(run: Run, client: Client, n: int, cycles: int) -> dict:
    """M5 at ``n`` slots: over ``cycles`` cycles of cold wave, warm wave and ``unload_all_models``, the
    answers stay exact and the idle RSS after each unload (the worker's, and the whole serve tree's, in
    MiB) stabilises by :func:`stabilisation`'s rule. Returns the M5 check with the per-cycle samples."""
    wl = run.workload
    await client.manage("/v1/tasks/unload_all_models")
    await asyncio.sleep(0.5)
    sampler = RssSampler(client.server)
    rows = []
    problems: list[str] = []
    try:
        baseline = sampler.now() / MB
        baseline_tree = client.server.tree_rss_bytes() / MB
        for c in range(cycles):
            sampler.reset()
            cold, _, cold_ms = await _wave(run, client, _pick(wl.items, n, c), watch=False, count=n,
                                           phase="M5-cold", wave=c)
            after_cold, peak_cold, tree_peak_cold = sampler.now() / MB, sampler.peak / MB, sampler.tree_peak / MB
            warm, _, warm_ms = await _wave(run, client, _pick(wl.items, n, c + 1), watch=False, count=n,
                                           phase="M5-warm", wave=c)
            after_warm = sampler.now() / MB
            resp = await client.manage("/v1/tasks/unload_all_models")
            if resp.status_code != 200:
                problems.append(f"cycle {c}: unload_all_models answered {resp.status_code}")
            await asyncio.sleep(0.3)
            idle, idle_tree = sampler.now() / MB, client.server.tree_rss_bytes() / MB
            rows.append({"cycle": c, "after_cold_mb": round(after_cold, 1), "peak_cold_mb": round(peak_cold, 1),
                         "after_warm_mb": round(after_warm, 1), "idle_after_unload_mb": round(idle, 1),
                         "tree_peak_mb": round(tree_peak_cold, 1), "tree_idle_mb": round(idle_tree, 1),
                         "cold_wave_ms": round(cold_ms, 1), "warm_wave_ms": round(warm_ms, 1)})
            problems += _problem_list(cold + warm, f"memory cycle {c}")
    finally:
        sampler.close()
    worker = stabilisation([r["idle_after_unload_mb"] for r in rows])
    tree = stabilisation([r["tree_idle_mb"] for r in rows])
    ev = {"unit": "MiB (RSS, psutil)", "cycles": len(rows), "worker_idle_before_mb": round(baseline, 1),
          "tree_idle_before_mb": round(baseline_tree, 1),
          "first_request_peak_mb": rows[0]["peak_cold_mb"] if rows else None,
          "first_request_peak_over_idle_mb": round(rows[0]["peak_cold_mb"] - baseline, 1) if rows else None,
          "loaded_after_first_wave_mb": rows[0]["after_cold_mb"] if rows else None,
          "retained_idle_after_last_unload_mb": round(rows[-1]["idle_after_unload_mb"] - baseline, 1) if rows else None,
          "worker_stabilisation": worker, "tree_stabilisation": tree, "per_cycle": rows,
          "sampled": "worker RSS every 20 ms through each cold wave (peak), after it, after a warm wave, "
                     "and 0.3 s after unload_all_models (idle); tree = serve + web + worker + Redis"}
    if not worker["stable"]:
        problems.append(f"worker idle RSS not stable over the last cycles: {worker}")
    if not tree["stable"]:
        problems.append(f"serve tree idle RSS not stable over the last cycles: {tree}")
    return check(FAIL if problems else PASS, ev, "; ".join(problems))


# -- the run ------------------------------------------------------------------------------------------

def _checkpoint(workload: Workload) -> dict:
    """The weights the run used, per family (the workload's and its components'): ``{"path", "sha256",
    "kind"}`` (a directory's digest covers each file's name and SHA-256; no weights: path and digest None)."""
    families = [workload.family] + [c["family"] for c in workload.components]
    out = {}
    for family in families:
        path = specs.resolve_checkpoint(family, None)
        if path is None:
            out[family] = {"path": None, "sha256": None, "note": "no weights"}
            continue
        if path.is_dir():
            digest_ = hashlib.sha256()
            for file in sorted(p for p in path.rglob("*") if p.is_file()):
                digest_.update(str(file.relative_to(path)).encode() + b"\0" + bytes.fromhex(evidence.sha256_file(file)))
            out[family] = {"path": str(path), "sha256": digest_.hexdigest(),
                           "kind": "directory (sha256 over name+sha256 of each file)"}
        else:
            out[family] = {"path": str(path), "sha256": evidence.sha256_file(path), "kind": "file"}
    if workload.family not in out:
        out[workload.family] = {"path": None, "sha256": None, "note": "pipeline: no weights of its own"}
    return out


@dataclass
class Plan:
    """What one ``validate_slots`` run does."""

    family: str
    task: str
    mode: str
    counts: list[int]
    starts: int
    backend: str
    out: Path
    memory_cycles: int


def admission_table_for(plan: Plan, workload: Workload, folder: Path) -> Path:
    """Write the admission table the run's servers read (``AUDIOSITE_ADMISSION_DIR``): the checked-in
    table plus, for the family under test and its pipeline components, every count up to the largest
    under test (clipped to the advertised capacity, which the server still enforces). Returns the folder."""
    base = specs.ADMISSION_DIR / f"{plan.backend}.json"
    table = json.loads(base.read_text()) if base.exists() else {}
    top = max(plan.counts)
    table["_about"] = "written by validate_slots for its own servers: admits the counts under validation"
    for family, task, mode in [(workload.family, plan.task, plan.mode),
                               *[(c["family"], c["task"], "offline") for c in workload.components]]:
        cap = specs.advertised_capacity(family, plan.backend)
        table.setdefault(family, {})[f"{task}/{mode}"] = list(range(1, min(top, cap) + 1))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{plan.backend}.json").write_text(json.dumps(table, indent=1))
    return folder


def framework_root(plan: Plan) -> Path:
    """Where the F1–F6 of a model record come from: the run's own evidence root when it holds a
    framework record for the backend, else the committed records (``model_specs/evidence``)."""
    if plan.out.exists() and evidence.latest_framework(plan.out, plan.backend) is not None:
        return plan.out
    return evidence.EVIDENCE_DIR


ExtraRecovery = Callable[[Run, Client, int], Awaitable[tuple[dict, list[str]]]]
"""More M4 checks of a mode: ``await extra(run, client, n)`` → ``(evidence entries, problems)``."""


@dataclass(frozen=True)
class ModeChecks:
    """What differs between the modes of a run: the client that sends a workload item (``ask``), M1, more
    M4 checks, and M6 (``m6(plan, spec, record)``, called once every count ran). :data:`OFFLINE` is the
    offline procedure; ``gate/streaming.py`` gives the streaming one."""

    client: type[Client]
    m1: Callable[[Run, Path, Path], dict]
    m6: Callable[[Plan, dict, dict], dict]
    m4_extra: ExtraRecovery | None = None
    slots_at: Callable[[int, int], int] = lambda count, capacity: count
    """The slots the model gets at ``count`` (given the family's advertised capacity): the count itself,
    except for a batch run, where the count is the batch size (``gate/batching.py``)."""
    registration_extra: Callable[[int], dict] = lambda count: {}
    """Keys added to the model's registration at ``count`` (a batch run's ``max_batch``)."""


def run_admits_only_its_mode(plan: Plan, spec: dict, record: dict | None = None) -> dict:
    """M6: a run admits only the mode it ran (offline evidence admits offline only); modes the family does
    not serve (``spec["modes"]``) are NOT_APPLICABLE. UNSUPPORTED for a non-offline run (only offline
    workloads are built)."""
    served = spec.get("modes", [])
    modes = {m: (f"validated by this run; admits {m} only" if m == plan.mode else
                 f"NOT_APPLICABLE: the family does not serve mode {m} (model_specs/{plan.family}.json modes {served})"
                 if m not in served else f"not validated by this run (run --mode {m})")
             for m in ("offline", "streaming", "batch")}
    if plan.mode != "offline":
        return check(UNSUPPORTED, modes, f"mode {plan.mode}: validate_slots runs offline workloads only (concurrent "
                                         "streams with disconnect/reset and concurrent batches are not built)")
    return check(PASS, modes, "offline evidence admits offline only")


OFFLINE = ModeChecks(Client, serial_answers_repeat_and_match_across_runtimes, run_admits_only_its_mode)


def run_model_validation(plan: Plan, workload: Workload, print_line=print,
                         checks: ModeChecks = OFFLINE) -> tuple[Path, dict]:
    """Run M1–M6 for ``plan`` (with the mode's ``checks``) and write one evidence record; returns (record
    path, record).

    Raises:
        CommandError (from :class:`Server`): a server did not start.
    """
    spec = specs.require_spec(plan.family)
    rid = evidence.run_id(plan.family, plan.task, plan.mode, plan.backend)
    started_iso, t0 = evidence.now_iso(), time.monotonic()
    skeleton = {"kind": "model", "run_id": rid, "manifest": {"backend": plan.backend, "family": plan.family,
                                                              "task": plan.task, "mode": plan.mode}}
    run_dir = evidence.record_dir(plan.out, skeleton)
    run_dir.mkdir(parents=True, exist_ok=True)
    run = Run(workload, run_dir, plan.backend)
    manifest = evidence.manifest(
        plan.backend, family=plan.family, task=plan.task, mode=plan.mode, counts=plan.counts, starts=plan.starts,
        memory_cycles=plan.memory_cycles, checkpoint=_checkpoint(workload),
        registration=workload.registration(MODEL_ID, None), components=list(workload.components),
        workload=[{"name": i.name, "input": i.source, "options": i.options} for i in workload.items],
        fixtures=fixtures_manifest(workload), comparison_rule=workload.rule(),
        server_config={"lazy_load": True, "lease_ttl_ms": 5000, "threads": "server default (1 per session)",
                       "backend": plan.backend},
        procedure={"serial_repeats": SERIAL_REPEATS, "warm_waves": WARM_WAVES, "mixed_waves": MIXED_WAVES,
                   "mixed_waves_largest_count": MIXED_WAVES_LARGEST, "m4_m5_on": "the first start of each count",
                   "memory_rule": stabilisation([0.0] * MEMORY_WINDOW)["rule"]})
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    record: dict = {"procedure_version": evidence.PROCEDURE_VERSION, "kind": "model", "run_id": rid,
                    "started_at": started_iso, "manifest": manifest,
                    "framework_checks": evidence.framework_checks_for(framework_root(plan), plan.backend),
                    "model_checks": {}, "counts": {}, "performance": {}}
    with tempfile.TemporaryDirectory(prefix="validate-") as tmp:
        work = Path(tmp)
        admission = admission_table_for(plan, workload, work / "admission")
        print_line(f"M1: legacy runtime vs parallel one slot ({len(workload.items)} items x {SERIAL_REPEATS})")
        m1 = checks.m1(run, work, admission)
        record["model_checks"]["M1"] = m1
        print_line(f"  M1 {m1['status']} {m1['limits'][:300]}")
        perf: dict = {}
        capacity = specs.advertised_capacity(plan.family, plan.backend)
        for n in plan.counts:
            per_count: dict = {}
            if n > capacity:
                reason = f"{n} slots exceed the advertised capacity {capacity} of {plan.family} on {plan.backend}"
                probe = _refused_count(plan, workload, work, admission, n)
                for ident in ("M2", "M3", "M4", "M5"):
                    per_count[ident] = check(FAIL, probe, reason)
                record["counts"][str(n)] = {"model_checks": per_count}
                print_line(f"count {n}: FAIL ({reason}; the server answered {probe})")
                continue
            starts_m2, starts_m3 = [], []
            m4 = m5 = None
            perf[str(n)] = {"cold_wave_ms": [], "warm_wave_ms": [], "server_start_s": []}
            # room for slots: the capacity, within the counts the offline row admits (a batch run's slots)
            room = min(capacity, specs.admitted_counts(plan.family, plan.task, "offline", plan.backend))
            slots = checks.slots_at(n, room)
            for s in range(1, plan.starts + 1):
                folder = work / f"count{n}-start{s}"
                folder.mkdir()
                models = [*workload.component_registrations(slots),
                          workload.registration(MODEL_ID, slots, **checks.registration_extra(n))]
                print_line(f"count {n}, start {s}/{plan.starts}")
                server = Server(folder, models, True, {"backend": plan.backend, "ui_management": True},
                                {specs.ADMISSION_DIR_ENV: str(admission)})
                try:
                    server.issue_token("validator")
                    perf[str(n)]["server_start_s"].append(round(server.start_s, 2))

                    async def one_start(server: Server = server, s: int = s, slots: int = slots,
                                        folder: Path = folder, largest: bool = n == max(plan.counts)) -> tuple:
                        client = checks.client(server, workload)
                        try:
                            m2, m3 = await _concurrent_answers_match_serial(run, client, slots, s, largest)
                            got4 = got5 = None
                            if s == 1:
                                got4 = await _serving_recovers_from_failures(run, client, slots, folder,
                                                                             checks.m4_extra)
                                got5 = await _idle_memory_stabilises_over_load_cycles(run, client, slots,
                                                                                      plan.memory_cycles)
                            return m2, m3, got4, got5
                        finally:
                            await client.aclose()
                    m2, m3, got4, got5 = asyncio.run(one_start())
                finally:
                    server.stop()
                starts_m2.append(m2)
                starts_m3.append(m3)
                perf[str(n)]["cold_wave_ms"].append(m2["waves"][0]["wall_ms"])
                perf[str(n)]["warm_wave_ms"] += [w["wall_ms"] for w in m2["waves"][1:-1]]
                if got4 is not None:
                    m4, m5 = got4, got5
                print_line(f"  start {s}: M2 {'ok' if not m2['problems'] else m2['problems'][:3]}; "
                           f"M3 {'ok' if not m3['problems'] else m3['problems'][:3]}; "
                           f"max active {m2['max_active_slots_seen']}"
                           + (f"; M4 {m4['status']}; M5 {m5['status']}" if got4 is not None and m4 and m5 else ""))
            p2 = [p for m in starts_m2 for p in m["problems"]]
            p3 = [p for m in starts_m3 for p in m["problems"]]
            per_count["M2"] = check(FAIL if p2 else PASS, {"starts": starts_m2}, "; ".join(p2))
            per_count["M3"] = check(FAIL if p3 else PASS, {"starts": starts_m3}, "; ".join(p3))
            per_count["M4"] = m4 or check(FAIL, None, "not run")
            per_count["M5"] = m5 or check(FAIL, None, "not run")
            record["counts"][str(n)] = {"model_checks": per_count}
        record["model_checks"]["M6"] = checks.m6(plan, spec, record)
        for ident in ("M2", "M3", "M4", "M5"):
            failing = [n for n, e in record["counts"].items() if e["model_checks"][ident]["status"] != PASS]
            record["model_checks"][ident] = check(
                FAIL if failing else PASS, {"per_count": {n: e["model_checks"][ident]["status"]
                                                          for n, e in record["counts"].items()}},
                f"fails at count(s) {', '.join(failing)}; see counts[n].model_checks" if failing else "")
        record["performance"] = {"per_count": perf, "note": "wave wall times of this run; the performance report "
                                 "is bench_slots --family (separate from admission)"}
    whole_f = record["framework_checks"]
    for entry in record["counts"].values():
        applicable = {**whole_f, "M1": record["model_checks"]["M1"], "M6": record["model_checks"]["M6"],
                      **entry["model_checks"]}
        entry["admission_ready"] = evidence.all_pass(applicable)
        entry["blocked_by"] = sorted(k for k, v in applicable.items() if v["status"] not in (PASS, NOT_APPLICABLE))
    record["admission_ready"] = evidence.all_pass({**whole_f, **record["model_checks"]})
    record["finished_at"] = evidence.now_iso()
    record["duration_s"] = round(time.monotonic() - t0, 1)
    record["raw"] = {"requests_log": "requests.jsonl", "requests_logged": run.log_lines,
                     "mismatching_answers": run.mismatches, "references": "outputs/reference/",
                     "mismatches": "outputs/mismatch/"}
    path = evidence.write(plan.out, record)
    return path, record


def _refused_count(plan: Plan, workload: Workload, work: Path, admission: Path, n: int) -> dict:
    """A count above the advertised capacity: show the server refuses it (registration via the management
    API answers 400 and nothing loads). Returns what the server said."""
    folder = work / f"count{n}-refused"
    folder.mkdir()
    server = Server(folder, workload.component_registrations(1), True, {"backend": plan.backend, "ui_management": True},
                    {specs.ADMISSION_DIR_ENV: str(admission)})
    try:
        server.issue_token("validator")

        async def go() -> dict:
            client = Client(server, workload)
            try:
                resp = await client.manage("/v1/models/load", workload.registration(MODEL_ID, n))
                return {"load_status": resp.status_code,
                        "error": resp.json().get("error") if resp.status_code != 200 else None}
            finally:
                await client.aclose()
        return asyncio.run(go())
    finally:
        server.stop()
