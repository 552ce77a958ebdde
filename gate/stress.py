"""The seeded stress run of F6 (../shared/spec/VALIDATION.md): a random mix of requests and managers
against a real ``manage.py serve --parallel-jobs`` process, with every invariant checked after each step.

The server runs on its own embedded Redis and a temporary SQLite database, with the test-only
``fixture`` family enabled (``AUDIOSITE_ENABLE_FIXTURE_FAMILY=1``) and ``ui_management`` on. Models:
two fixture models (2 and 1 slots at the start) and one real small model (silero_vad, lazily
loaded); registration adds more fixture models and unregistration removes them.

Each step is one of (drawn from ``random.Random(seed)``, so a seed replays the same plan):

- ``requests``: 1–6 concurrent ``POST /v1/tasks/run`` to random models, with and without
  ``busy_timeout_ms`` (none, 0, 100 ms, 5 s), sometimes one invalid request (400 expected);
- ``barrier``: requests A to one model, then once A is admitted or queued a manager (reconfigure
  to a new configuration version, resize to 1–4 slots, unload or an explicit load), then once
  the manager is queued or holds the model, requests B; a fixture answer names its ``pool_id``,
  ``config_version`` and ``slot``, so A must be served by the configuration bound before the
  manager and B by the one after it (CONTRACT R2.3);
- ``unsupported``: a resize to 5 slots (above the admission table): 400, and the count kept;
- ``bulk``: ``POST /v1/tasks/unload_models`` over a random selection plus an unknown id, with
  requests flowing to a random model;
- ``register`` / ``unregister``: a new fixture model, or ``DELETE`` of one (later requests: 404).

Invariants checked (each violation is kept with its step, action and a status snapshot):

- during the step (status polled every 50 ms): ``active_slots <= slots`` of every model;
- every answer is 200 or a documented error (400/404/409/503) in the error shape
  ``{"error": {"message", "type", "param", "code"}}``, a 503 with ``Retry-After``; never a 500;
- the configuration that served each fixture answer is the one bound at its admission (above),
  and its slot index is below the count of that configuration;
- after the step, within 20 s: every model's ``active_slots`` and ``queued_requests`` are 0, and
  Redis holds no request lease, manager lease, ticket or queued manager of any model.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

import httpx
import numpy as np
import soundfile

from .servers import Server
from inference.runtime.context import KEYS

DOCUMENTED = {200, 400, 404, 409, 503}
ERROR_KEYS = {"message", "type", "param", "code"}
ACTIONS = (("requests", 0.34), ("barrier", 0.30), ("bulk", 0.10), ("unsupported", 0.06),
           ("register", 0.10), ("unregister", 0.10))
IDLE_TIMEOUT_S = 20.0
STEP_TIMEOUT_S = 90.0


def _wav(seconds: float, rate_hz: int = 16000) -> bytes:
    """A mono 16-bit WAV of ``seconds`` of a quiet tone (float32 samples in [-0.1, 0.1])."""
    t = np.arange(int(seconds * rate_hz)) / rate_hz
    buffer = io.BytesIO()
    soundfile.write(buffer, (0.1 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate_hz, format="WAV")
    return buffer.getvalue()


def answer_problem(status: int, headers: Any, text: str, expect: set[int] | None = None) -> str | None:
    """What is wrong with one HTTP answer, or None: a status outside ``DOCUMENTED`` (a 500 always is),
    a status outside ``expect``, an error body not in the shape ``{"error": {message, type, param,
    code}}``, or a 503 without ``Retry-After`` (``headers``: any case-insensitive mapping)."""
    if status not in DOCUMENTED:
        return f"status {status}"
    if expect is not None and status not in expect:
        return f"status {status}, expected {sorted(expect)}"
    if status == 200:
        return None
    try:
        payload = json.loads(text)
    except ValueError:
        payload = None
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or set(error) != ERROR_KEYS:
        return f"{status} not in the error shape"
    if status == 503 and "retry-after" not in headers:
        return "503 without Retry-After"
    return None


class Stress:
    """One stress run's state: the server, the client, the models as the run believes them to be."""

    def __init__(self, server: Any, seed: int, out: TextIO):
        self.server = server
        self.rng = random.Random(seed)
        self.out = out
        self.wav = _wav(0.5)
        # model id -> {"family", "slots", "version"}: what the run configured last
        self.models: dict[str, dict] = {"fx-a": {"family": "fixture", "slots": 2, "version": "v0"},
                                        "fx-b": {"family": "fixture", "slots": 1, "version": "v0"},
                                        "vad": {"family": "silero_vad", "slots": 1, "version": None}}
        self.gone: set[str] = set()  # unregistered ids (Redis keys must stay empty too)
        self.violations: list[dict] = []
        self.statuses: Counter = Counter()
        self.requests = self.managers = 0
        self.step = 0
        self.action = ""
        self.serial = 0
        self.plan: list[str] = []  # the action of each step (the same seed gives the same plan)
        self.client = httpx.AsyncClient(base_url=server.url, timeout=STEP_TIMEOUT_S,
                                        headers={"Authorization": f"Token {server.token}"},
                                        limits=httpx.Limits(max_connections=64))

    # -- recording ------------------------------------------------------------------------------------
    def violate(self, what: str, state: Any = None) -> None:
        self.violations.append({"step": self.step, "action": self.action, "what": what, "state": state})
        self.out.write(f"  VIOLATION step {self.step} ({self.action}): {what}\n")

    def answer(self, resp: httpx.Response, expect: set[int] | None = None, what: str = "") -> dict | None:
        """Check one answer (``answer_problem``); returns the JSON body of a 200, else None."""
        self.statuses[resp.status_code] += 1
        problem = answer_problem(resp.status_code, resp.headers, resp.text, expect)
        if problem:
            self.violate(f"{what}: {problem}", resp.text[:500])
        if resp.status_code != 200:
            return None
        try:
            payload = resp.json()
        except ValueError:
            return {}
        return payload if isinstance(payload, dict) else {}

    # -- traffic --------------------------------------------------------------------------------------
    def _request_body(self, model_id: str, timeout_ms: int | None, invalid: bool = False) -> dict:
        self.serial += 1
        family = self.models.get(model_id, {}).get("family", "fixture")
        options: dict[str, Any] = {}
        if family == "fixture":
            options = {"tag": f"s{self.step}-{self.serial}", "sleep_ms": self.rng.choice([0, 20, 100, 250])}
        if invalid:
            options["no_such_option"] = 1
        body: dict[str, Any] = {"model": model_id,
                                "request": {"audio_base64": base64.b64encode(self.wav).decode(), "options": options}}
        if timeout_ms is not None:
            body["busy_timeout_ms"] = timeout_ms
        return body

    async def request(self, model_id: str, timeout_ms: int | None = None, invalid: bool = False,
                      expect: set[int] | None = None) -> dict | None:
        self.requests += 1
        resp = await self.client.post("/v1/tasks/run", json=self._request_body(model_id, timeout_ms, invalid))
        return self.answer(resp, {400} if invalid else expect, f"request to {model_id}")

    async def manage(self, method: str, path: str, body: dict | None = None,
                     expect: set[int] | None = None) -> dict | None:
        self.managers += 1
        resp = await self.client.request(method, path, json=body)
        return self.answer(resp, expect, f"{method} {path} {json.dumps(body)[:120] if body else ''}")

    def _load_body(self, model_id: str) -> dict:
        model = self.models[model_id]
        body: dict[str, Any] = {"id": model_id, "family": model["family"], "slots": model["slots"]}
        if model["family"] == "fixture":
            body["load_options"] = {"version": model["version"]}
        return body

    def _timeout(self) -> int | None:
        return self.rng.choice([None, None, 0, 100, 5000])

    # -- observation ----------------------------------------------------------------------------------
    async def entries(self) -> dict[str, dict]:
        resp = await self.client.get("/v1/models")
        if resp.status_code != 200:
            self.violate(f"status API answered {resp.status_code}", resp.text[:300])
            return {}
        return {e["id"]: e for e in resp.json()["data"]}

    async def monitor(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            for model_id, entry in (await self.entries()).items():
                if entry.get("slots") is not None and entry["active_slots"] > entry["slots"]:
                    self.violate(f"{model_id}: busy {entry['active_slots']} > slots {entry['slots']}", entry)
            try:
                await asyncio.wait_for(stop.wait(), 0.05)
            except TimeoutError:
                pass

    def redis_state(self, model_id: str) -> dict:
        r = self.server.redis
        return {"leases": r.hlen(KEYS.leases(model_id)), "manager_leases": r.hlen(KEYS.manager_leases(model_id)),
                "tickets": r.zcard(KEYS.queue(model_id)), "queued_managers": r.hlen(KEYS.queued_managers(model_id))}

    async def check_idle(self) -> None:
        """At rest, nothing is held: every model's counters and its Redis leases, tickets and queued managers
        drain to 0 within ``IDLE_TIMEOUT_S``, the models listed are the ones registered, each at its
        configured slots. Each difference is recorded with :meth:`violate`."""
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            entries = await self.entries()
            busy = {i: (e["active_slots"], e["queued_requests"]) for i, e in entries.items()
                    if e["active_slots"] or e["queued_requests"]}
            held = {i: s for i in sorted(set(self.models) | self.gone) if any((s := self.redis_state(i)).values())}
            if not busy and not held:
                break
            if time.monotonic() > deadline:
                self.violate("counters did not drain to zero", {"status": busy, "redis": held})
                return
            await asyncio.sleep(0.05)
        listed = set(entries)
        if listed != set(self.models):
            self.violate(f"models listed {sorted(listed)} but registered {sorted(self.models)}")
        for model_id, entry in entries.items():
            want = self.models.get(model_id)
            if want and entry.get("slots") != want["slots"]:
                self.violate(f"{model_id}: slots {entry.get('slots')} but configured {want['slots']}", entry)

    async def until_admitted(self, model_id: str, tasks: list[asyncio.Task], timeout_s: float = 10) -> None:
        """Until every task of ``tasks`` is done, holds a lease or is queued on ``model_id``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            entry = (await self.entries()).get(model_id, {})
            seen = entry.get("active_slots", 0) + entry.get("queued_requests", 0)
            if seen + sum(t.done() for t in tasks) >= len(tasks):
                return
            await asyncio.sleep(0.01)

    async def until_manager_queued(self, model_id: str, task: asyncio.Task, timeout_s: float = 10) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not task.done():
            state = self.redis_state(model_id)
            if state["queued_managers"] or state["manager_leases"]:
                return
            await asyncio.sleep(0.005)

    # -- steps ----------------------------------------------------------------------------------------
    def pick(self) -> str:
        roll, total = self.rng.random(), 0.0
        for name, weight in ACTIONS:
            total += weight
            if roll < total:
                return name
        return ACTIONS[-1][0]

    async def do_requests(self) -> None:
        calls = []
        for _ in range(self.rng.randint(1, 6)):
            model_id = self.rng.choice(sorted(self.models))
            calls.append(self.request(model_id, self._timeout(), invalid=self.rng.random() < 0.1))
        await asyncio.gather(*calls)

    async def do_barrier(self) -> None:
        model_id = self.rng.choice(sorted(self.models))
        model = self.models[model_id]
        kind = self.rng.choice(["reconfigure", "resize", "unload", "load"] if model["family"] == "fixture"
                               else ["resize", "unload", "load"])
        self.action = f"barrier {kind} {model_id}"
        before = dict(model)
        first = [asyncio.create_task(self.request(model_id)) for _ in range(self.rng.randint(1, 4))]
        await self.until_admitted(model_id, first)
        if kind == "reconfigure":
            model["version"] = f"v{self.step}"
            model["slots"] = self.rng.randint(1, 4)
        elif kind == "resize":
            model["slots"] = self.rng.choice([n for n in (1, 2, 3, 4) if n != model["slots"]])
        if kind == "unload":
            manager = asyncio.create_task(self.manage("POST", "/v1/models/unload", {"id": model_id}, {200}))
        else:
            manager = asyncio.create_task(self.manage("POST", "/v1/models/load", self._load_body(model_id), {200}))
        await self.until_manager_queued(model_id, manager)
        later = [asyncio.create_task(self.request(model_id, self._timeout())) for _ in range(self.rng.randint(1, 4))]
        old = [a for a in await asyncio.gather(*first) if a is not None]
        await manager
        new = [a for a in await asyncio.gather(*later) if a is not None]
        if model["family"] != "fixture":
            return
        old_pools = {str(a.get("pool_id")) for a in old}
        for a in old:
            if a.get("config_version") != before["version"] or a.get("slot", 0) >= before["slots"]:
                self.violate(f"{model_id}: a request admitted before the manager was served by version "
                             f"{a.get('config_version')} slot {a.get('slot')} (bound: {before['version']}, "
                             f"{before['slots']} slots)", a)
        if len(old_pools) > 1:
            self.violate(f"{model_id}: requests admitted before the manager saw pools {sorted(old_pools)}")
        for a in new:
            if a.get("config_version") != model["version"] or a.get("slot", 0) >= model["slots"]:
                self.violate(f"{model_id}: a request admitted after the manager was served by version "
                             f"{a.get('config_version')} slot {a.get('slot')} (bound: {model['version']}, "
                             f"{model['slots']} slots)", a)
            if kind != "load" and str(a.get("pool_id")) in old_pools:
                self.violate(f"{model_id}: a request after the {kind} was served by the old pool {a.get('pool_id')}", a)

    async def do_unsupported(self) -> None:
        model_id = self.rng.choice(sorted(self.models))
        self.action = f"unsupported resize {model_id}"
        body = {**self._load_body(model_id), "slots": 5}
        await self.manage("POST", "/v1/models/load", body, {400})
        entry = (await self.entries()).get(model_id, {})
        if entry.get("slots") != self.models[model_id]["slots"]:
            self.violate(f"{model_id}: a refused resize changed the count to {entry.get('slots')}", entry)

    async def do_bulk(self) -> None:
        ids = sorted(self.models)
        chosen = self.rng.sample(ids, self.rng.randint(1, len(ids)))
        if self.rng.random() < 0.5:
            chosen = chosen + chosen[:1]  # a duplicate in the selection
        self.action = f"bulk unload {chosen}"
        traffic_to = self.rng.choice(ids)
        traffic = [asyncio.create_task(self.request(traffic_to, self._timeout()))
                   for _ in range(self.rng.randint(1, 4))]
        result = await self.manage("POST", "/v1/tasks/unload_models", {"model_ids": [*chosen, "no-such-model"]}, {200})
        await asyncio.gather(*traffic)
        if result is not None and "no-such-model" not in result.get("not_found", []):
            self.violate("bulk unload did not report the unknown id as not_found", result)

    async def do_register(self) -> None:
        model_id = f"fx-r{self.step}"
        self.action = f"register {model_id}"
        self.models[model_id] = {"family": "fixture", "slots": self.rng.randint(1, 4), "version": f"r{self.step}"}
        body = {**self._load_body(model_id), "lazy": self.rng.random() < 0.5}
        traffic = [asyncio.create_task(self.request(model_id, self._timeout(), expect={200, 404, 503}))
                   for _ in range(self.rng.randint(0, 2))]
        await self.manage("POST", "/v1/models/load", body, {200})
        await asyncio.gather(*traffic)
        answer = await self.request(model_id, 0, expect={200})
        if answer is not None and answer.get("config_version") != self.models[model_id]["version"]:
            self.violate(f"{model_id}: served by version {answer.get('config_version')}", answer)

    async def do_unregister(self) -> None:
        dynamic = sorted(m for m in self.models if m.startswith("fx-r"))
        if not dynamic:
            return await self.do_register()
        model_id = self.rng.choice(dynamic)
        self.action = f"unregister {model_id}"
        before = [asyncio.create_task(self.request(model_id)) for _ in range(self.rng.randint(0, 2))]
        await self.until_admitted(model_id, before)
        await self.manage("DELETE", f"/v1/models/{model_id}", None, {200})
        del self.models[model_id]
        self.gone.add(model_id)
        await asyncio.gather(*before)
        await self.request(model_id, expect={404})
        return None

    async def run(self, steps: int) -> None:
        handlers = {"requests": self.do_requests, "barrier": self.do_barrier, "bulk": self.do_bulk,
                    "unsupported": self.do_unsupported, "register": self.do_register,
                    "unregister": self.do_unregister}
        try:
            for self.step in range(steps):
                name = self.pick()
                self.action = name
                stop = asyncio.Event()
                watcher = asyncio.create_task(self.monitor(stop))
                began = time.monotonic()
                try:
                    await asyncio.wait_for(handlers[name](), STEP_TIMEOUT_S)
                except TimeoutError:
                    self.violate(f"the step did not finish within {STEP_TIMEOUT_S} s")
                except httpx.HTTPError as exc:
                    self.violate(f"transport error: {exc!r}")
                finally:
                    stop.set()
                    await watcher
                self.plan.append(self.action)
                await self.check_idle()
                self.out.write(f"step {self.step:3d} {self.action:<40} {time.monotonic() - began:5.2f} s "
                               f"violations {len(self.violations)}\n")
                self.out.flush()
        finally:
            await self.client.aclose()


def run_stress(seed: int, steps: int, stdout: TextIO | None = None, workdir: Path | None = None) -> dict:
    """Start a real parallel server, run ``steps`` seeded steps against it, stop it; return the report.

    Returns:
        ``{"seed", "steps", "requests", "managers", "statuses" (HTTP status -> count),
        "violations" ([{"step", "action", "what", "state"}]), "plan" (action per step),
        "duration_s", "server_log_tail" (only with violations)}``,
        also written to ``<workdir>/stress.json`` when ``workdir`` is given.

    Raises:
        django.core.management.base.CommandError: the server did not start.
    """
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would bury the steps
    stdout = stdout or sys.stdout
    stdout.write(f"stress run: seed {seed}, {steps} steps\n")
    stdout.flush()
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="audiosite-stress-") as tmp:
        models = [{"id": "fx-a", "family": "fixture", "slots": 2, "load_options": {"version": "v0"}},
                  {"id": "fx-b", "family": "fixture", "slots": 1, "load_options": {"version": "v0"}},
                  {"id": "vad", "family": "silero_vad", "slots": 1, "lazy": True}]
        server = Server(Path(tmp), models, parallel=True, extra_config={"ui_management": True})
        try:
            server.token = server.issue_token("stress")
            stress = Stress(server, seed, stdout)
            asyncio.run(stress.run(steps))
        finally:
            server.stop()
            log_tail = server.log.read_text(errors="replace")[-4000:]
    report = {"seed": seed, "steps": steps, "requests": stress.requests, "managers": stress.managers,
              "statuses": {str(k): v for k, v in sorted(stress.statuses.items())},
              "violations": stress.violations, "plan": stress.plan, "duration_s": round(time.monotonic() - began, 1),
              "server_log_tail": log_tail if stress.violations else ""}
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "stress.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    stdout.write(f"stress run: seed {seed}, {steps} steps, {stress.requests} requests, {stress.managers} "
                 f"managers, {len(stress.violations)} violation(s), {report['duration_s']} s\n")
    return report
