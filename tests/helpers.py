"""Helpers shared by the test modules (fixtures live in conftest.py).

Test modules import from here and never from each other. Named actors:
- ``Stack`` / ``run_stack``: ``manage.py serve`` run as a user would (daphne + one Celery
  worker) against a fresh PostgreSQL database and a Redis database, pinned to the CPU
  backend so the suite gives the same answers on a machine with a GPU.
- ``post`` / ``body`` / ``mclient``: requests to a stack, every one bounded (client timeouts
  of a few tens of seconds; ``run`` and ``within`` bound whole scenarios and single awaits).
- ``fx``: a management entry of the fixture family (barriers, injected failures).
- ``web_pid`` / ``raw_exchange``: the daphne process of a stack, and one HTTP/1.1 exchange
  written by hand on a socket (for bodies no HTTP client would send: a false Content-Length).
- ``worker_pid`` / ``proc_environ`` / ``proc_threads``: the stack's worker process as the kernel sees it.
- ``worker_pids`` / ``live_workers``: the Celery worker processes of a stack, and the workers its
  Redis counts as alive (liveness key present).
- ``Rig``: one simulated web process on Redis database 15 (async client, scheduler, listener) for
  the scheduler's own tests.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import secrets
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
import psutil
import psycopg
import redis
import redis.asyncio as aioredis
import soundfile
from django.core.management import call_command
from inference import specs
from inference.management.commands.serve import worker_argv
from inference.adapters import get_adapter
from inference.adapters.base import LoadContext
from inference.runtime.context import KEYS as RUNTIME_KEYS
from inference.runtime.context import async_context
from inference.scheduler import Keys, Listener, LoadEnd, Scheduler
from gate import evidence

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "samples"
"""The speech the suite uses: two LibriSpeech utterances with their reference transcripts, in the repo
(``samples/README.md``: source and licence), so a clone tests with nothing beside it."""
REDIS_BASE = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15").rsplit("/", 1)[0]
PG_BASE = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/audiosite").rsplit("/", 1)[0]
FIXTURE_ENV = {"AUDIOSITE_ENABLE_FIXTURE_FAMILY": "1"}

# Bounds: a test expecting a quick answer fails after QUICK_S, not at pytest's 600 s timeout;
# requests that load or run a real model (Whisper, Silero) get MODEL_S.
QUICK_S = 30.0
MODEL_S = 60.0
SCENARIO_S = 120.0


# -- bounded waiting -----------------------------------------------------------------------------
async def within(aw, seconds: float = QUICK_S):
    """Await ``aw`` (a coroutine, task or future) for at most ``seconds``; an AssertionError names the bound."""
    bound = asyncio.timeout(seconds)
    try:
        async with bound:
            return await aw
    except TimeoutError:
        if bound.expired():
            raise AssertionError(f"not done within {seconds:g} s") from None
        raise


def run(coro, seconds: float = SCENARIO_S):
    """Run an async scenario to completion, bounded as a whole (each await inside has its own bound)."""
    return asyncio.run(within(coro, seconds))


async def until(predicate, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


# -- audio ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Utterance:
    """A fixture file: ``wav`` bytes, mono float32 ``samples`` at ``rate`` Hz, reference ``text``."""

    name: str
    wav: bytes
    samples: np.ndarray
    rate: int
    text: str


def load_speech() -> list[Utterance]:
    items = []
    for wav in sorted(FIXTURES.glob("*.wav")):
        data = wav.read_bytes()
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
        items.append(Utterance(wav.stem, data, samples, rate, wav.with_suffix(".txt").read_text().strip()))
    return items


def wav_bytes(samples: np.ndarray, rate: int, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    """Encode float32 samples with soundfile."""
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def wav_fmt(rate: int = 16000, channels: int = 1, bits: int = 16, tag: int = 1, extra: bytes = b"") -> bytes:
    """The body of a WAVE ``fmt `` chunk (16 bytes: format ``tag``, 1 = integer PCM; ``channels``; ``rate``
    in Hz; byte rate and block align derived from them and ``bits``), then ``extra`` (cbSize and beyond)."""
    align = channels * bits // 8
    return struct.pack("<HHIIHH", tag, channels, rate, rate * align, align, bits) + extra


def riff_wave(*chunks: tuple[bytes, bytes], declared: dict[bytes, int] | None = None,
              riff_size: int | None = None, pad_last: bool = True) -> bytes:
    """A RIFF/WAVE file of ``(chunk id, body)`` chunks in the order given, each padded to an even size
    (the last one only with ``pad_last``: without, an odd last chunk ends the file unpadded).

    ``declared`` maps a chunk id to the size its header states instead of its real size; ``riff_size``
    is the RIFF header's size field (default: the real one). Built byte by byte, so tests can write
    the layouts no encoder writes (a chunk before ``fmt ``, lying sizes, 8,000 empty chunks)."""
    out = b""
    for index, (chunk_id, chunk_body) in enumerate(chunks):
        size = (declared or {}).get(chunk_id, len(chunk_body))
        pad = len(chunk_body) % 2 and (pad_last or index < len(chunks) - 1)
        out += chunk_id + size.to_bytes(4, "little") + chunk_body + (b"\0" if pad else b"")
    return b"RIFF" + (len(out) + 4 if riff_size is None else riff_size).to_bytes(4, "little") + b"WAVE" + out


def pcm_wav(pcm: bytes, rate: int = 16000, channels: int = 1, bits: int = 16, tag: int = 1,
            claim: int | None = None, between: Iterable[tuple[bytes, bytes]] = (), fmt_extra: bytes = b"") -> bytes:
    """A RIFF/WAVE of ``fmt `` (:func:`wav_fmt`, then ``fmt_extra``), the ``between`` chunks, then ``data``
    holding ``pcm`` (raw sample bytes; odd-sized, it ends the file unpadded) whose size field says ``claim``
    (default: its real size). With the defaults the canonical 44-byte-header layout the server reads as-is
    (``inference.audio.plain_pcm16_wav``)."""
    declared = {} if claim is None else {b"data": claim}
    return riff_wave((b"fmt ", wav_fmt(rate, channels, bits, tag, fmt_extra)), *between, (b"data", pcm),
                     declared=declared, pad_last=False)


def adapter_session(family: str):
    """Slot 0's session of ``family``'s packaged checkpoint, loaded in this process on the CPU with one
    thread and default options (for comparing the server's answers with a direct adapter call)."""
    ctx = LoadContext(specs.resolve_checkpoint(family, None), "cpu", 0, 1, {}, {})
    adapter = get_adapter(family)
    return adapter.new_session(adapter.load(specs.get_spec(family), ctx), 0)


def without_timing(answer: dict | httpx.Response) -> dict:
    """An answer's JSON body (given as a dict or a response) without ``timing``, which differs between two
    runs of the same request: what must be equal when outputs are compared."""
    payload = answer.json() if isinstance(answer, httpx.Response) else answer
    return {key: value for key, value in payload.items() if key != "timing"}


def error_of(resp: httpx.Response, statuses: tuple[int, ...]) -> dict:
    """The ``error`` of a refusal whose status is one of ``statuses``, checked against the documented shape
    (``message``, ``type``, ``param``, ``code``; a 503 is ``server_busy`` with ``Retry-After``, any other an
    ``invalid_request_error``)."""
    assert resp.status_code in statuses, (resp.status_code, resp.text[:400])
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if resp.status_code == 503:
        assert error["type"] == "server_busy" and "retry-after" in resp.headers, (error, resp.headers)
    else:
        assert error["type"] == "invalid_request_error", error
    return error


def openai_client(stack) -> openai.OpenAI:
    """The official OpenAI SDK pointed at ``stack`` (no retries; a model-sized timeout)."""
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=MODEL_S)


def padded(utt: Utterance, seconds: float = 1.5) -> np.ndarray:
    """The utterance with ``seconds`` of digital silence before and after."""
    pad = np.zeros(int(seconds * utt.rate), dtype=np.float32)
    return np.concatenate([pad, utt.samples, pad])


def long_speech(speech: list[Utterance], seconds: float) -> bytes:
    """A WAV of the fixtures repeated to about ``seconds`` (a slow Whisper request)."""
    parts, total = [], 0.0
    while total < seconds:
        for utt in speech:
            parts.append(utt.samples)
            total += len(utt.samples) / utt.rate
    return wav_bytes(np.concatenate(parts), speech[0].rate)


TINY = wav_bytes(np.zeros(1600, dtype=np.float32), 16000)


def silent_flac(seconds: float, rate: int = 16000, channels: int = 1) -> bytes:
    """A 16-bit FLAC of ``round(seconds * rate)`` frames of digital silence (compresses to almost nothing:
    30 min of 16 kHz mono is 89 KB), written in 10 s pieces so no long array is ever built."""
    buf = io.BytesIO()
    piece = np.zeros((rate * 10, channels), dtype=np.float32)
    left = round(seconds * rate)
    with soundfile.SoundFile(buf, "w", rate, channels, format="FLAC", subtype="PCM_16") as out:
        while left > 0:
            out.write(piece[:left])
            left -= min(left, len(piece))
    return buf.getvalue()


def flac_without_length(flac: bytes) -> bytes:
    """``flac`` with STREAMINFO's total samples set to 0, "unknown" (FLAC format specification: the 36 bits
    after the rate, channels and bits per sample, bytes 21-25 of a file starting with ``fLaC`` and its
    STREAMINFO block), as a streaming encoder writes it; everything else unchanged."""
    data = bytearray(flac)
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0, "fLaC then a STREAMINFO block"
    data[21] &= 0xF0
    data[22:26] = bytes(4)
    return bytes(data)


# -- the server stack ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


RIG_TTL_MS = 1000
GRANT_MARGIN_S = 5.0
"""How long past a request's own timeout a test waits for the scheduler's answer (grant or 503)."""


class Rig:
    """One simulated web process on Redis database 15: ``redis`` (async, str replies), ``scheduler``
    (``ttl_ms`` leases and claims) and a started ``listener`` (``async with``)."""

    def __init__(self, keys: Keys, ttl_ms: int = RIG_TTL_MS):
        self.keys = keys
        self.ttl_ms = ttl_ms

    async def __aenter__(self):
        self.redis = aioredis.Redis.from_url(f"{REDIS_BASE}/15", decode_responses=True)
        self.scheduler = Scheduler(self.redis, self.keys, self.ttl_ms)
        self.listener = await Listener.start(self.redis, self.keys.process_channel)
        return self

    async def __aexit__(self, *exc):
        await self.listener.close()
        await self.redis.aclose()

    async def acquire(self, model_id: str, timeout_ms: int, kind: str = "request"):
        """The scheduler's ``acquire`` through this rig's listener, bounded: a grant (or refusal) that never
        comes fails the test after the request's own timeout plus ``GRANT_MARGIN_S`` (``QUICK_S`` for an
        unbounded request, ``timeout_ms`` 0) with an AssertionError naming the bound, not at the
        scenario's or pytest's limit."""
        bound_s = QUICK_S if timeout_ms == 0 else timeout_ms / 1000 + GRANT_MARGIN_S
        return await within(self.scheduler.acquire(self.listener, model_id, timeout_ms, kind), bound_s)

    async def counts(self, model_id: str) -> tuple[int, int]:
        """``(active leases, queued)`` of ``model_id``."""
        snap = await self.scheduler.snapshot([model_id])
        return snap[model_id]["active_leases"], snap[model_id]["queued"]

    async def lost_load(self, model_id: str, loader: str, waiters: Iterable[str], error: str = "worker w was lost"):
        """``loader`` claims a load of ``model_id``, each of ``waiters`` waits for it, then it is ended
        ``worker_lost`` (its worker died, R7.4): the waiters' wake-ups are published (unread)."""
        assert (await self.scheduler.begin_load(self.listener, model_id, loader)).action == "load"
        for waiter in waiters:
            assert (await self.scheduler.begin_load(self.listener, model_id, waiter)).action == "wait"
        assert await self.scheduler.finish_load(model_id, loader, LoadEnd.WORKER_LOST, error=error) == "ok"

    async def model_keys(self, model_id: str) -> dict[str, dict]:
        """Every Redis hash of the model's load protocol, as it stands."""
        base = self.keys.model(model_id)
        return {"load": await self.redis.hgetall(base + ":load"),
                "loadwait": await self.redis.hgetall(base + ":loadwait")}


# -- load_single_flight on a real AsyncContext (the adversary load tests) ---------------------------
def live_worker(redis_client, hostname: str, ttl_ms: int = 30000) -> str:
    """Register ``hostname`` as a live worker exactly as its liveness beat does (the ``as:`` keys of
    ``inference.runtime.context.KEYS``); returns its boot id."""
    boot = "boot-" + hostname
    redis_client.set(RUNTIME_KEYS.worker_live(hostname), boot, px=ttl_ms)
    redis_client.hset(RUNTIME_KEYS.worker_pid, hostname, os.getpid())
    return boot


async def load_contexts(claim_ttl_ms: int):
    """This loop's web-process context with ``claim_ttl_ms`` claims, and the same process with a deaf
    listener: one never subscribed, so it hears no wake-up and only looks on its timer."""
    base = await async_context()
    ctx = dataclasses.replace(base, scheduler=Scheduler(base.redis, RUNTIME_KEYS, claim_ttl_ms))
    deaf = Listener(base.redis, RUNTIME_KEYS.process_channel("deaf-" + unique_prefix()))
    deaf.loop = asyncio.get_running_loop()
    return ctx, dataclasses.replace(ctx, listener=deaf)


async def claim_started_by(ctx, model_id: str, token: str, host: str, boot: str, force: bool = False) -> None:
    """Claim the load as a caller would (``token``), and start it as worker ``host``'s load task does."""
    assert (await ctx.scheduler.begin_load(ctx.listener, model_id, token, force)).action == "load"
    assert await ctx.scheduler.renew_load(model_id, token, host, boot) == 1


async def outcome_of(task, seconds: float = 10):
    """What ``task`` returned or raised, within ``seconds``."""
    return (await within(asyncio.gather(task, return_exceptions=True), seconds))[0]


class Deployment:
    """What every test deployment offers: its Redis db (``redis``), database (``dsn``) and process
    environment (``env``), ``manage.py`` against them, and the scheduler's and fixture barriers'
    Redis keys read directly. :class:`Stack` (one ``manage.py serve``) and :class:`Cluster`
    (web processes and workers started one by one) are deployments."""

    redis: redis.Redis
    dsn: str
    env: dict

    def manage(self, *args: str, timeout: float = MODEL_S, env: dict | None = None) -> subprocess.CompletedProcess:
        """Run ``manage.py <args>`` against this stack (its database and Redis; ``env`` adds variables)."""
        return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout)

    def manage_async(self, *args: str) -> subprocess.Popen:
        """Start ``manage.py <args>`` against this stack without waiting."""
        return subprocess.Popen([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def counters(self, model_id: str) -> dict:
        """Live request leases and queued requests of a model, read straight from Redis (managers not counted)."""
        base = f"as:m:{{{model_id}}}"
        pipe = self.redis.pipeline(transaction=True)
        pipe.hlen(base + ":leases").zcard(base + ":queue").hlen(base + ":kind")
        leases, queued, managers = pipe.execute()
        return {"leases": leases, "queued": queued - managers}

    def managers(self, model_id: str) -> dict:
        """Held and queued manager tickets of a model."""
        base = f"as:m:{{{model_id}}}"
        return {"held": self.redis.hlen(base + ":mleases"), "queued": self.redis.hlen(base + ":kind")}

    # -- barriers of the fixture family (inference/tasks.py: barrier) --
    def arrived(self, name: str) -> int:
        return int(self.redis.get(f"as:fixture:arrived:{name}") or 0)

    def wait_arrived(self, name: str, count: int = 1, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while self.arrived(name) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"barrier {name!r}: {self.arrived(name)} of {count} arrived")
            time.sleep(0.01)

    def release(self, name: str, count: int = 1, action: str = "go") -> None:
        if count > 0:
            self.redis.lpush(f"as:fixture:release:{name}", *([action] * count))

    def wait_idle(self, model_id: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.counters(model_id) == {"leases": 0, "queued": 0}:
                return
            time.sleep(0.05)
        raise AssertionError(f"{model_id} did not drain: {self.counters(model_id)}")

    def sql(self, query: str, *params) -> list[tuple]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return conn.execute(query, params).fetchall()


@dataclass
class Stack(Deployment):
    """A running ``manage.py serve`` (``proc``, answering at ``url``, output in ``log_path``) and
    handles to its Redis and database."""

    url: str
    redis: redis.Redis
    dsn: str
    proc: subprocess.Popen
    log_path: Path
    media_root: Path
    env: dict

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", MODEL_S), **kw)

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


STACK_MAX_BODY_BYTES = 3_000_000


@dataclass
class Setup:
    """The files, database and Redis db of one test deployment, before any process runs.

    ``config`` is the ``server.json`` written at ``config_path``; ``media`` holds copies of the
    speech fixtures (a ``media_roots`` entry); ``db_name`` is a fresh PostgreSQL database at
    ``dsn``; ``redis`` is a client of the flushed Redis db at ``redis_url``; ``env`` is the
    environment every process of the deployment gets (the caller's, minus its AUDIOSITE_*
    variables, plus the database, Redis, var folder and ``extra_env``).
    """

    tmp: Path
    config: dict
    config_path: Path
    media: Path
    db_name: str
    dsn: str
    redis_url: str
    redis: redis.Redis
    env: dict


def prepare_stack(tmp: Path, models: list[dict], *, redis_db: int, name: str, extra_env: dict | None = None,
                  extra_config: dict | None = None) -> Setup:
    """Write the configuration, create the database ``audiosite_<name>_<pid>`` (dropped first if a
    crashed run left it) and flush Redis db ``redis_db``.

    The configuration pins ``"backend": "cpu"``, a 3 s lease TTL and a 5 s ``shutdown_timeout_ms``
    (``extra_config`` overrides any key): the tests assert CPU admission tables, ``/health`` backends
    and start-up lines, on any machine."""
    media = tmp / "media"
    media.mkdir()
    for wav in FIXTURES.glob("*.wav"):
        (media / wav.name).write_bytes(wav.read_bytes())
    # shutdown_timeout_ms 5 s: a stack stopped with a run still held somewhere drains for at most 5 s
    # (not the default 30 s) before it is answered 503, so teardowns stay quick.
    config = {"host": "127.0.0.1", "port": free_port(), "backend": "cpu", "lease_ttl_ms": 3000,
              "shutdown_timeout_ms": 5000,
              "media_roots": [str(media)], "max_request_body_bytes": STACK_MAX_BODY_BYTES, "models": models,
              **(extra_config or {})}
    config_path = tmp / "server.json"
    config_path.write_text(json.dumps(config, indent=2))

    db_name = f"audiosite_{name}_{os.getpid()}"
    with psycopg.connect(f"{PG_BASE}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{db_name}"')
    redis_url = f"{REDIS_BASE}/{redis_db}"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.flushdb()

    env = {k: v for k, v in os.environ.items() if not k.startswith("AUDIOSITE_")}
    env.update(DATABASE_URL=f"{PG_BASE}/{db_name}", REDIS_URL=redis_url, AUDIOSITE_VAR_DIR=str(tmp / "var"),
               PYTHONUNBUFFERED="1", **(extra_env or {}))
    return Setup(tmp, config, config_path, media, db_name, f"{PG_BASE}/{db_name}", redis_url, client, env)


def kill_tree(proc: subprocess.Popen, also: Iterable[psutil.Process] = ()) -> None:
    """SIGKILL ``proc`` and every process under it, plus ``also`` (children seen earlier), and reap ``proc``.

    ``serve`` starts its children (web, worker, embedded Redis) in sessions of their own, so a
    killed ``serve`` alone would leave them running: a failing test's cleanup uses this instead of
    ``proc.kill()``. Processes already gone are skipped."""
    victims = list(also)
    if proc.poll() is None:  # (once reaped, its pid may belong to another process)
        try:
            victims += psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            pass
        proc.kill()
    for victim in victims:
        try:
            victim.kill()
        except psutil.Error:
            continue
    proc.wait(timeout=QUICK_S)
    psutil.wait_procs(victims, timeout=QUICK_S)


def drop_stack(setup: Setup) -> None:
    """Flush the deployment's Redis db and drop its database (its processes must be stopped)."""
    setup.redis.flushdb()
    setup.redis.close()
    with psycopg.connect(f"{PG_BASE}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{setup.db_name}" WITH (FORCE)')


def run_stack(tmp: Path, models: list[dict], *, redis_db: int, name: str, parallel: bool = False,
              extra_env: dict | None = None, extra_config: dict | None = None):
    """Start ``manage.py serve`` on a fresh PostgreSQL database and Redis db; yield a Stack; stop it.

    See :func:`prepare_stack` for the configuration and environment."""
    setup = prepare_stack(tmp, models, redis_db=redis_db, name=name, extra_env=extra_env, extra_config=extra_config)
    argv = [sys.executable, "manage.py", "serve", "--config", str(setup.config_path)]
    if parallel:
        argv.append("--parallel-jobs")
    log_path = tmp / "serve.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(argv, cwd=ROOT, env=setup.env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{setup.config['port']}"
    stack = Stack(url, setup.redis, setup.dsn, proc, log_path, setup.media, setup.env)
    deadline = time.monotonic() + 240
    while b"listening on" not in log_path.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_tree(proc)
            raise RuntimeError("serve did not start:\n" + stack.log_tail())
        time.sleep(0.2)
    yield stack
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
    log.close()
    drop_stack(setup)


# -- several web processes and workers on one Redis and database (scale-out) ---------------------
@dataclass
class Member:
    """One process of a :class:`Cluster`: ``role`` 'web' or 'worker'; ``name`` is a web process's
    base URL or a worker's Celery hostname; its output goes to ``log_path``."""

    role: str
    name: str
    proc: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        """A web process's base URL (so :func:`mclient` takes a member as it takes a stack)."""
        return self.name

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


WORKER_CONCURRENCY = 32  # what `serve` gives a worker of a few small models (one thread per slot + loads)
MEMBER_START_S = 120.0  # one process's start-up on a busy two-core machine (Django and Celery imports)


class Cluster(Deployment):
    """Web processes (``python -m audiosite.web``) and Celery GPU workers started one by one, the
    way a distributed deployment runs them (docs/operations.md, "Scale-out"), all on one Redis db
    and one PostgreSQL database, with one configuration file (``AUDIOSITE_CONFIG``).

    ``webs`` and ``workers`` list the members started by this cluster that have not been killed;
    :meth:`kill` sends SIGKILL, :meth:`ensure` starts replacements.
    """

    def __init__(self, setup: Setup):
        self.setup = setup
        self.redis = setup.redis
        self.dsn = setup.dsn
        self.env = setup.env
        self.webs: list[Member] = []
        self.workers: list[Member] = []
        self._started = 0

    # -- processes --
    def _spawn(self, role: str, name: str, argv: list[str]) -> Member:
        self._started += 1
        log_path = self.setup.tmp / f"{self._started:02d}-{role}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return Member(role, name, proc, log_path)

    def spawn_web(self) -> Member:
        """Start a web process on a free port (not waited for: see :meth:`wait_ready`)."""
        port = free_port()
        return self._spawn("web", f"http://127.0.0.1:{port}", [
            sys.executable, "-m", "audiosite.web", "-b", "127.0.0.1", "-p", str(port), "audiosite.asgi:application"])

    def spawn_worker(self) -> Member:
        """Start a Celery GPU worker with a unique hostname (not waited for: see :meth:`wait_ready`)."""
        hostname = f"w{self._started + 1}-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
        return self._spawn("worker", hostname, worker_argv(hostname, WORKER_CONCURRENCY))

    def wait_ready(self, member: Member, timeout_s: float = MEMBER_START_S) -> None:
        """Wait until ``member`` serves: a web process answers ``/health`` 200; a worker beats
        (its liveness key) and Celery reports it ready (consuming). Raises AssertionError with the
        member's output if it exits or the bound passes; then adds it to ``webs`` or ``workers``."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not member.alive():
                raise AssertionError(f"{member.role} {member.name} exited:\n{member.log_tail()}")
            if time.monotonic() > deadline:
                member.proc.kill()
                member.proc.wait(timeout=QUICK_S)
                raise AssertionError(f"{member.role} {member.name} not ready in {timeout_s:g} s:\n"
                                     f"{member.log_tail()}")
            if member.role == "web":
                try:
                    if httpx.get(member.name + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            elif self.redis.exists(f"as:worker:{member.name}") and \
                    b" ready." in member.log_path.read_bytes():
                break
            time.sleep(0.2)
        (self.webs if member.role == "web" else self.workers).append(member)

    def ensure(self, webs: int = 2, workers: int = 2) -> None:
        """Forget members that died, then start (in parallel) and wait for replacements up to
        ``webs`` web processes and ``workers`` workers."""
        self.webs = [m for m in self.webs if m.alive()]
        self.workers = [m for m in self.workers if m.alive()]
        spawned = [self.spawn_web() for _ in range(webs - len(self.webs))] + \
                  [self.spawn_worker() for _ in range(workers - len(self.workers))]
        try:
            for member in spawned:
                self.wait_ready(member)
        finally:
            for member in spawned:  # those that never became ready: stopped, not leaked
                if member not in self.webs + self.workers and member.alive():
                    member.proc.kill()
                    member.proc.wait(timeout=QUICK_S)

    def kill(self, member: Member) -> float:
        """``kill -9`` ``member`` (SIGKILL, no clean-up of any kind), reap it and forget it.

        Returns:
            ``time.monotonic()`` right after the signal was sent.
        """
        os.kill(member.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        member.proc.wait(timeout=QUICK_S)
        for members in (self.webs, self.workers):
            if member in members:
                members.remove(member)
        return killed_at

    def kill_after_a_beat(self, member: Member) -> float:
        """:meth:`kill` a worker right after it refreshed its liveness key (at most one beat, 2 s,
        from now), so the key outlives it by almost the whole TTL: the worst case for anyone
        waiting to notice the death. Returns the time of the kill (``time.monotonic()``)."""
        key = f"as:worker:{member.name}"
        deadline = time.monotonic() + QUICK_S
        while self.redis.pttl(key) < 9600:  # a beat sets a 10 s TTL every 2 s
            assert time.monotonic() < deadline, f"{member.name} does not beat"
            time.sleep(0.005)
        return self.kill(member)

    def worker(self, hostname: str) -> Member:
        """The live worker member named ``hostname``."""
        return next(m for m in self.workers if m.name == hostname)

    def stop(self) -> None:
        """SIGTERM every member still running (web processes first, then workers: Celery's warm
        shutdown), SIGKILL whatever is left after 30 s."""
        for member in self.webs + self.workers:
            if member.alive():
                member.proc.send_signal(signal.SIGTERM)
                try:
                    member.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    member.proc.kill()
                    member.proc.wait(timeout=QUICK_S)

    # -- what Redis says --
    def load_field(self, model_id: str, field: str) -> str | None:
        """A field of a model's lifecycle hash ``as:m:{<id>}:load`` (``state``, ``owner``, ``loader_host``…)."""
        return self.redis.hget(f"as:m:{{{model_id}}}:load", field)

    def process_channels(self, model_id: str) -> list[str]:
        """The reply channels of a model's queued tickets, in FIFO order (one per ticket)."""
        base = f"as:m:{{{model_id}}}"
        tickets = self.redis.zrange(base + ":queue", 0, -1)
        return [self.redis.hget(base + ":chan", t) for t in tickets]


def run_cluster(tmp: Path, models: list[dict], *, redis_db: int, name: str, webs: int = 2, workers: int = 2,
                parallel: bool = True, extra_env: dict | None = None, extra_config: dict | None = None):
    """Start a :class:`Cluster` of ``webs`` web processes and ``workers`` workers; yield it; stop it.

    Done as an operator would without ``serve`` (docs/operations.md, "Scale-out"): one
    configuration file for every process (``AUDIOSITE_CONFIG``), one secret key, the runtime
    (``AUDIOSITE_PARALLEL_JOBS``), ``manage.py migrate`` and ``manage.py sync_config`` once, then
    the processes, then ``manage.py load_models`` (the non-lazy models). See :func:`prepare_stack`
    for the configuration, database and Redis db.
    """
    setup = prepare_stack(tmp, models, redis_db=redis_db, name=name, extra_env=extra_env, extra_config=extra_config)
    setup.env.update(DJANGO_SETTINGS_MODULE="audiosite.settings", AUDIOSITE_CONFIG=str(setup.config_path),
                     AUDIOSITE_SECRET_KEY=secrets.token_urlsafe(50), HF_HUB_OFFLINE="1")
    if parallel:
        setup.env["AUDIOSITE_PARALLEL_JOBS"] = "1"
    cluster = Cluster(setup)
    try:
        for command in (["migrate", "--verbosity", "0"], ["sync_config"]):
            done = cluster.manage(*command, timeout=MEMBER_START_S)
            assert done.returncode == 0, done.stdout + done.stderr
        cluster.ensure(webs, workers)
        done = cluster.manage("load_models", timeout=MEMBER_START_S)
        assert done.returncode == 0, done.stdout + done.stderr
        yield cluster
    finally:
        cluster.stop()
        drop_stack(setup)


def embedded_env(tmp: Path, **extra: str) -> dict:
    """The environment of a ``manage.py serve`` on the embedded default: no DATABASE_URL/REDIS_URL
    (SQLite and the private Redis under ``tmp/var``), none of the caller's AUDIOSITE_* variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL") and not k.startswith("AUDIOSITE_")}
    env.update(AUDIOSITE_VAR_DIR=str(tmp / "var"), PYTHONUNBUFFERED="1", **extra)
    return env


def start_embedded(tmp: Path, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    """``manage.py serve <args>`` on the embedded default (see :func:`embedded_env`), waited until it
    listens (at most 180 s); returns the process and its log file (stdout and stderr)."""
    log_path = tmp / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "manage.py", "serve", *args], cwd=ROOT,
                                env=env or embedded_env(tmp), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while b"listening on" not in log_path.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_tree(proc)
            raise AssertionError(log_path.read_text())
        time.sleep(0.2)
    return proc, log_path


def mode_of(path: Path) -> int:
    """The permission bits of ``path`` (e.g. ``0o600``)."""
    return stat.S_IMODE(path.stat().st_mode)


# -- the worker process of a stack ------------------------------------------------------------------
def worker_pid(stack) -> int:
    """The process id of the stack's one worker, from the ``as:wpid`` hash the worker publishes at start."""
    pids = list(stack.redis.hgetall("as:wpid").values())
    assert len(pids) == 1, f"expected one worker, found {pids}"
    return int(pids[0])


def proc_environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` was started with (``/proc/<pid>/environ``, Linux)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def proc_threads(pid: int) -> int:
    """How many threads process ``pid`` has now (``Threads:`` of ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads line in /proc/{pid}/status")


# -- requests to a stack ---------------------------------------------------------------------------
def body(model: str, data: bytes = TINY, **options) -> dict:
    timeout = options.pop("busy_timeout_ms", None)
    payload = {"model": model, "request": {"audio_base64": base64.b64encode(data).decode(), "options": options}}
    if timeout is not None:
        payload["busy_timeout_ms"] = timeout
    return payload


async def post(client: httpx.AsyncClient, model: str, data: bytes = TINY, **options):
    started = time.monotonic()
    resp = await client.post("/v1/tasks/run", json=body(model, data, **options))
    return resp, started, time.monotonic()


def mclient(stack, token: str | None, **kw) -> httpx.AsyncClient:
    """An async client of ``stack`` (with ``token`` for the management routes). Its timeout bounds
    every request, also one awaited later through a task: QUICK_S unless ``timeout`` says otherwise;
    ``headers`` add to (or replace) the token's."""
    headers = {**({"Authorization": f"Token {token}"} if token else {}), **kw.pop("headers", {})}
    return httpx.AsyncClient(base_url=stack.url, timeout=kw.pop("timeout", QUICK_S), headers=headers,
                             limits=httpx.Limits(max_connections=64), **kw)


def entry_of(stack, model_id: str) -> dict:
    with stack.client() as c:
        return c.get(f"/v1/models/{model_id}").json()


def events_of(stack, model_id: str) -> list[tuple[str, str, str]]:
    return stack.sql("SELECT event, outcome, actor FROM registry_lifecycleevent WHERE model_id = %s ORDER BY id",
                     model_id)


def fx(model_id: str, slots: int | None = None, **load_options) -> dict:
    entry = {"id": model_id, "family": "fixture", "load_options": load_options}
    if slots is not None:
        entry["slots"] = slots
    return entry


# -- the web process and raw HTTP ------------------------------------------------------------------
def web_pid(stack) -> int:
    """The pid of the daphne child (``python -m audiosite.web``) of a stack's ``manage.py serve``."""
    for child in psutil.Process(stack.proc.pid).children(recursive=True):
        if "audiosite.web" in " ".join(child.cmdline()):
            return child.pid
    raise AssertionError("no daphne child of manage.py serve")


def worker_pids(stack) -> list[int]:
    """The pids of the Celery worker children (``celery … worker``) of a stack's ``manage.py serve``."""
    return [child.pid for child in psutil.Process(stack.proc.pid).children(recursive=True)
            if "celery" in " ".join(child.cmdline())]


def live_workers(stack) -> dict[str, str]:
    """Workers registered in the stack's Redis whose liveness key exists: Celery hostname -> process id."""
    return {host: pid for host, pid in stack.redis.hgetall("as:wpid").items()
            if stack.redis.exists(f"as:worker:{host}")}


@dataclass
class RawAnswer:
    """What :func:`raw_exchange` saw: the answer's ``status`` (0 if none) and ``body``, the body bytes
    the client had sent when the answer arrived, and the seconds from the first byte sent to the answer."""

    status: int
    body: bytes
    sent_bytes: int
    elapsed_s: float


def raw_exchange(stack, head: bytes, chunks: Iterable[bytes], timeout_s: float = QUICK_S) -> RawAnswer:
    """Write ``head`` (request line and headers, ending in a blank line) then ``chunks`` to a socket,
    as a client that stops sending once the server answers; read the answer until the server closes.

    Every socket operation and the whole exchange are bounded by ``timeout_s``.
    """
    host, port = stack.url.rsplit("//", 1)[1].split(":")
    deadline = time.monotonic() + timeout_s
    sent = 0
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        started = time.monotonic()
        sock.sendall(head)
        answered_at = None
        try:
            for chunk in chunks:
                if select.select([sock], [], [], 0)[0]:
                    break  # the server answered early: stop sending
                if time.monotonic() > deadline:
                    raise AssertionError(f"still sending after {timeout_s:g} s")
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed its side; its answer may still be readable
        data = b""
        try:
            while time.monotonic() < deadline:
                piece = sock.recv(65536)
                if answered_at is None:
                    answered_at = time.monotonic()
                if not piece:
                    break
                data += piece
                if b"\r\n\r\n" in data:
                    head_text, _, rest = data.partition(b"\r\n\r\n")
                    length = next((int(line.split(b":", 1)[1]) for line in head_text.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), None)
                    if length is not None and len(rest) >= length:
                        break
        except (TimeoutError, ConnectionResetError):
            pass
    elapsed = (answered_at or time.monotonic()) - started
    if not data.startswith(b"HTTP/1."):
        return RawAnswer(0, data, sent, elapsed)
    head_text, _, body_bytes = data.partition(b"\r\n\r\n")
    return RawAnswer(int(head_text.split(b" ", 2)[1]), body_bytes, sent, elapsed)


def peak_rss_bytes(pid: int) -> int:
    """The peak resident set size of process ``pid`` so far (``VmHWM`` of ``/proc/<pid>/status``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


# -- speech output -------------------------------------------------------------------------------
def words(text: str) -> str:
    """Lower-case words without punctuation, for WER."""
    return " ".join("".join(ch for ch in text.lower() if ch.isalnum() or ch.isspace() or ch == "'").split())


@dataclass(frozen=True)
class Decoded:
    """Decoded speech: float32 mono ``samples`` at ``rate`` Hz, ``channels`` as the file says, and the decoder."""

    samples: np.ndarray
    rate: int
    channels: int
    decoder: str


def decode_speech(data: bytes, fmt: str, pcm_rate: int = 22050) -> Decoded:
    """Decode a speech response with a library other than its encoder (PyAV's FFmpeg) where one exists.

    mp3, opus (Ogg), wav: libsndfile (``soundfile``). flac (libsndfile reads it too, its length stated:
    tests/test_speech_flac_reads_back.py) and aac (which libsndfile does not read at all) go through
    PyAV, and the flac test compares the result sample by sample with the raw pcm response. pcm: raw
    s16le at ``pcm_rate``.
    """
    if fmt == "pcm":
        return Decoded(np.frombuffer(data, "<i2").astype(np.float32) / 32768, pcm_rate, 1, "numpy")
    if fmt in ("mp3", "opus", "wav"):
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
        return Decoded(samples[:, 0], rate, samples.shape[1], "libsndfile")
    import av

    parts, rate, channels = [], 0, 0
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(audio=0):
            rate, channels = frame.sample_rate, frame.layout.nb_channels
            array = frame.to_ndarray()
            planar = frame.format.is_planar
            parts.append(array.reshape(channels, -1)[0] if planar else array.reshape(-1, channels)[:, 0])
    samples = np.concatenate(parts).astype(np.float32)
    if np.issubdtype(parts[0].dtype, np.integer):
        samples /= 32768
    return Decoded(samples, rate, channels, "pyav")


# -- evidence records and the admission command (tests/test_admission.py, tests/test_validate_slots_cli.py) --
# Records are data: tests craft them as a validation run would leave them, in a temporary evidence root.

PASSING_F = {ident: evidence.check(evidence.PASS, "framework record") for ident in evidence.FRAMEWORK_IDS}


def record(root: Path, family: str, task: str, counts: dict[int, bool], finished_at: str, *,
           backend: str = "cpu", framework: dict | None = None, failing_check: str = "M2") -> Path:
    """Write a model record of a full run (3 starts, 20 memory cycles): M1 and M6 PASS for the run, per
    count M2-M5 PASS when ``ready``, else ``failing_check`` FAIL."""
    per_count = {}
    for n, ready in counts.items():
        checks = {ident: evidence.check(evidence.PASS, {"starts": 3}) for ident in ("M2", "M3", "M4", "M5")}
        if not ready:
            checks[failing_check] = evidence.check(evidence.FAIL, {"mismatch": "slot 1"}, "outputs differ")
        per_count[str(n)] = {"model_checks": checks, "admission_ready": ready}
    rec = {"procedure_version": evidence.PROCEDURE_VERSION, "kind": "model",
           "run_id": f"{finished_at.replace(':', '').replace('-', '')}-{family}-{task}-offline-{backend}",
           "started_at": finished_at, "finished_at": finished_at, "duration_s": 1.0,
           "manifest": {"backend": backend, "family": family, "task": task, "mode": "offline",
                        "counts": sorted(counts), "starts": 3, "memory_cycles": 20,
                        "gpu": ["a GPU (test record)"] if backend == "cuda" else []},
           "framework_checks": framework if framework is not None else PASSING_F,
           "model_checks": {"M1": evidence.check(evidence.PASS, {}), "M6": evidence.check(evidence.PASS, {})},
           "counts": per_count,
           "admission_ready": all(counts.values()), "performance": {}}
    return evidence.write(root, rec)


def framework_record(root: Path, finished_at: str, *, backend: str = "cpu", failing: str | None = None,
                     code_tree: str = "tree-a") -> Path:
    """Write a framework record: F1-F6 PASS, or ``failing`` FAIL."""
    checks = {ident: evidence.check(evidence.FAIL if ident == failing else evidence.PASS, {"tests": 1})
              for ident in evidence.FRAMEWORK_IDS}
    rec = {"procedure_version": evidence.PROCEDURE_VERSION, "kind": "framework",
           "run_id": f"{finished_at.replace(':', '').replace('-', '')}-framework-{backend}",
           "started_at": finished_at, "finished_at": finished_at, "duration_s": 1.0,
           "manifest": {"backend": backend, "revision": {"commit": "c", "dirty": False, "code_tree": code_tree}},
           "framework_checks": checks, "model_checks": {}, "counts": {}, "admission_ready": failing is None,
           "performance": {}}
    return evidence.write(root, rec)


def admission(root: Path, table: Path, *flags: str, backend: str = "cpu") -> str:
    """Run ``manage.py admission`` on an evidence root and a table file; its output."""
    out = io.StringIO()
    call_command("admission", "--backend", backend, "--evidence", str(root), "--table", str(table), *flags, stdout=out)
    return out.getvalue()


def rows(table: Path) -> dict:
    """The family rows of a table file (keys starting with ``_`` left out)."""
    return {k: v for k, v in json.loads(table.read_text()).items() if not k.startswith("_")}




# -- system programs some tests drive ------------------------------------------------------------------
def need_program(found: str | os.PathLike | None, name: str, package: str) -> str:
    """``found`` (a path to the program) as a str, else skip the test naming the Debian package to
    install; with ``AUDIOSITE_REQUIRE_PROGRAMS=1`` (``.ci/run``, which installs them) fail instead, so a
    missing install step cannot pass as a skip."""
    if found:
        return str(found)
    import pytest  # only the test modules use this helper
    message = f"needs {name} (apt-get install {package}; .ci/run installs it)"
    if os.environ.get("AUDIOSITE_REQUIRE_PROGRAMS") == "1":
        pytest.fail(message + ", and AUDIOSITE_REQUIRE_PROGRAMS=1 turns the skip into a failure", pytrace=False)
    pytest.skip(message, allow_module_level=True)
