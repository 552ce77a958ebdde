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

import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
import pytest
import yaml
from django.test import override_settings

from inference.runtime.context import KEYS, async_context, sync_scheduler
from inference.scheduler import LIVENESS_TTL_MS
from registry.selectors import deployment_backend

from .support.audio import TINY
from .support.bounds import MODEL_S, QUICK_S, run, until, within
from .support.clients import body, error_of, post
from .support.delay_relay import ask
from .support.multihost import NGINX, Rig, run_rig
from .support.netns import netns_problem
from .support.processes import ROOT, accepts_connections, free_port, need_program
from .support.stacks import FIXTURE_ENV, REDIS_BASE, assert_no_task_collected

pytestmark = pytest.mark.stack

REJOIN_CANDIDATES = 24
RIG_MODELS = [
    {"id": "vad", "family": "silero_vad", "task": "vad"},
    {"id": "fx", "family": "fixture", "slots": 1, "lazy": True},
    {"id": "orphans", "family": "fixture", "slots": 1, "lazy": True},
    *[{"id": f"c{i}", "family": "fixture", "slots": 1, "lazy": True} for i in range(6)],
    *[{"id": f"d{i}", "family": "fixture", "slots": 1, "lazy": True} for i in range(REJOIN_CANDIDATES)],
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
        assert health.json()["backend"] == "cpu"  # as both workers report (no GPU here)
        answers = [c.post("/v1/tasks/run", json=body(model, TINY)) for model in ("vad", "fx", "vad", "fx")]
    for resp in answers:
        assert resp.status_code == 200, resp.text
    assert rig.load_field("vad", "owner") in workers
    assert rig.load_field("fx", "owner") in workers
    assert rig.redis.hgetall(KEYS.worker_backend) == {name: "cpu" for name in workers}
    assert_nothing_held(rig)


# -- faults between hosts -------------------------------------------------------------------------
CUT_S = 60
"""How long the silent cut lasts: past redis-py's own keepalive (30 s idle, then 3 probes 5 s apart)."""

DEAD_BOUND_S = LIVENESS_TTL_MS / 1000 + 4
"""A host that stops beating is noticed when its liveness key lapses (10 s after its last beat), plus
the web process's next look (every 2 s) and 2 s of slack for a busy machine."""


def clients(rig: Rig, *names: str, timeout: float = QUICK_S) -> list[httpx.AsyncClient]:
    """Async clients of the web processes ``names`` (``web1``…) or of the ``proxy``."""
    urls = {"proxy": rig.proxy_url, **{n: m.url for n, m in rig.members.items() if m.role == "web"}}
    return [httpx.AsyncClient(base_url=urls[n], timeout=timeout, limits=httpx.Limits(max_connections=64))
            for n in names]


async def place_on(rig: Rig, client: httpx.AsyncClient, host: str, candidates: list[str],
                   pause_s: float = 0.0) -> str:
    """Request the lazy models ``candidates`` one by one (``pause_s`` apart) until one is loaded on
    ``host``'s worker (Celery hands each load to whichever worker asks first); that model's id."""
    for model in candidates:
        resp, _, _ = await post(client, model)
        assert resp.status_code == 200, resp.text
        if rig.worker_host(rig.load_field(model, "owner")) == host:
            return model
        await asyncio.sleep(pause_s)
    raise AssertionError(f"none of {candidates} was loaded on {host}")


def test_a_web_host_killed_with_requests_queued_strands_nothing_and_nginx_routes_around_it(rig):
    """R7.5/R8.2: web2 is killed (SIGKILL) with one request running on a worker (held at a barrier) and
    two queued, interleaved with two of web1. Its liveness key lapses within the liveness TTL; once the
    run ends the worker releases its lease, the grant pass drops its tickets, and web1's requests are
    served at once. Through the proxy every request is answered 200 while web2 is down (nginx's
    connection to it is refused, so it passes each request to web1); web2 restarted serves again."""
    rig.ensure()

    async def scenario():
        web1, web2, proxy = clients(rig, "web1", "web2", "proxy")
        async with web1, web2, proxy:
            assert (await post(proxy, "orphans"))[0].status_code == 200  # loaded: this test is about admission
            running = asyncio.create_task(post(web2, "orphans", barrier="orphans-run"))
            await until(lambda: rig.arrived("orphans-run") == 1)
            queued = []
            for i, c in enumerate((web2, web1, web2, web1)):
                queued.append(asyncio.create_task(post(c, "orphans", tag=str(i))))
                await until(lambda: rig.counters("orphans")["queued"] == i + 1)
            channels = rig.process_channels("orphans")
            dead, live = channels[0], channels[1]
            assert dead != live and channels == [dead, live, dead, live]
            killed_at = rig.kill("web2")
            for task in (running, queued[0], queued[2]):
                with pytest.raises(httpx.HTTPError):
                    await within(task)
            await until(lambda: not rig.redis.exists(dead + ":live"), DEAD_BOUND_S)
            assert time.monotonic() - killed_at < DEAD_BOUND_S
            through_proxy = await asyncio.gather(*(post(proxy, "vad") for _ in range(4)))
            assert [r.status_code for r, _, _ in through_proxy] == [200] * 4
            released_at = time.monotonic()
            rig.release("orphans-run")  # the worker ends that run and releases its lease (R8.2)
            for i in (1, 3):
                resp, _, answered_at = await within(queued[i])
                assert resp.status_code == 200 and resp.json()["tag"] == str(i), resp.text
                assert answered_at - released_at < 5  # far below one lease TTL
    run(scenario())
    rig.wait_idle("orphans")
    rig.ensure()
    assert_nothing_held(rig)


def test_a_worker_host_cut_off_loses_its_runs_then_rejoins_without_answering_from_stale_pools(rig):
    """w2's link is cut while it runs a request (held at a barrier): the client gets 503
    ``worker_lost`` within the liveness TTL, the lease is given back, and the model reloads on w1.
    The link restored, w2 beats again and takes new loads; the stale run it finishes afterwards
    answers nobody and changes no counter, and the model keeps answering from w1's pool."""
    rig.ensure()
    w1 = rig.members["w1"].name

    async def scenario():
        (proxy,) = clients(rig, "proxy", timeout=MODEL_S)
        async with proxy:
            model = await place_on(rig, proxy, "w2", [f"c{i}" for i in range(6)])
            held = asyncio.create_task(post(proxy, model, barrier="cut-run"))
            await until(lambda: rig.arrived("cut-run") == 1)
            rig.net.cut("w2")
            cut_at = time.monotonic()
            try:
                resp, _, answered_at = await within(held, DEAD_BOUND_S + 10)
                assert resp.status_code == 503 and resp.json()["error"]["code"] == "worker_lost", resp.text
                assert answered_at - cut_at < DEAD_BOUND_S
                assert rig.counters(model) == {"leases": 0, "queued": 0}
                again, _, _ = await post(proxy, model)
                assert again.status_code == 200, again.text
                assert rig.load_field(model, "owner") == w1
                pool = again.json()["pool_id"]
            finally:
                rig.net.restore("w2")
                restored_at = time.monotonic()
            w2 = rig.members["w2"].name
            await until(lambda: rig.redis.exists(KEYS.worker_live(w2)), 60)
            rig.release("cut-run")  # the stale run on w2 ends now, long after its client was answered
            await until(lambda: rig.redis.llen(KEYS.fixture_release("cut-run")) == 0, 60)
            await asyncio.sleep(1)
            for _ in range(3):
                resp, _, _ = await post(proxy, model)
                assert resp.status_code == 200 and resp.json()["pool_id"] == pool, resp.text
            assert rig.load_field(model, "owner") == w1
            # w2 takes work again once its task consumer's connection delivers again: TCP retransmits
            # with a doubling delay, or the connection is opened anew after TCP_USER_TIMEOUT (30 s).
            await place_on(rig, proxy, "w2", [f"d{i}" for i in range(REJOIN_CANDIDATES)], pause_s=2)
            print(f"w2 took a load {time.monotonic() - restored_at:.1f} s after its link came back")
    run(scenario(), 240)
    assert_nothing_held(rig)


def test_a_web_host_cut_off_redis_leaves_nginxs_rotation_and_serves_again_once_restored(rig):
    """web1 is cut off the Redis path (a firewall that rejects: new connections refused, open ones
    reset). With ``refuse_connections_when_unready`` (set as docs/operations.md tells an operator
    behind nginx) web1 refuses connections within a second, so every request through the proxy is
    answered 200 (nginx passes each refused one to web2), and web2 serves directly too. Restored,
    web1 accepts again within a second and serves without a restart, and nothing is held."""
    rig.ensure()
    web1_address = urlsplit(rig.members["web1"].url)

    async def scenario():
        web1, web2, proxy = clients(rig, "web1", "web2", "proxy")
        async with web1, web2, proxy:
            assert (await post(web1, "fx"))[0].status_code == 200
            assert [(await post(proxy, "fx"))[0].status_code for _ in range(4)] == [200] * 4  # kept alive
            cut_at = time.monotonic()
            rig.cut_off_redis("web1")
            try:
                await until(lambda: not accepts_connections(web1_address.hostname, web1_address.port), 1.0)
                refused_s = time.monotonic() - cut_at
                through_proxy = [(await post(proxy, "fx"))[0] for _ in range(6)]
                assert [r.status_code for r in through_proxy] == [200] * 6, [r.text[:200] for r in through_proxy]
                assert (await post(web2, "fx"))[0].status_code == 200
            finally:
                rig.net.unblock("web1", "relay")
            restored_at = time.monotonic()
            await until(lambda: accepts_connections(web1_address.hostname, web1_address.port), 2.0)
            print(f"web1 refused connections {refused_s * 1000:.0f} ms after the cut and accepted again "
                  f"{(time.monotonic() - restored_at) * 1000:.0f} ms after the link was restored")
            answers = [(await post(web1, "fx"))[0] for _ in range(6)]
            assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
            concurrent = await asyncio.gather(*(post(web1, "vad") for _ in range(8)))
            assert [r.status_code for r, _, _ in concurrent] == [200] * 8
    run(scenario())
    rig.wait_idle("fx")
    assert_nothing_held(rig)



def test_a_web_host_cut_off_silently_notices_it_and_serves_again_once_restored(rig):
    """web1's link is taken down at the bridge for 60 s (its packets dropped, nobody told). Its
    liveness beat, sent into the cut, fails after ``REDIS_USER_TIMEOUT_MS`` (30 s) instead of waiting on
    TCP's retransmissions, and its idle subscription is found dead by keepalive: both are logged within
    40 s of the cut, and the event loop stays free (a failed subscription socket used to make every read
    return at once: the loop spun at full CPU for good once keepalive gave up, 45 s into a cut). Once
    the link is back, the beat and the subscription recover within seconds, web1 serves again, and
    nothing is held."""
    rig.ensure()
    member = rig.members["web1"]

    def logged_since(offset: int, *texts: str) -> bool:
        tail = member.log_path.read_bytes()[offset:]
        return all(text.encode() in tail for text in texts)

    async def scenario():
        (web1,) = clients(rig, "web1")
        async with web1:
            assert (await post(web1, "fx"))[0].status_code == 200
        before_cut = member.log_path.stat().st_size
        cpu_before = psutil.Process(member.proc.pid).cpu_times()
        rig.net.cut("web1")
        cut_at = time.monotonic()
        try:
            await until(lambda: logged_since(before_cut, "liveness beat of", "lost its subscription"), 40)
            noticed_s = time.monotonic() - cut_at
            await asyncio.sleep(max(0.0, CUT_S - noticed_s))
        finally:
            before_restore = member.log_path.stat().st_size
            rig.net.restore("web1")
            restored_at = time.monotonic()
        cpu_after = psutil.Process(member.proc.pid).cpu_times()
        cut_cpu_s = cpu_after.user + cpu_after.system - cpu_before.user - cpu_before.system
        assert cut_cpu_s < CUT_S / 4, f"web1 used {cut_cpu_s:.1f} s of CPU during the {CUT_S} s cut"
        await until(lambda: logged_since(before_restore, "succeeded again", "subscribed again"), 10)
        recovered_s = time.monotonic() - restored_at
        (web1,) = clients(rig, "web1")
        async with web1:
            answers = [(await post(web1, "fx"))[0] for _ in range(4)]
            assert [r.status_code for r in answers] == [200] * 4, [r.text[:200] for r in answers]
        print(f"web1 noticed the silent cut after {noticed_s:.1f} s, used {cut_cpu_s:.2f} s of CPU during it; "
              f"beat and subscription back {recovered_s:.1f} s after the restore")
    run(scenario(), 180)
    rig.wait_idle("fx")
    assert_nothing_held(rig)


def test_redis_restarted_with_its_state_lost_is_recovered_without_restarting_a_process(rig):
    """Redis is killed and started again empty (same address and password). Without a restart of any
    web process or worker: every worker beats again, the registry is published again from the
    database, a model that was loaded is loaded again on demand and answers, and every counter is
    zero."""
    rig.ensure()
    pids = {name: m.pid for name, m in rig.members.items()}

    async def scenario():
        (proxy,) = clients(rig, "proxy", timeout=MODEL_S)
        async with proxy:
            assert (await post(proxy, "vad"))[0].status_code == 200
            rig.kill_redis()
            killed_at = time.monotonic()
            webs = [urlsplit(rig.members[name].url) for name in ("web1", "web2")]
            # measured 10-20 ms on a quiet machine; the bound leaves room for a loaded CI run
            await until(lambda: not any(accepts_connections(web.hostname, web.port) for web in webs), 5.0)
            print(f"both web processes refused connections {time.monotonic() - killed_at:.3f} s after the kill")
            resp, _, _ = await post(proxy, "vad")  # no web process accepts: nginx's answer, in the API's shape
            assert error_of(resp, (503,))["code"] == "no_web_process" and resp.headers["Retry-After"] == "1"
            rig.start_redis()
            workers = [m.name for m in rig.members.values() if m.role == "worker"]
            await until(lambda: all(rig.redis.exists(KEYS.worker_live(w)) for w in workers), QUICK_S)
            deadline = time.monotonic() + QUICK_S
            while True:
                answers = [(await post(proxy, model))[0] for model in ("vad", "fx", "vad", "fx")]
                if all(r.status_code == 200 for r in answers):
                    break
                assert time.monotonic() < deadline, [(r.status_code, r.text[:200]) for r in answers]
                await asyncio.sleep(1)
    run(scenario())
    assert {name: m.pid for name, m in rig.members.items()} == pids  # nothing was restarted
    logs = [m.log_path.read_text(errors="replace") for m in rig.members.values() if m.role == "worker"]
    assert any("again from the database" in log for log in logs)
    for member in rig.members.values():  # the web processes' port gates followed Redis all along
        assert_no_task_collected(member.log_path.read_text(errors="replace"))
    assert_nothing_held(rig)


LATENCY_MS, JITTER_MS = 20, 5
LATENCY_REQUESTS = 20


def test_latency_between_web_and_redis_adds_the_documented_round_trips_and_breaks_no_rule(rig):
    """20 ms ± 5 ms between the web processes and Redis (the relay; this kernel has no sch_netem):
    FIFO still holds across web1 and web2 (R2.1), every answer is 200, nothing is held; and a short
    request's time grows by its Redis round trips on the critical path times the delay. Prints the
    round trips per request counted by the relay and the growth of the median time."""
    rig.ensure()
    web1 = rig.members["web1"].url
    rig.timed_requests(web1, "fx", 1, TINY)  # loaded
    base_walls, base_trips = rig.timed_requests(web1, "fx", LATENCY_REQUESTS, TINY)
    rig.relay(f"delay {LATENCY_MS} {JITTER_MS}")

    async def fifo_across_web_processes():
        c1, c2 = clients(rig, "web1", "web2")
        async with c1, c2:
            holder = asyncio.create_task(post(c1, "fx", barrier="lat-hold"))
            await until(lambda: rig.arrived("lat-hold") == 1)
            queued = []
            for i in range(6):
                queued.append(asyncio.create_task(post((c1, c2)[i % 2], "fx", barrier=f"lat-{i}", tag=str(i))))
                await until(lambda: rig.counters("fx")["queued"] == i + 1)
            rig.release("lat-hold")
            for i in range(6):
                await until(lambda: rig.arrived(f"lat-{i}") == 1)
                assert not any(rig.arrived(f"lat-{j}") for j in range(i + 1, 6)), "a later request barged"
                rig.release(f"lat-{i}")
                resp, _, _ = await within(queued[i])
                assert resp.status_code == 200 and resp.json()["tag"] == str(i)
            assert (await within(holder))[0].status_code == 200

    try:
        slow_walls, slow_trips = rig.timed_requests(web1, "fx", LATENCY_REQUESTS, TINY)
        run(fifo_across_web_processes(), 240)
    finally:
        rig.relay("delay 0 0")
    growth_ms = (statistics.median(slow_walls) - statistics.median(base_walls)) * 1000
    print(f"web->Redis round trips per short request: {base_trips:.2f} (no delay), {slow_trips:.2f} "
          f"({LATENCY_MS} ms); median wall {statistics.median(base_walls) * 1000:.1f} ms -> "
          f"{statistics.median(slow_walls) * 1000:.1f} ms (+{growth_ms:.1f} ms = {growth_ms / LATENCY_MS:.2f} delays)")
    # The documented short path makes two sequential round trips (admission probe, then the enqueue
    # that grants and dispatches; the answer comes back on pub/sub): at least two delays, and at most
    # two more than the relay counted (each delayed hop wakes the relay once more, which a busy
    # two-core machine serves late: 3.8 delays were seen while other suites ran).
    assert 2 * (LATENCY_MS - JITTER_MS) <= growth_ms <= (base_trips + 2) * (LATENCY_MS + JITTER_MS)
    rig.wait_idle("fx")
    assert_nothing_held(rig)


def test_pooled_redis_connections_reset_by_the_network_are_opened_again_not_answered_503(tmp_path):
    """A web process's pooled Redis connections reset (a firewall, a Redis host rebooted) or closed by
    Redis (a restart, ``CLIENT KILL``) while idle are opened again when next used: five concurrent
    commands after each all succeed (before, each such connection failed its next command, a 503
    ``redis_unavailable``, whenever it was used). Loopback, through the delay relay, which resets
    them; no namespace needed."""
    upstream = urlsplit(REDIS_BASE)
    listen, control = free_port(), free_port()
    log_path = tmp_path / "relay.log"
    with open(log_path, "wb") as log:
        relay = subprocess.Popen([sys.executable, "-m", "tests.support.delay_relay", f"127.0.0.1:{listen}",
                                  f"{upstream.hostname}:{upstream.port}", f"127.0.0.1:{control}"],
                                 cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + QUICK_S
        while b"relay ready" not in log_path.read_bytes():
            assert relay.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        url = f"redis://127.0.0.1:{listen}/15"  # the test Redis has no password (tests/redis_per_worker.py)

        async def scenario():
            ctx = await async_context()
            try:
                assert await asyncio.gather(*(ctx.redis.ping() for _ in range(5))) == [True] * 5
                assert ask(("127.0.0.1", control), "abort 127.0.0.1").startswith("aborted ")
                await asyncio.sleep(0.2)
                assert await asyncio.gather(*(ctx.redis.ping() for _ in range(5))) == [True] * 5
                await ctx.redis.client_kill_filter(_type="normal", skipme=True)  # closed by Redis (FIN)
                await asyncio.sleep(0.2)
                assert await asyncio.gather(*(ctx.redis.ping() for _ in range(5))) == [True] * 5
            finally:
                await ctx.listener.close()

        with override_settings(REDIS_URL=url):
            run(scenario(), QUICK_S)
    finally:
        relay.kill()
        relay.wait(timeout=QUICK_S)


# -- the container deployment ---------------------------------------------------------------------
COMPOSE = shutil.which("docker-compose")
COMPOSE_ENV = {"AUDIOSITE_SECRET_KEY": "a-secret-of-at-least-32-characters-for-the-parser",
               "AUDIOSITE_PUBLIC_HOST": "audio.example.com"}


def compose_config(compose: str, *files: str) -> subprocess.CompletedProcess:
    """``docker-compose -f FILE… config``: the files merged and checked against the Compose
    specification's schema (an unknown key, a wrong type or a bad reference is an error)."""
    args = [arg for name in files for arg in ("-f", name)]
    return subprocess.run([compose, *args, "config"], cwd=ROOT, env={**os.environ, **COMPOSE_ENV},
                          capture_output=True, text=True, timeout=QUICK_S)


def test_the_compose_file_and_its_gpu_variant_pass_the_compose_parser(tmp_path):
    """docker-compose.yml alone and with docker-compose.gpu.yml are valid Compose files (Docker's own
    parser, ``docker-compose config``); in the GPU variant the worker alone is built with
    ``AUDIOSITE_CUDA=1`` and reserves one NVIDIA GPU in the ``deploy.resources.reservations.devices``
    form. The parser is no rubber stamp: a misspelt key under that reservation is refused."""
    compose = need_program(COMPOSE, "docker-compose (Docker's Compose file parser)", "docker-compose")
    plain = compose_config(compose, "docker-compose.yml")
    assert plain.returncode == 0, plain.stderr
    gpu = compose_config(compose, "docker-compose.yml", "docker-compose.gpu.yml")
    assert gpu.returncode == 0, gpu.stderr
    services = yaml.safe_load(gpu.stdout)["services"]
    worker = services["worker"]
    assert worker["build"]["args"] == {"AUDIOSITE_CUDA": "1"}
    assert worker["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert all("deploy" not in services[name] and "args" not in services[name].get("build", {})
               for name in ("web", "init", "warmup"))
    assert "deploy" not in yaml.safe_load(plain.stdout)["services"]["worker"]  # the CPU default reserves nothing
    bad = tmp_path / "docker-compose.bad.yml"
    bad.write_text((ROOT / "docker-compose.gpu.yml").read_text().replace("capabilities:", "capability:"))
    refused = compose_config(compose, "docker-compose.yml", str(bad))
    assert refused.returncode != 0 and "capability" in refused.stderr, refused.stderr


def test_the_image_adds_the_cuda_libraries_only_when_asked_and_pins_them():
    """The Dockerfile's build argument ``AUDIOSITE_CUDA`` defaults to 0 (the CPU image) and installs
    requirements-cuda.txt only at 1; that file pins every NVIDIA wheel exactly, for the CUDA majors the
    installed onnxruntime-gpu and CTranslate2 were built for (13 and 12: their libraries' sonames)."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG AUDIOSITE_CUDA=0" in dockerfile
    assert '"$AUDIOSITE_CUDA" = "1" ]; then' in dockerfile and "-r requirements-cuda.txt" in dockerfile
    pins = dict(line.split("==") for line in (ROOT / "requirements-cuda.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    assert all(re.fullmatch(r"[0-9.]+", version) for version in pins.values()), pins
    site = Path(sysconfig.get_paths()["purelib"])
    ort_cuda = (site / "onnxruntime" / "capi" / "libonnxruntime_providers_cuda.so").read_bytes()
    ct2 = b"".join(path.read_bytes() for path in (site / "ctranslate2.libs").glob("libctranslate2*"))
    assert b"libcublas.so.13" in ort_cuda and pins["nvidia-cublas"].startswith("13.")
    assert b"libcudart.so.13" in ort_cuda and pins["nvidia-cuda-runtime"].startswith("13.")
    assert b"libcublas.so.12" in ct2 and pins["nvidia-cublas-cu12"].startswith("12.")


def test_health_says_cuda_only_when_every_live_worker_reports_cuda_sessions(redis_client):
    """``/health``'s backend comes from the workers (each reports what its own probe found with its
    beat, ``Keys.worker_backend``): 'cuda' only when every live worker's sessions get CUDA, 'cpu' as
    soon as one live worker's do not, the web process's own probe when no worker is alive. A dead
    worker's report counts for nothing and goes with its other registry entries."""
    for host, backend in (("gpu-a@h1", "cuda"), ("gpu-b@h2", "cpu"), ("gpu-c@h3", "cuda")):
        redis_client.hset(KEYS.worker_pid, host, 1)
        redis_client.hset(KEYS.worker_backend, host, backend)
    redis_client.set(KEYS.worker_live("gpu-a@h1"), "boot-a", px=10000)
    redis_client.set(KEYS.worker_live("gpu-b@h2"), "boot-b", px=10000)  # gpu-c@h3's key has lapsed
    scheduler = sync_scheduler()
    census = scheduler.census()
    assert (census.live_workers, census.cuda_workers) == (2, 1)
    assert deployment_backend(census, "cuda") == "cpu"
    redis_client.hset(KEYS.worker_backend, "gpu-b@h2", "cuda")
    assert deployment_backend(scheduler.census(), "cpu") == "cuda"
    assert scheduler.forget_departed_workers() == ["gpu-c@h3"]
    assert set(redis_client.hgetall(KEYS.worker_backend)) == {"gpu-a@h1", "gpu-b@h2"}
    redis_client.delete(KEYS.worker_live("gpu-a@h1"), KEYS.worker_live("gpu-b@h2"))
    assert deployment_backend(scheduler.census(), "cpu") == "cpu"  # nobody alive: this process's own probe
