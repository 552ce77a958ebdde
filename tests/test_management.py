"""Management routes end to end (CONTRACT R4, R5, R1.2/R1.4 for dynamic registration):
register, reconfigure, unload, unregister and bulk unload over HTTP, on a
``serve --parallel-jobs --ui-management`` stack (Redis db 12) and a legacy
``--ui-management`` stack (Redis db 11), with the fixture family's barriers.
Real PostgreSQL, Redis and Celery worker.
"""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time

import httpx
import pytest

from inference.runtime.context import KEYS

from .support.bounds import MODEL_S, run, until
from .support.clients import body, mclient, post
from .support.stacks import FIXTURE_ENV, entry_of, events_of, fx, run_stack

pytestmark = pytest.mark.stack

M_MODELS = [
    {"id": "fx-base", "family": "fixture", "slots": 2, "load_options": {"version": "v1"}},
    {"id": "whisper-lazy", "family": "whisper", "slots": 2, "lazy": True},
]


@pytest.fixture(scope="module")
def mstack(tmp_path_factory):
    yield from run_stack(tmp_path_factory.mktemp("mstack"), M_MODELS, redis_db=12, name="mgmt", parallel=True,
                         extra_env=FIXTURE_ENV, extra_config={"ui_management": True})


@pytest.fixture(scope="module")
def token(mstack) -> str:
    done = mstack.manage("issue_token", "operator")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


# -- the gate ----------------------------------------------------------------------------------
def test_gate_needs_credentials_and_the_permission(mstack, token):
    """API.md gate: no/invalid credentials → 401; a user without registry.manage_models → 403;
    a permitted token passes; unknown ids → 404 on unload and DELETE; status stays open."""
    shell = mstack.manage("shell", "--no-imports", "-c", (
        "from django.contrib.auth.models import User; from registry.records import api_token_issue;"
        "u, _ = User.objects.get_or_create(username='viewer'); print(api_token_issue(u))"))
    assert shell.returncode == 0, shell.stderr
    viewer = shell.stdout.strip().splitlines()[-1]

    async def scenario():
        async with mclient(mstack, None) as anon, mclient(mstack, "0" * 40) as bad, \
                mclient(mstack, viewer) as view, mclient(mstack, token) as op:
            for c, status, err in ((anon, 401, "authentication_error"), (bad, 401, "authentication_error"),
                                   (view, 403, "forbidden")):
                for method, url, payload in (("POST", "/v1/models/load", fx("gate-x")),
                                             ("POST", "/v1/models/unload", {"id": "fx-base"}),
                                             ("POST", "/v1/tasks/unload_models", {"model_ids": ["fx-base"]}),
                                             ("POST", "/v1/tasks/unload_all_models", None),
                                             ("DELETE", "/v1/models/fx-base", None)):
                    resp = await c.request(method, url, json=payload)
                    assert resp.status_code == status, (method, url, resp.text)
                    assert resp.json()["error"]["type"] == err
            assert (await anon.get("/v1/models/fx-base")).status_code == 200  # status reads stay open
            resp = await op.post("/v1/models/unload", json={"id": "nope"})
            assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found"
            resp = await op.delete("/v1/models/nope")
            assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found"
            health = (await anon.get("/health")).json()
            assert health["ui_management"] is True
    run(scenario())
    assert entry_of(mstack, "fx-base")["state"] == "ready"  # nothing happened to it
    assert mstack.sql("SELECT count(*) FROM registry_modelregistration WHERE model_id = 'gate-x'") == [(0,)]


@pytest.mark.parametrize("payload, param", [
    ({"family": "fixture"}, "id"),
    ({"id": "bad id!", "family": "fixture"}, "id"),
    ({"id": "b1", "family": "nope"}, "family"),
    ({"id": "b2", "family": "fixture", "load_options": {"colour": 1}}, "load_options"),
    ({"id": "b3", "family": "fixture", "slots": 0}, "slots"),
    ({"id": "b4", "family": "fixture", "slots": "2"}, "slots"),
    ({"id": "b5", "family": "fixture", "slots": None}, "slots"),
    ({"id": "b6", "family": "fixture", "slots": True}, "slots"),
    ({"id": "b7", "family": "fixture", "slots": 1.5}, "slots"),
    ({"id": "b8", "family": "fixture", "slots": 17}, "slots"),
    ({"id": "b9", "family": "silero_vad", "path": "/nonexistent/model.onnx"}, "path"),
    ({"id": "b10", "family": "fixture", "flavour": "x"}, "flavour"),
    ({"id": "b11", "family": "fixture", "busy_timeout_ms": -1}, "busy_timeout_ms"),
    ({"id": "b12", "family": "fixture", "busy_timeout_ms": 2 ** 63}, "busy_timeout_ms"),
    ({"id": "b13", "family": "fixture", "load_options": {"version": "a\u0000b"}}, "load_options"),
    ({"id": "b14", "family": "silero_vad", "path": "/"}, "path"),
    ({"id": "b15", "family": "whisper", "path": "/etc/hostname"}, "path"),
    ({"id": "b16", "family": "silero_vad", "path": "/work/" + "./" * 520 + "x"}, "path"),
])
def test_invalid_registrations_are_refused_and_register_nothing(mstack, token, payload, param):
    """R1.3/R4.6/R7.1: a bad body → 400 naming the key; nothing is registered."""
    async def scenario():
        async with mclient(mstack, token) as op:
            return await op.post("/v1/models/load", json=payload)
    resp = run(scenario())
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if isinstance(payload.get("id"), str):
        assert entry_of(mstack, payload["id"])["error"]["type"] == "not_found"


def test_gate_off_refuses_everyone(stack):
    """API.md: with ui_management off every management route answers 403, even for a permitted token,
    and before any credential is looked up: a bad or malformed token is a 403 too, not a 401."""
    done = stack.manage("issue_token", "operator")
    assert done.returncode == 0, done.stderr
    key = done.stdout.strip()

    async def scenario():
        async with mclient(stack, key) as op, mclient(stack, None) as anon, mclient(stack, "0" * 40) as bad, \
                mclient(stack, None, headers={"Authorization": "Token"}) as malformed:
            for c in (op, anon, bad, malformed):
                resp = await c.post("/v1/models/unload", json={"id": "vad"})
                assert resp.status_code == 403 and resp.json()["error"]["type"] == "forbidden"
                assert "--ui-management" in resp.json()["error"]["message"]
                resp = await c.delete("/v1/models/vad")
                assert resp.status_code == 403
                resp = await c.post("/v1/tasks/unload_all_models")
                assert resp.status_code == 403
    run(scenario())
    assert entry_of(stack, "vad")["state"] == "ready"


def test_path_is_shown_only_to_callers_passing_the_management_gate(mstack, token, stack):
    """``/v1/models`` shows no model's filesystem path to anyone. ``path`` is in an entry
    only for a caller passing the management gate; with management off, for nobody."""
    shell = mstack.manage("shell", "--no-imports", "-c", (
        "from django.contrib.auth.models import User; from registry.records import api_token_issue;"
        "u, _ = User.objects.get_or_create(username='reader'); print(api_token_issue(u))"))
    assert shell.returncode == 0, shell.stderr
    reader = shell.stdout.strip().splitlines()[-1]
    off_key = stack.manage("issue_token", "operator").stdout.strip()

    async def entries(target, key) -> list[dict]:
        async with mclient(target, key) as c:
            listed, one = await c.get("/v1/models"), await c.get("/v1/models/fx-base" if target is mstack
                                                                 else "/v1/models/vad")
            assert listed.status_code == 200 and one.status_code == 200, (listed.text, one.text)
            return [*listed.json()["data"], one.json()]

    async def scenario():
        for entry in await entries(mstack, token):
            assert "path" in entry, entry
        for key in (None, reader):
            for entry in await entries(mstack, key):
                assert "path" not in entry, entry
        for entry in await entries(stack, off_key):  # management off: nobody, whatever the token
            assert "path" not in entry, entry
        async with mclient(mstack, "0" * 40) as bad:  # invalid credentials on an open route: DRF's 401
            resp = await bad.get("/v1/models")
            assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    run(scenario())


def test_huge_integer_literals_and_too_many_query_parameters_in_management_requests(mstack, token):
    """A JSON integer of more than 4300 digits was an anonymous 400 (or a 500 elsewhere); now it
    names its key; too many query parameters were a 500."""
    huge = "9" * 5000

    async def scenario():
        async with mclient(mstack, token) as op:
            bodies = {"slots": ("/v1/models/load", '{"id": "huge", "family": "fixture", "slots": HUGE}'),
                      "busy_timeout_ms": ("/v1/models/load",
                                          '{"id": "huge", "family": "fixture", "busy_timeout_ms": -HUGE}'),
                      "load_options.version": ("/v1/models/load", '{"id": "huge", "family": "fixture", '
                                                                  '"load_options": {"version": HUGE}}'),
                      "id": ("/v1/models/unload", '{"id": HUGE}'),
                      "model_ids": ("/v1/tasks/unload_models", '{"model_ids": ["fx-base", HUGE]}')}
            answers = {param: await op.post(url, headers={"content-type": "application/json"},
                                            content=text.replace("HUGE", huge))
                       for param, (url, text) in bodies.items()}
            many = "&".join(f"q{i}=1" for i in range(1100))
            query = await op.post(f"/v1/models/unload?{many}", json={"id": "fx-base"})
        return answers, query
    answers, query = run(scenario())
    for param, resp in answers.items():
        assert resp.status_code == 400, (param, resp.text)
        assert resp.json()["error"] == {"message": f"{param} is an integer of 5000 digits, far out of range",
                                        "type": "invalid_request_error", "param": param, "code": None}
    assert query.status_code == 400 and query.json()["error"]["type"] == "invalid_request_error", query.text
    assert entry_of(mstack, "huge")["error"]["type"] == "not_found"
    assert entry_of(mstack, "fx-base")["state"] == "ready"


async def chunks(data: bytes):
    """A request body without Content-Length (httpx sends it chunked)."""
    yield data


def test_management_bodies_are_strict(mstack, token):
    """API.md errors: unknown keys → 400, form bodies → 415, non-JSON or absurdly nested bodies → 400,
    oversize → 413; none of them changes anything (a 2xx for a bad body would be a bug)."""
    async def scenario():
        async with mclient(mstack, token) as op:
            cases = [
                (op.post("/v1/models/unload", json={"id": "fx-base", "force": True}), 400),
                (op.post("/v1/tasks/unload_models", json={"model_ids": [], "all": True}), 400),
                (op.post("/v1/tasks/unload_all_models", content=b"this is { not json",
                         headers={"Content-Type": "application/json"}), 400),
                (op.post("/v1/tasks/unload_all_models", json={"everything": True}), 400),
                (op.post("/v1/tasks/unload_models", data={"model_ids": ["fx-base"]}), 415),
                (op.post("/v1/models/load", content=b'{"id":"deep","load_options":' + b"[" * 100000 + b"]" * 100000
                         + b"}", headers={"Content-Type": "application/json"}), 400),
                (op.post("/v1/models/unload", content=b'{"id":' + b"[" * 100000 + b"]" * 100000 + b"}",
                         headers={"Content-Type": "application/json"}), 400),
                (op.post("/v1/models/unload", content=b'{"id": "fx-base", "pad": "' + b"x" * 3_100_000 + b'"}',
                         headers={"Content-Type": "application/json"}), 413),
                (op.post("/v1/models/load", content=b'{"id": "x", "family": "fixture", "\\ud800": 1}',
                         headers={"Content-Type": "application/json"}), 400),
                (op.post("/v1/models/unload", content=b'{"id": "\\ud800"}',
                         headers={"Content-Type": "application/json"}), 400),
                (op.post("/v1/tasks/unload_models", content=b'{"model_ids": ["fx-base", "\\udfff"]}',
                         headers={"Content-Type": "application/json"}), 400),
                (op.post("/v1/tasks/unload_all_models", content=chunks(b"this is { not json"),
                         headers={"Content-Type": "application/json"}), 411),
            ]
            for request, status in cases:
                resp = await request
                assert resp.status_code == status, (status, resp.status_code, resp.text[:300])
                assert resp.json()["error"]["type"] == "invalid_request_error"
    run(scenario())
    assert entry_of(mstack, "fx-base")["state"] == "ready"


# -- registration (R4.6) --------------------------------------------------------------------------
def test_registration_is_visible_while_its_first_load_runs_and_duplicates_queue(mstack, token):
    """R4.6: the new entry is published before its load (state loading); a second registration of
    the same id queues on the entry and then finds it registered (reconfigured: false)."""
    async def scenario():
        async with mclient(mstack, token) as op:
            first = asyncio.create_task(op.post("/v1/models/load", json=fx("reg1", 2, load_barrier="reg1-load",
                                                                               version="r1")))
            await until(lambda: mstack.arrived("reg1-load") == 1)
            entry = entry_of(mstack, "reg1")
            assert (entry["state"], entry["loaded"], entry["slots"]) == ("loading", False, 2)
            second = asyncio.create_task(op.post("/v1/models/load", json=fx("reg1", 2, load_barrier="reg1-load",
                                                                                version="r1")))
            await until(lambda: mstack.managers("reg1")["queued"] == 1)
            request = asyncio.create_task(post(op, "reg1", tag="after"))
            await until(lambda: mstack.counters("reg1")["queued"] == 1)
            assert not first.done() and not second.done()
            mstack.release("reg1-load")
            r1, r2 = await first, await second
            assert r1.status_code == 200 and r1.json() == {"id": "reg1", "loaded": True, "reconfigured": False}
            assert r2.status_code == 200 and r2.json() == {"id": "reg1", "loaded": True, "reconfigured": False}
            resp, _, _ = await request
            assert resp.status_code == 200 and resp.json()["config_version"] == "r1"
    run(scenario())
    assert mstack.arrived("reg1-load") == 1  # loaded once
    assert mstack.sql("SELECT source, state FROM registry_modelregistration WHERE model_id = 'reg1'") == \
        [("api", "ready")]
    assert [e[0] for e in events_of(mstack, "reg1")] == ["register", "load"]
    assert events_of(mstack, "reg1")[0][2] == "operator"


def test_failed_first_load_leaves_the_entry_registered_and_unloaded(mstack, token):
    """R4.6/R4.2: a failed first load → 503 load_failed; the entry stays registered and unloaded;
    a later reconfiguration (or request) retries."""
    async def scenario():
        async with mclient(mstack, token) as op:
            resp = await op.post("/v1/models/load", json=fx("reg-fail", 1, fail_load=True))
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "load_failed"
            entry = entry_of(mstack, "reg-fail")
            assert (entry["state"], entry["loaded"]) == ("failed", False)  # R6.7
            assert entry["last_error"] and entry["retry_at"]
            resp = await op.post("/v1/models/load", json=fx("reg-fail", 1, version="fixed"))
            assert resp.status_code == 200 and resp.json() == {"id": "reg-fail", "loaded": True, "reconfigured": True}
            resp, _, _ = await post(op, "reg-fail")
            assert resp.json()["config_version"] == "fixed"
    run(scenario())
    row = mstack.sql("SELECT state, last_error FROM registry_modelregistration WHERE model_id = 'reg-fail'")
    assert row == [("ready", "")]
    assert ("load", "failed") in [(e[0], e[1]) for e in events_of(mstack, "reg-fail")]


def test_unsupported_count_on_a_new_registration_registers_it_unloaded(mstack, token):
    """R4.6/R9: a count above the capacity on a *new* id → 400 with capacity=, registered and unloaded;
    a valid resize afterwards works."""
    async def scenario():
        async with mclient(mstack, token) as op:
            resp = await op.post("/v1/models/load", json={"id": "w5", "family": "whisper", "slots": 5})
            assert resp.status_code == 400 and "capacity=4" in resp.json()["error"]["message"]
            entry = entry_of(mstack, "w5")
            assert (entry["state"], entry["slots"]) == ("unloaded", 5)
            resp = await op.post("/v1/models/load", json={"id": "w5", "family": "whisper", "slots": 1, "lazy": True})
            assert resp.status_code == 200 and resp.json() == {"id": "w5", "loaded": False, "reconfigured": True}
            assert entry_of(mstack, "w5")["slots"] == 1
            # A count inside the capacity but outside the admission table (fixture: 1..4 on cpu) is
            # registered unloaded too, and never served at that count (R9.2).
            resp = await op.post("/v1/models/load", json=fx("fx8", 8))
            assert resp.status_code == 400 and "admitted counts are 1..4" in resp.json()["error"]["message"]
            served, _, _ = await post(op, "fx8")
            assert served.status_code == 503 and served.json()["error"]["code"] == "load_failed"
            assert entry_of(mstack, "fx8")["state"] == "failed"  # R6.7
    run(scenario())


# -- reconfiguration (R4.4) ----------------------------------------------------------------------
@pytest.mark.parametrize("n, new_n", [(1, 2), (2, 4), (4, 1)])
def test_older_requests_drain_before_reconfigure_and_later_ones_bind_the_new_configuration(mstack, token, n, new_n):
    """R4.4/R2.2/R2.3 at counts 1, 2, 4: n running requests and one queued bind v1; the
    reconfiguration waits for them (a barrier, spare slots unused); requests after it bind v2 on
    the new pool with the new count."""
    model = f"rc{n}"

    async def scenario():
        async with mclient(mstack, token) as op:
            assert (await op.post("/v1/models/load", json=fx(model, n, version="v1"))).status_code == 200
            running = [asyncio.create_task(post(op, model, barrier=f"{model}-run")) for _ in range(n)]
            await until(lambda: mstack.arrived(f"{model}-run") == n)
            queued = asyncio.create_task(post(op, model, tag="older"))
            await until(lambda: mstack.counters(model)["queued"] == 1)
            manager = asyncio.create_task(op.post("/v1/models/load", json=fx(model, new_n, version="v2")))
            await until(lambda: mstack.managers(model)["queued"] == 1)
            later = [asyncio.create_task(post(op, model, tag=f"later{i}")) for i in range(3)]
            await until(lambda: mstack.counters(model)["queued"] == 4)
            await asyncio.sleep(0.3)
            assert not manager.done() and entry_of(mstack, model)["state"] == "ready"
            mstack.release(f"{model}-run", n)
            old = [(await t)[0].json() for t in running] + [(await queued)[0].json()]
            resp = await manager
            assert resp.status_code == 200 and resp.json() == {"id": model, "loaded": True, "reconfigured": True}
            new = [(await t)[0].json() for t in later]
            assert {r["config_version"] for r in old} == {"v1"} and len({r["pool_id"] for r in old}) == 1
            assert {r["config_version"] for r in new} == {"v2"} and len({r["pool_id"] for r in new}) == 1
            assert new[0]["pool_id"] != old[0]["pool_id"]
            assert all(r["slot"] < new_n for r in new)
            entry = entry_of(mstack, model)
            assert (entry["slots"], entry["state"], entry["active_slots"], entry["queued_requests"]) == \
                (new_n, "ready", 0, 0)
    run(scenario())
    assert [e[0] for e in events_of(mstack, model)] == ["register", "load", "reconfigure", "teardown", "load"]


def test_invalid_reconfiguration_preserves_live_state(mstack, token):
    """R4.4/R7.1: bad options, unknown family and an unsupported count (400 with capacity=) leave
    the old pool, count, metadata and residency; the next request is served by the same pool."""
    lazy_before = entry_of(mstack, "whisper-lazy")  # as the module's earlier tests left it

    async def scenario():
        async with mclient(mstack, token) as op:
            before, _, _ = await post(op, "fx-base")
            for payload in (fx("fx-base", 2, colour="red"),
                            {"id": "fx-base", "family": "nope"},
                            fx("fx-base", 2, version="a\u0000b"),
                            fx("fx-base", 2) | {"busy_timeout_ms": 2 ** 63},
                            {"id": "whisper-lazy", "family": "whisper", "slots": 5}):
                resp = await op.post("/v1/models/load", json=payload)
                assert resp.status_code == 400, resp.text
            resp = await op.post("/v1/models/load", json={"id": "whisper-lazy", "family": "whisper", "slots": 5})
            assert "capacity=4" in resp.json()["error"]["message"]
            after, _, _ = await post(op, "fx-base")
            assert after.json()["pool_id"] == before.json()["pool_id"]
            assert mstack.managers("fx-base") == {"held": 0, "queued": 0}
    run(scenario())
    base, lazy = entry_of(mstack, "fx-base"), entry_of(mstack, "whisper-lazy")
    assert mstack.sql("SELECT state FROM registry_modelregistration WHERE model_id = 'fx-base'") == [("ready",)]
    assert (base["state"], base["slots"], base["max_parallel_slots"]) == ("ready", 2, 16)
    assert (lazy["state"], lazy["slots"]) == (lazy_before["state"], lazy_before["slots"])


def test_a_valid_resize_works_after_an_unsupported_one(mstack, token):
    """R4.4/R9: after slots=5 is refused on an existing whisper model, slots=1 (and not lazy any more)
    loads and serves."""
    async def scenario():
        async with mclient(mstack, token, timeout=MODEL_S) as op:  # loads the real Whisper model
            resp = await op.post("/v1/models/load", json={"id": "whisper-lazy", "family": "whisper", "slots": 5})
            assert resp.status_code == 400 and "capacity=4" in resp.json()["error"]["message"]
            resp = await op.post("/v1/models/load", json={"id": "whisper-lazy", "family": "whisper", "slots": 1,
                                                          "lazy": False})
            assert resp.status_code == 200 and \
                resp.json() == {"id": "whisper-lazy", "loaded": True, "reconfigured": True}
            entry = entry_of(mstack, "whisper-lazy")
            assert (entry["slots"], entry["max_parallel_slots"], entry["state"]) == (1, 4, "ready")
            resp = await op.post("/v1/models/unload", json={"id": "whisper-lazy"})
            assert resp.json() == {"id": "whisper-lazy", "loaded": False}
    run(scenario())


def test_count_changes_keep_the_parallel_lifecycle(mstack, token):
    """R1.4/R4.4: 1→2→1→4→1 on one id; each step serves from a new pool with exactly that many
    slots in use at most, also at count one (the parallel runtime's lifecycle, never legacy)."""
    async def scenario():
        async with mclient(mstack, token) as op:
            pools = []
            for step, n in enumerate([1, 2, 1, 4, 1]):
                resp = await op.post("/v1/models/load", json=fx("cc", n, version=f"s{step}"))
                assert resp.status_code == 200 and resp.json()["reconfigured"] == (step > 0)
                holders = [asyncio.create_task(post(op, "cc", barrier=f"cc{step}")) for _ in range(n)]
                await until(lambda: mstack.arrived(f"cc{step}") == n)
                extra = asyncio.create_task(post(op, "cc", tag="extra"))
                await until(lambda: mstack.counters("cc")["queued"] == 1)  # slot n+1 does not exist
                entry = entry_of(mstack, "cc")
                assert (entry["slots"], entry["active_slots"], entry["queued_requests"]) == (n, n, 1)
                mstack.release(f"cc{step}", n)
                served = [(await h)[0].json() for h in holders] + [(await extra)[0].json()]
                assert {r["slot"] for r in served[:n]} == set(range(n))
                assert {r["config_version"] for r in served} == {f"s{step}"}
                pools.append(served[0]["pool_id"])
            assert len(set(pools)) == 5
    run(scenario())


# -- unload (R4.5) and unregister --------------------------------------------------------------
def test_unload_drains_older_requests_clears_residency_first_and_is_idempotent(mstack, token):
    """R4.5: unload waits for the running request; during a slow teardown the model already reads
    loaded=false with max_parallel_slots null; a second unload answers 200 loaded=false."""
    async def scenario():
        async with mclient(mstack, token) as op:
            resp = await op.post("/v1/models/load", json=fx("ul", 2, teardown_barrier="ul-down"))
            assert resp.status_code == 200
            running = asyncio.create_task(post(op, "ul", barrier="ul-run"))
            await until(lambda: mstack.arrived("ul-run") == 1)
            unload = asyncio.create_task(op.post("/v1/models/unload", json={"id": "ul"}))
            await until(lambda: mstack.managers("ul")["queued"] == 1)
            await asyncio.sleep(0.2)
            assert entry_of(mstack, "ul")["loaded"] is True and not unload.done()
            mstack.release("ul-run")
            assert (await running)[0].status_code == 200
            await until(lambda: mstack.arrived("ul-down") == 1)  # teardown held
            entry = entry_of(mstack, "ul")
            assert (entry["state"], entry["loaded"], entry["max_parallel_slots"]) == ("unloading", False, None)
            mstack.release("ul-down")
            resp = await unload
            assert resp.status_code == 200 and resp.json() == {"id": "ul", "loaded": False}
            again = await op.post("/v1/models/unload", json={"id": "ul"})
            assert again.status_code == 200 and again.json() == {"id": "ul", "loaded": False}
            assert entry_of(mstack, "ul")["state"] == "unloaded"
            resp, _, _ = await post(op, "ul")  # the next request loads it again
            assert resp.status_code == 200
            mstack.release("ul-down")  # let its next teardown (a later bulk unload) pass
    run(scenario())


@pytest.mark.parametrize("operation", ["unload", "bulk", "delete", "reconfigure"])
def test_a_client_that_leaves_during_a_teardown_does_not_end_the_barrier(mstack, token, operation):
    """R4.5/R2.2: once a manager holds the model, its client leaving does not release it: the
    teardown finishes under the lease, requests sent meanwhile wait for it and are served by a
    complete pool afterwards, and the state ends consistent."""
    model = f"leave-{operation}"

    async def scenario():
        async with mclient(mstack, token) as op:
            resp = await op.post("/v1/models/load", json=fx(model, 1, version="old", teardown_barrier=f"{model}-down"))
            assert resp.status_code == 200
            call = {"unload": lambda c: c.post("/v1/models/unload", json={"id": model}),
                    "bulk": lambda c: c.post("/v1/tasks/unload_models", json={"model_ids": [model]}),
                    "delete": lambda c: c.delete(f"/v1/models/{model}"),
                    "reconfigure": lambda c: c.post("/v1/models/load", json=fx(model, 2, version="new"))}[operation]
            async with mclient(mstack, token) as leaver:
                task = asyncio.create_task(call(leaver))
                await until(lambda: mstack.arrived(f"{model}-down") == 1)
                task.cancel()  # the client goes away while the teardown is held
                with pytest.raises(asyncio.CancelledError):
                    await task
            await asyncio.sleep(0.3)
            assert mstack.managers(model)["held"] == 1  # still exclusive
            recorded = mstack.sql("SELECT state FROM registry_modelregistration WHERE model_id = %s", model)
            assert recorded == [("reconfiguring" if operation == "reconfigure" else "unloading",)]
            waiting = asyncio.create_task(post(op, model))
            await asyncio.sleep(0.5)
            assert not waiting.done()  # not admitted beside a half-destroyed pool
            mstack.release(f"{model}-down")
            resp, _, _ = await waiting
            if operation == "delete":
                assert resp.status_code == 404
            else:
                assert resp.status_code == 200
                assert resp.json()["config_version"] == ("new" if operation == "reconfigure" else "old")
            await until(lambda: mstack.managers(model)["held"] == 0)
            if operation != "delete":
                entry = entry_of(mstack, model)
                assert entry["state"] == "ready" and entry["loaded"] is True
                mstack.release(f"{model}-down")  # let later teardowns of this model pass
    run(scenario())
    events = [e[0] for e in events_of(mstack, model)]
    expected = {"unload": "unload", "bulk": "unload", "delete": "unregister", "reconfigure": "reconfigure"}
    assert expected[operation] in events, events  # the audit is written although the client left


def test_bulk_unload_behind_an_unregister_reports_the_model_not_found(mstack, token):
    """R5.1: a model removed by a DELETE queued ahead of the bulk call is reported in not_found."""
    async def scenario():
        async with mclient(mstack, token) as op:
            assert (await op.post("/v1/models/load", json=fx("bd", 1))).status_code == 200
            _running = asyncio.create_task(post(op, "bd", barrier="bd-run"))  # never awaited: holds the model
            await until(lambda: mstack.arrived("bd-run") == 1)
            delete = asyncio.create_task(op.delete("/v1/models/bd"))
            await until(lambda: mstack.managers("bd")["queued"] == 1)
            bulk = asyncio.create_task(op.post("/v1/tasks/unload_models", json={"model_ids": ["bd"]}))
            await until(lambda: mstack.managers("bd")["queued"] == 2)
            mstack.release("bd-run")
            assert (await delete).status_code == 200
            resp = await bulk
            assert resp.json() == {"unloaded": [], "not_found": ["bd"], "skipped": []}
    run(scenario())
    assert not mstack.redis.exists(KEYS.load("bd"))


def test_unregister_is_a_barrier_and_later_requests_get_404(mstack, token):
    """DELETE /v1/models/{id}: older requests finish; the entry goes from status and the database;
    a request queued behind the barrier answers 404, holding nothing."""
    async def scenario():
        async with mclient(mstack, token) as op:
            assert (await op.post("/v1/models/load", json=fx("gone", 1))).status_code == 200
            running = asyncio.create_task(post(op, "gone", barrier="gone-run"))
            await until(lambda: mstack.arrived("gone-run") == 1)
            delete = asyncio.create_task(op.delete("/v1/models/gone"))
            await until(lambda: mstack.managers("gone")["queued"] == 1)
            later = asyncio.create_task(post(op, "gone"))
            await until(lambda: mstack.counters("gone")["queued"] == 1)
            mstack.release("gone-run")
            assert (await running)[0].status_code == 200
            resp = await delete
            assert resp.status_code == 200 and resp.json() == {"id": "gone", "deleted": True}
            late, _, _ = await later
            assert late.status_code == 404 and late.json()["error"]["type"] == "not_found"
            assert (await op.get("/v1/models/gone")).status_code == 404
    run(scenario())
    assert mstack.counters("gone") == {"leases": 0, "queued": 0}
    assert mstack.managers("gone") == {"held": 0, "queued": 0}
    assert mstack.sql("SELECT count(*) FROM registry_modelregistration WHERE model_id = 'gone'") == [(0,)]
    assert events_of(mstack, "gone")[-1][0] == "unregister"


def test_overlapping_managers_keep_their_order(mstack, token):
    """R2.1/R4.3: reconfigure v2, unload, reconfigure v3 queued behind a running request run in
    arrival order; the model ends loaded at v3."""
    async def scenario():
        async with mclient(mstack, token) as op:
            assert (await op.post("/v1/models/load", json=fx("ord", 1, version="v1"))).status_code == 200
            _running = asyncio.create_task(post(op, "ord", barrier="ord-run"))  # never awaited: holds the model
            await until(lambda: mstack.arrived("ord-run") == 1)
            calls = []
            for i, (method, url, payload) in enumerate((("POST", "/v1/models/load", fx("ord", 1, version="v2")),
                                                        ("POST", "/v1/models/unload", {"id": "ord"}),
                                                        ("POST", "/v1/models/load", fx("ord", 1, version="v3")))):
                calls.append(asyncio.create_task(op.request(method, url, json=payload)))
                await until(lambda: mstack.managers("ord")["queued"] == i + 1)
            mstack.release("ord-run")
            results = [await c for c in calls]
            assert [r.status_code for r in results] == [200, 200, 200]
            assert results[1].json()["loaded"] is False and results[2].json()["reconfigured"] is True
            resp, _, _ = await post(op, "ord")
            assert resp.json()["config_version"] == "v3"
    run(scenario())
    assert [e[0] for e in events_of(mstack, "ord")] == [
        "register", "load", "reconfigure", "teardown", "load", "teardown", "unload", "reconfigure", "load"]


def test_dynamic_registrations_survive_a_registry_resync(mstack, token):
    """R4.6 persistence: sync_config (what serve runs at every start) keeps API registrations and
    publishes them again."""
    async def scenario():
        async with mclient(mstack, token) as op:
            resp = await op.post("/v1/models/load", json=fx("keep", 1, version="k") | {"lazy": True})
            assert resp.status_code == 200 and resp.json()["loaded"] is False
            resp = await op.post("/v1/models/load", json=fx("keep", 1, version="k2") | {"lazy": True})
            assert resp.json() == {"id": "keep", "loaded": False, "reconfigured": True}
    run(scenario())
    # the database records what status shows (R4), also after a reconfigure that loads nothing
    assert mstack.sql("SELECT state FROM registry_modelregistration WHERE model_id = 'keep'") == [("unloaded",)]
    mstack.redis.hdel(KEYS.models_meta, "keep")  # as if Redis had been restarted
    done = mstack.manage("sync_config", env={"AUDIOSITE_PARALLEL_JOBS": "1",
                                             "AUDIOSITE_CONFIG": str(mstack.log_path.parent / "server.json")})
    assert done.returncode == 0, done.stderr
    entry = entry_of(mstack, "keep")
    assert entry["id"] == "keep" and entry["state"] == "unloaded"
    assert entry_of(mstack, "fx-base")["id"] == "fx-base"  # the config file's entries stay too


def test_sync_config_refuses_to_change_a_model_in_use_and_applies_once_it_is_unloaded(mstack, token, tmp_path):
    """One teardown path: ``sync_config`` writes registrations without tearing pools down,
    so against a live deployment it refuses a file that changes a model in use (``fx-base``, loaded):
    exit status 1, the model named, nothing written, the pool still serving the old configuration. Once
    the model is unloaded through the API, the same file is applied and the next request loads it anew."""
    config = json.loads((mstack.log_path.parent / "server.json").read_text())
    original = dict(config, models=[dict(m) for m in config["models"]])
    for entry in config["models"]:
        if entry["id"] == "fx-base":
            entry["load_options"] = {"version": "v-sync"}
    changed_path, original_path = tmp_path / "changed.json", tmp_path / "original.json"
    changed_path.write_text(json.dumps(config))
    original_path.write_text(json.dumps(original))

    def sync(path) -> subprocess.CompletedProcess:
        return mstack.manage("sync_config", env={"AUDIOSITE_PARALLEL_JOBS": "1", "AUDIOSITE_CONFIG": str(path)})

    async def version(c) -> str:
        resp, _, _ = await post(c, "fx-base")
        assert resp.status_code == 200, resp.text
        return resp.json()["config_version"]

    async def unload(op) -> None:
        resp = await op.post("/v1/models/unload", json={"id": "fx-base"})
        assert resp.status_code == 200, resp.text

    async def scenario():
        async with mclient(mstack, token, timeout=MODEL_S) as op:
            assert await version(op) == "v1"
            refused = sync(changed_path)
            assert refused.returncode == 1, refused.stdout
            assert "['fx-base']" in refused.stderr and "in use" in refused.stderr, refused.stderr
            assert "Nothing was written" in refused.stderr
            assert await version(op) == "v1" and entry_of(mstack, "fx-base")["state"] == "ready"
            await unload(op)
            applied = sync(changed_path)
            assert applied.returncode == 0, applied.stderr
            assert "updated ['fx-base']" in applied.stdout
            assert await version(op) == "v-sync"
            await unload(op)  # put the module's configuration back
            assert sync(original_path).returncode == 0
    run(scenario())
    assert mstack.sql("SELECT options->'load_options' FROM registry_modelregistration WHERE model_id = 'fx-base'") == [
        ({"version": "v1"},)]


# -- status reads (R4.7) ---------------------------------------------------------------------------
def test_status_entries_never_mix_two_configurations_while_reconfigurations_run(mstack, token):
    """R4.7: one id is reconfigured back and forth 12 times between two configurations (1 slot with
    load option version a; 2 slots with version b; each load takes 20 ms) while three clients keep
    its slots busy and two more read ``/v1/models`` and ``/v1/models/<id>`` without pause. No entry
    mixes the two: its slots and load options are one configuration's, and it never shows more
    requests in slots than that configuration has (the second's two slots full next to the first's
    count of one would be the old configuration read beside the new pool's state). The reads saw both
    configurations, the second one's slots full, and states inside the transitions."""
    first = fx("mix", 1, version="a", load_ms=20)
    second = fx("mix", 2, version="b", load_ms=20)

    async def scenario() -> list[dict]:
        async with mclient(mstack, token) as op:
            assert (await op.post("/v1/models/load", json=first)).status_code == 200
            seen: list[dict] = []
            reconfiguring = True

            async def read(path: str) -> None:
                while reconfiguring:
                    resp = await op.get(path)
                    assert resp.status_code == 200, resp.text
                    data = resp.json()
                    seen.extend(e for e in data.get("data", [data]) if e["id"] == "mix")

            async def use() -> None:
                while reconfiguring:
                    resp, _, _ = await post(op, "mix", sleep_ms=40)
                    assert resp.status_code == 200, resp.text

            tasks = [asyncio.create_task(read(path)) for path in ("/v1/models", "/v1/models/mix")]
            tasks += [asyncio.create_task(use()) for _ in range(3)]
            try:
                for step in range(12):
                    resp = await op.post("/v1/models/load", json=second if step % 2 == 0 else first)
                    assert resp.status_code == 200 and resp.json()["reconfigured"], resp.text
                    await asyncio.sleep(0.2)  # traffic on this configuration before the next change
            finally:
                reconfiguring = False
                await asyncio.gather(*tasks)
            return seen

    seen = run(scenario())
    assert {(e["slots"], e["load_options"]["version"]) for e in seen} == {(1, "a"), (2, "b")}
    mixed = [(e["state"], e["slots"], e["active_slots"], e["load_options"]) for e in seen
             if e["active_slots"] > e["slots"]]
    assert not mixed, mixed[:5]
    assert any(e["slots"] == 2 and e["active_slots"] == 2 for e in seen)  # the invariant was at stake
    states = {e["state"] for e in seen}
    assert "ready" in states and states - {"ready"}, states  # reads landed inside the transitions too
    mstack.wait_idle("mix")


# -- bulk unload (R5) ------------------------------------------------------------------------------
def test_bulk_unload_frees_an_idle_model_before_a_loading_one_finishes(mstack, token):
    """R5.1: duplicates once, unknown ids in not_found; the idle model is unloaded at once while the
    other is still loading; the call returns after both, listing each once."""
    async def scenario():
        async with mclient(mstack, token) as op:
            assert (await op.post("/v1/models/load", json=fx("bk-idle", 1))).status_code == 200
            resp = await op.post("/v1/models/load", json=fx("bk-slow", 1, load_barrier="bk-load") | {"lazy": True})
            assert resp.status_code == 200
            loading = asyncio.create_task(post(op, "bk-slow"))
            await until(lambda: mstack.arrived("bk-load") == 1)
            bulk = asyncio.create_task(op.post("/v1/tasks/unload_models", json={
                "model_ids": ["bk-slow", "nope", "bk-idle", "bk-slow"]}))
            await until(lambda: entry_of(mstack, "bk-idle")["state"] == "unloaded")
            assert entry_of(mstack, "bk-slow")["state"] == "loading" and not bulk.done()
            mstack.release("bk-load")
            assert (await loading)[0].status_code == 200  # the older request is served first
            resp = await bulk
            assert resp.status_code == 200
            assert resp.json() == {"unloaded": ["bk-slow", "bk-idle"], "not_found": ["nope"], "skipped": []}
            assert entry_of(mstack, "bk-slow")["state"] == "unloaded"
    run(scenario())


def test_bulk_unload_waits_without_bound_behind_a_slot_that_makes_a_targeted_unload_fail_fast(mstack, token):
    """R3.4: the model's one slot is held past its 1 s busy timeout; a targeted unload then fails fast
    (503 ``overdue``), while a bulk unload of the same model keeps waiting past that timeout, unloads it
    once the run ends, and leaves no manager ticket or lease."""
    async def scenario():
        async with mclient(mstack, token) as op:
            resp = await op.post("/v1/models/load", json=fx("bk-overdue", 1) | {"busy_timeout_ms": 1000})
            assert resp.status_code == 200
            holder = asyncio.create_task(post(op, "bk-overdue", barrier="bk-overdue-run"))
            await until(lambda: mstack.arrived("bk-overdue-run") == 1)
            await asyncio.sleep(1.2)  # the held slot is now older than the model's busy timeout
            targeted = await op.post("/v1/models/unload", json={"id": "bk-overdue"})
            assert targeted.status_code == 503 and targeted.json()["error"]["code"] == "overdue", targeted.text
            bulk = asyncio.create_task(op.post("/v1/tasks/unload_models", json={"model_ids": ["bk-overdue"]}))
            await until(lambda: mstack.managers("bk-overdue")["queued"] == 1)
            await asyncio.sleep(2.0)  # twice the busy timeout: still queued, no 503
            assert not bulk.done() and mstack.managers("bk-overdue")["queued"] == 1
            assert entry_of(mstack, "bk-overdue")["state"] == "ready"
            mstack.release("bk-overdue-run")
            assert (await holder)[0].status_code == 200  # the older request is served first
            resp = await bulk
            assert resp.status_code == 200, resp.text
            assert resp.json() == {"unloaded": ["bk-overdue"], "not_found": [], "skipped": []}
    run(scenario())
    assert mstack.managers("bk-overdue") == {"held": 0, "queued": 0}
    assert mstack.counters("bk-overdue") == {"leases": 0, "queued": 0}
    assert entry_of(mstack, "bk-overdue")["state"] == "unloaded"


def test_overlapping_reversed_and_duplicate_bulk_selections_do_not_deadlock(mstack, token):
    """R5.2: two bulk calls over [a, b] and [b, a, b] while b is busy both finish; a request to an
    unrelated model meanwhile never waits on them."""
    async def scenario():
        async with mclient(mstack, token) as op:
            for name in ("ov-a", "ov-b"):
                assert (await op.post("/v1/models/load", json=fx(name, 1))).status_code == 200
            busy = asyncio.create_task(post(op, "ov-b", barrier="ov-run"))
            await until(lambda: mstack.arrived("ov-run") == 1)
            first = asyncio.create_task(op.post("/v1/tasks/unload_models", json={"model_ids": ["ov-a", "ov-b"]}))
            await until(lambda: mstack.managers("ov-b")["queued"] == 1)
            second = asyncio.create_task(op.post("/v1/tasks/unload_models",
                                                 json={"model_ids": ["ov-b", "ov-a", "ov-b"]}))
            await until(lambda: mstack.managers("ov-b")["queued"] == 2)
            started = time.monotonic()
            resp, _, _ = await post(op, "fx-base")
            assert resp.status_code == 200 and time.monotonic() - started < 5
            mstack.release("ov-run")
            assert (await busy)[0].status_code == 200
            r1, r2 = await asyncio.wait_for(first, 30), await asyncio.wait_for(second, 30)
            assert r1.json() == {"unloaded": ["ov-a", "ov-b"], "not_found": [], "skipped": []}
            assert r2.json() == {"unloaded": ["ov-b", "ov-a"], "not_found": [], "skipped": []}
    run(scenario())
    for name in ("ov-a", "ov-b"):
        assert mstack.managers(name) == {"held": 0, "queued": 0}


def test_unload_all_lists_every_registered_model_including_never_loaded(mstack, token):
    """R5.1/R5.3: unload_all_models lists each registered model once (lazy, never loaded ones too);
    afterwards nothing is loaded and the next request loads again."""
    async def scenario():
        async with mclient(mstack, token) as op:
            registered = {e["id"] for e in (await op.get("/v1/models")).json()["data"] if "alias_of" not in e}
            resp = await op.post("/v1/tasks/unload_all_models")
            assert resp.status_code == 200
            assert sorted(resp.json()["unloaded"]) == sorted(registered) and resp.json()["not_found"] == []
            entries = (await op.get("/v1/models")).json()["data"]
            # Models whose last load failed (earlier tests) still read "failed": an unload does not
            # forget a failed load; a successful load or a reconfiguration does (R6.7).
            states = {e["id"]: e["state"] for e in entries}
            assert {e["id"] for e in entries if e["state"] == "failed"} == {e["id"] for e in entries if e["retry_at"]}
            assert set(states.values()) <= {"unloaded", "failed"} and states["fx-base"] == "unloaded", states
            resp, _, _ = await post(op, "fx-base")
            assert resp.status_code == 200
    run(scenario())


# -- the "done when" scenario -----------------------------------------------------------------------
def test_operator_lifecycle_under_continuous_traffic_from_four_clients(mstack, token):
    """R2.3/R4.4–R4.6/R5: four clients send requests without pause while the operator registers a
    model, resizes it 1→4→2, unloads it and bulk-unloads everything. Every answer is 200 from a
    complete pool of one configuration (slot < that configuration's count) or a documented 503."""
    counts = {"c1": 1, "c4": 4, "c2": 2}
    answers: list[httpx.Response] = []

    async def scenario():
        async with mclient(mstack, token) as op:
            stop = asyncio.Event()
            resp = await op.post("/v1/models/load", json=fx("live", 1, version="c1"))
            assert resp.status_code == 200

            async def traffic():
                async with mclient(mstack, None) as c:
                    while not stop.is_set():
                        resp = await c.post("/v1/tasks/run", json=body("live", sleep_ms=20, busy_timeout_ms=20000))
                        answers.append(resp)

            clients = [asyncio.create_task(traffic()) for _ in range(4)]
            await asyncio.sleep(0.5)
            for version, n in (("c4", 4), ("c2", 2)):
                resp = await op.post("/v1/models/load", json=fx("live", n, version=version))
                assert resp.status_code == 200 and resp.json()["reconfigured"] is True
                await asyncio.sleep(0.5)
            assert (await op.post("/v1/models/unload", json={"id": "live"})).status_code == 200
            await asyncio.sleep(0.5)
            resp = await op.post("/v1/tasks/unload_all_models")
            assert resp.status_code == 200 and "live" in resp.json()["unloaded"]
            await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*clients)
    run(scenario())
    assert len(answers) > 40
    seen = set()
    for resp in answers:
        if resp.status_code == 200:
            result = resp.json()
            assert result["slot"] < counts[result["config_version"]], result
            seen.add(result["config_version"])
        else:
            assert resp.status_code == 503 and resp.json()["error"]["type"] == "server_busy", resp.text
    assert seen == {"c1", "c4", "c2"}
    assert mstack.counters("live") == {"leases": 0, "queued": 0}


# -- legacy runtime ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lstack(tmp_path_factory):
    models = [{"id": "lfx", "family": "fixture", "load_options": {"version": "l1"}}]
    yield from run_stack(tmp_path_factory.mktemp("lstack"), models, redis_db=11, name="lmgmt",
                         extra_env=FIXTURE_ENV, extra_config={"ui_management": True, "max_loaded_models": 8})


def test_legacy_refuses_slots_and_manages_one_session_models(lstack):
    """R1.2: on the legacy runtime any explicit slots (1 and null too) → 400 "slots requires
    --parallel-jobs"; registration, reconfiguration and unload work without it; no slot fields."""
    key = lstack.manage("issue_token", "operator").stdout.strip()

    async def scenario():
        async with mclient(lstack, key) as op:
            for slots in (1, None, 2):
                resp = await op.post("/v1/models/load", json=fx("lnew", slots) | {"slots": slots})
                assert resp.status_code == 400 and "slots requires --parallel-jobs" in resp.json()["error"]["message"]
            assert (await op.get("/v1/models/lnew")).status_code == 404
            resp = await op.post("/v1/models/load", json=fx("lnew", version="a"))
            assert resp.json() == {"id": "lnew", "loaded": True, "reconfigured": False}
            resp = await op.post("/v1/models/load", json=fx("lnew", version="b"))
            assert resp.json() == {"id": "lnew", "loaded": True, "reconfigured": True}
            served, _, _ = await post(op, "lnew")
            assert served.json()["config_version"] == "b"
            entry = (await op.get("/v1/models/lnew")).json()
            assert "slots" not in entry and entry["state"] == "ready"
            resp = await op.post("/v1/models/unload", json={"id": "lnew"})
            assert resp.json() == {"id": "lnew", "loaded": False}
    run(scenario())


def test_legacy_bulk_unload_skips_an_unpublished_first_load(lstack):
    """R5.4: on legacy, bulk unload does not wait for a model whose first load is still running; it
    is listed in skipped; the loaded model is unloaded."""
    key = lstack.manage("issue_token", "operator").stdout.strip()

    async def scenario():
        async with mclient(lstack, key) as op:
            resp = await op.post("/v1/models/load", json=fx("lslow", load_barrier="lslow-load") | {"lazy": True})
            assert resp.status_code == 200
            first = asyncio.create_task(post(op, "lslow"))
            await until(lambda: lstack.arrived("lslow-load") == 1)
            resp = await asyncio.wait_for(op.post("/v1/tasks/unload_all_models"), 20)
            assert resp.status_code == 200
            assert "lslow" in resp.json()["skipped"] and "lslow" not in resp.json()["unloaded"]
            assert "lfx" in resp.json()["unloaded"]
            lstack.release("lslow-load")
            assert (await first)[0].status_code == 200
    run(scenario())


# -- the Django admin goes through the same services -----------------------------------------------
def _admin_session(stack) -> httpx.Client:
    made = stack.manage("shell", "--no-imports", "-c", (
        "from django.contrib.auth.models import User\n"
        "u, _ = User.objects.get_or_create(username='admin', defaults={'is_staff': True, 'is_superuser': True})\n"
        "u.is_staff = u.is_superuser = True; u.set_password('pw-admin-1'); u.save()"))
    assert made.returncode == 0, made.stderr
    c = stack.client(follow_redirects=False)
    page = c.get("/admin/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    resp = c.post("/admin/login/?next=/admin/", data={"username": "admin", "password": "pw-admin-1",
                                                       "csrfmiddlewaretoken": token})
    assert resp.status_code == 302, resp.text[:500]
    return c


def _csrf(c: httpx.Client, url: str) -> str:
    return re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', c.get(url).text).group(1)


def test_admin_actions_and_reconfigure_page_use_the_services(mstack, token):
    """R4.4/R4.5 via the Django admin: the unload action unloads through the bulk service, the
    reconfigure page validates privately (an invalid entry changes nothing) and reconfigures."""
    async def setup():
        async with mclient(mstack, token) as op:
            assert (await op.post("/v1/models/load", json=fx("adm", 1, version="a1"))).status_code == 200
    run(setup())
    pk = mstack.sql("SELECT id FROM registry_modelregistration WHERE model_id = 'adm'")[0][0]
    c = _admin_session(mstack)
    try:
        changelist = "/admin/registry/modelregistration/"
        resp = c.post(changelist, data={"action": "unload_selected", "_selected_action": [str(pk)],
                                        "csrfmiddlewaretoken": _csrf(c, changelist)})
        assert resp.status_code == 302
        assert entry_of(mstack, "adm")["state"] == "unloaded"
        page = f"/admin/registry/modelregistration/{pk}/reconfigure/"
        odd = c.get("/admin/registry/modelregistration/abc/reconfigure/", follow_redirects=True)
        assert odd.status_code == 200 and "doesn’t exist" in odd.text  # Django's own "no such object" page
        assert c.get("/admin/registry/modelregistration/999999/reconfigure/").status_code == 404
        bad = json.dumps({"id": "adm", "family": "fixture", "slots": 2, "load_options": {"colour": "red"}})
        resp = c.post(page, data={"entry": bad, "csrfmiddlewaretoken": _csrf(c, page)})
        assert resp.status_code == 200 and "colour" in resp.text
        assert entry_of(mstack, "adm")["slots"] == 1
        for odd in ('{"id": "adm", "family": "fixture", "load_options": {"version": "\\ud800"}}',
                    '{"id": "adm", "load_options": ' + "[" * 100000 + "]" * 100000 + "}", "[1, 2]"):
            resp = c.post(page, data={"entry": odd, "csrfmiddlewaretoken": _csrf(c, page)})
            assert resp.status_code == 200 and "errorlist" in resp.text  # a form error, never a 500
        failing = json.dumps({"id": "adm", "family": "fixture", "slots": 1, "load_options": {"fail_load": True}})
        resp = c.post(page, data={"entry": failing, "csrfmiddlewaretoken": _csrf(c, page)}, follow_redirects=True)
        assert resp.status_code == 200 and "the new entry is saved, but loading it failed" in resp.text
        good = json.dumps({"id": "adm", "family": "fixture", "slots": 2, "load_options": {"version": "a2"}})
        resp = c.post(page, data={"entry": good, "csrfmiddlewaretoken": _csrf(c, page)})
        assert resp.status_code == 302, resp.text[:2000]
    finally:
        c.close()
    entry = entry_of(mstack, "adm")
    assert (entry["slots"], entry["state"]) == (2, "ready")
    assert ("reconfigure", "ok", "admin") in events_of(mstack, "adm")


def test_legacy_bulk_unload_skips_a_first_load_waiting_on_the_cold_load_guard(lstack):
    """R5.4/R6.6: a registration whose first load still waits for the cold-load guard (held by another
    model's load) is skipped at once by a bulk unload, not waited for."""
    key = lstack.manage("issue_token", "operator").stdout.strip()

    async def scenario():
        async with mclient(lstack, key) as op:
            holder = asyncio.create_task(op.post("/v1/models/load", json=fx("lg1", load_barrier="lg1-load")))
            await until(lambda: lstack.arrived("lg1-load") == 1)  # lg1's load holds the guard
            waiter = asyncio.create_task(op.post("/v1/models/load", json=fx("lg2")))
            await until(lambda: lstack.managers("lg2")["held"] == 1)
            await asyncio.sleep(0.3)
            resp = await asyncio.wait_for(op.post("/v1/tasks/unload_models", json={"model_ids": ["lg2", "lg1"]}), 5)
            assert resp.json() == {"unloaded": [], "not_found": [], "skipped": ["lg2", "lg1"]}
            lstack.release("lg1-load")
            assert (await holder).status_code == 200 and (await waiter).status_code == 200
    run(scenario())


def test_bulk_unload_does_not_cover_models_registered_after_its_snapshot(mstack, token):
    """R5.3: unload_all_models waits behind a busy model; a model registered meanwhile is not in its
    selection: it stays loaded and is not listed."""
    async def scenario():
        async with mclient(mstack, token) as op:
            assert (await op.post("/v1/models/load", json=fx("snap-busy", 1))).status_code == 200
            running = asyncio.create_task(post(op, "snap-busy", barrier="snap-run"))
            await until(lambda: mstack.arrived("snap-run") == 1)
            bulk = asyncio.create_task(op.post("/v1/tasks/unload_all_models"))
            await until(lambda: mstack.managers("snap-busy")["queued"] == 1)
            resp = await op.post("/v1/models/load", json=fx("snap-late", 1))
            assert resp.json() == {"id": "snap-late", "loaded": True, "reconfigured": False}
            mstack.release("snap-run")
            assert (await running)[0].status_code == 200
            resp = await bulk
            assert "snap-busy" in resp.json()["unloaded"] and "snap-late" not in resp.json()["unloaded"]
            assert entry_of(mstack, "snap-late")["state"] == "ready"
    run(scenario())


def test_an_admin_session_manages_through_the_api_with_csrf(mstack):
    """The API has no session middleware: registry.authentication reads the admin's session itself,
    and a session-authenticated call must carry the CSRF token (DRF's rule) while a token call need not."""
    made = mstack.manage("shell", "--no-imports", "-c", (
        "from django.contrib.auth.models import User\n"
        "u, _ = User.objects.get_or_create(username='admin', defaults={'is_staff': True, 'is_superuser': True})\n"
        "u.is_staff = u.is_superuser = True; u.set_password('pw-admin-1'); u.save()"))
    assert made.returncode == 0, made.stderr
    with mstack.client(follow_redirects=False) as c:
        page = c.get("/admin/login/")
        form_token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
        resp = c.post("/admin/login/?next=/admin/", data={"username": "admin", "password": "pw-admin-1",
                                                           "csrfmiddlewaretoken": form_token})
        assert resp.status_code == 302, resp.text[:300]
        resp = c.post("/v1/models/unload", json={"id": "nope"})
        assert resp.status_code == 403 and "CSRF" in resp.json()["error"]["message"], resp.text
        resp = c.post("/v1/models/unload", json={"id": "nope"}, headers={"X-CSRFToken": c.cookies["csrftoken"]})
        assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found", resp.text
        resp = c.post("/v1/models/unload", json={"id": "whisper-lazy"}, headers={"X-CSRFToken": c.cookies["csrftoken"]})
        assert resp.status_code == 200 and resp.json() == {"id": "whisper-lazy", "loaded": False}, resp.text
    with mstack.client(cookies={"sessionid": "not-a-session"}) as c:
        resp = c.post("/v1/models/unload", json={"id": "whisper-lazy"})
        assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Token", resp.text


# -- a plain load keeps the registration, in every place it can be taken ------------------------------
PRESET_ENTRY = {"id": "tts-presets", "family": "piper", "lazy": True, "busy_timeout_ms": 7000,
                "voice_presets": {"alloy": {"voice": "joe"},
                                  "nova": {"voice": "joe", "options": {"sentence_silence_s": 0.2}},
                                  "echo": {"voice": "joe", "options": {"length_scale": 1.1}}},
                "default_voice_preset": "alloy"}


def _private_entry(stack, token: str, model_id: str) -> dict:
    with stack.client(headers={"Authorization": f"Token {token}"}) as c:
        entry = c.get(f"/v1/models/{model_id}").json()
    return {k: v for k, v in entry.items() if k not in ("state", "loaded", "last_error", "retry_at", "active_slots",
                                                        "queued_requests", "max_parallel_slots")}


def _reconfigures(stack, model_id: str) -> int:
    return sum(1 for event, _, _ in events_of(stack, model_id) if event == "reconfigure")


def test_a_plain_load_by_id_keeps_every_key_of_the_registration_and_only_sent_keys_change(mstack, token):
    """R4.4 through the API: ``{"id"}`` and ``{"id", "family"}`` load the registration as it is (voice
    presets included: no reconfigure, no audit row of one), a lazy one too, now (it stays lazy); a body
    with one key changes only that key; the private status entry shows every key of the entry, the way
    the config file sets it."""
    async def scenario():
        async with mclient(mstack, token) as op:
            resp = await op.post("/v1/models/load", json=PRESET_ENTRY)
            assert resp.status_code == 200, resp.text
            before = _private_entry(mstack, token, "tts-presets")
            reconfigures = _reconfigures(mstack, "tts-presets")  # earlier tests of the module may have made some
            stored = {name: {"options": {}, **preset} for name, preset in PRESET_ENTRY["voice_presets"].items()}
            assert before["voice_presets"] == stored and before["busy_timeout_ms"] == 7000
            for plain in ({"id": "tts-presets"}, {"id": "tts-presets", "family": "piper"}):
                resp = await op.post("/v1/models/load", json=plain)
                assert resp.json() == {"id": "tts-presets", "loaded": True, "reconfigured": False}, resp.text
            assert _private_entry(mstack, token, "tts-presets") == before
            assert _reconfigures(mstack, "tts-presets") == reconfigures
            voices = (await op.get("/v1/audio/voices", params={"model": "tts-presets"})).json()["voices"]
            assert {"alloy", "nova", "echo"} <= {v["id"] for v in voices}
            resp = await op.post("/v1/models/load", json={"id": "tts-presets", "busy_timeout_ms": 9000})
            assert resp.json()["reconfigured"] is True
            after = _private_entry(mstack, token, "tts-presets")
            assert after == {**before, "busy_timeout_ms": 9000}
            resp = await op.post("/v1/models/load", json={"id": "tts-presets", "default_voice_preset": "nova",
                                                          "voice_presets": {"nova": {"voice": "joe"}}})
            assert resp.status_code == 200, resp.text
            assert _private_entry(mstack, token, "tts-presets") == {
                **after, "voice_presets": {"nova": {"voice": "joe", "options": {}}}, "default_voice_preset": "nova"}
            # Back to the original presets for the next tests.
            assert (await op.post("/v1/models/load", json=PRESET_ENTRY)).status_code == 200
    run(scenario())


def test_the_admin_load_action_and_the_dashboard_load_keep_the_registration(mstack, token):
    """R4.4 in the admin ("Load selected") and the UI (the dashboard's Load button posts
    ``/ui/manage/<id>/load``): a plain load, nothing changes, no reconfigure is logged. The model
    page's configuration form changes only the keys it sends."""
    async def setup():
        async with mclient(mstack, token) as op:
            assert (await op.post("/v1/models/load", json=PRESET_ENTRY)).status_code == 200
    run(setup())
    before = _private_entry(mstack, token, "tts-presets")
    reconfigures = _reconfigures(mstack, "tts-presets")
    pk = mstack.sql("SELECT id FROM registry_modelregistration WHERE model_id = 'tts-presets'")[0][0]
    c = _admin_session(mstack)
    try:
        changelist = "/admin/registry/modelregistration/"
        resp = c.post(changelist, data={"action": "load_selected", "_selected_action": [str(pk)],
                                        "csrfmiddlewaretoken": _csrf(c, changelist)})
        assert resp.status_code == 302
        assert _private_entry(mstack, token, "tts-presets") == before
        csrf = {"X-CSRFToken": c.cookies["csrftoken"]}
        resp = c.post("/ui/manage/tts-presets/load", headers=csrf)
        assert resp.status_code == 200 and resp.json() == {
            "ok": True, "result": {"id": "tts-presets", "loaded": True, "reconfigured": False}}, resp.text
        assert _private_entry(mstack, token, "tts-presets") == before
        assert _reconfigures(mstack, "tts-presets") == reconfigures
        page = c.get("/ui/models/tts-presets")
        assert page.status_code == 200 and 'id="configure"' in page.text and "sentence_silence_s" in page.text
        resp = c.post("/ui/manage/tts-presets/configure", headers=csrf,
                      data={"entry": json.dumps({"default_voice_preset": "echo"})})
        assert resp.status_code == 200 and resp.json()["result"]["reconfigured"] is True, resp.text
        assert _private_entry(mstack, token, "tts-presets") == {**before, "default_voice_preset": "echo"}
        resp = c.post("/ui/manage/tts-presets/configure", headers=csrf,
                      data={"entry": json.dumps({"id": "other", "lazy": True})})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "id"
        for action in ("configure", "load", "slots"):  # an id nobody registered: 404, as from the API
            resp = c.post(f"/ui/manage/nobody/{action}", headers=csrf, data={"entry": "{}", "slots": "1"})
            assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found", action
    finally:
        c.close()


def test_bearer_tokens_work_wherever_token_does_and_an_openai_key_does_not_block_status_reads(mstack, token):
    """API.md gate: ``Authorization: Bearer <token>`` is a token like ``Token <token>``; an unknown Bearer
    key is refused on management calls (401) but counts as no credentials on status reads, where every
    OpenAI client sends its API key (the official SDK's ``models.list()`` against a server with
    management on)."""
    import openai

    async def scenario():
        async with mclient(mstack, None, headers={"Authorization": f"Bearer {token}"}) as bearer, \
                mclient(mstack, None, headers={"Authorization": "Bearer sk-not-one-of-ours"}) as stranger:
            resp = await bearer.post("/v1/models/load", json={"id": "fx-base"})
            assert resp.status_code == 200 and resp.json()["reconfigured"] is False, resp.text
            listed = (await bearer.get("/v1/models/fx-base")).json()
            assert "load_options" in listed and "path" in listed  # the private fields of a permitted caller
            resp = await stranger.post("/v1/models/load", json={"id": "fx-base"})
            assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
            resp = await stranger.get("/v1/models/fx-base")
            assert resp.status_code == 200 and "path" not in resp.json()
            resp = await stranger.delete("/v1/models/fx-base")
            assert resp.status_code == 401
            for odd in ("Bearer", "Bearer a b"):  # malformed OpenAI keys: no credentials on a read
                resp = await stranger.get("/v1/models/fx-base", headers={"Authorization": odd})
                assert resp.status_code == 200 and "path" not in resp.json(), odd
                resp = await stranger.post("/v1/models/load", json={"id": "fx-base"}, headers={"Authorization": odd})
                assert resp.status_code == 401, odd
    run(scenario())
    client = openai.OpenAI(base_url=f"{mstack.url}/v1", api_key="sk-unknown", max_retries=0, timeout=30)
    assert "fx-base" in {model.id for model in client.models.list()}


def test_a_voice_preset_naming_a_voice_the_checkpoint_lacks_is_refused(mstack, token):
    """A preset must stand for one of the checkpoint's own voices: an unknown one is a 400 naming the
    preset's voice, and nothing is registered (it used to register and then speak the first voice)."""
    async def scenario():
        async with mclient(mstack, token) as op:
            resp = await op.post("/v1/models/load", json={"id": "tts-ghost", "family": "piper", "lazy": True,
                                                          "voice_presets": {"a": {"voice": "nosuch"}}})
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["param"] == "voice_presets.a.voice" and "joe" in error["message"]
            assert (await op.get("/v1/models/tts-ghost")).status_code == 404
    run(scenario())
