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
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import psutil
import psycopg
import redis
import soundfile

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = (ROOT.parent / "shared" / "fixtures" / "speech").resolve()
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


# -- the server stack ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


@dataclass
class Stack:
    """A running ``manage.py serve`` and handles to its Redis and database."""

    url: str
    redis: redis.Redis
    dsn: str
    proc: subprocess.Popen
    log_path: Path
    media_root: Path
    env: dict

    def manage(self, *args: str, timeout: float = MODEL_S, env: dict | None = None) -> subprocess.CompletedProcess:
        """Run ``manage.py <args>`` against this stack (its database and Redis; ``env`` adds variables)."""
        return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout)

    def manage_async(self, *args: str) -> subprocess.Popen:
        """Start ``manage.py <args>`` against this stack without waiting."""
        return subprocess.Popen([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", MODEL_S), **kw)

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

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


STACK_MAX_BODY_BYTES = 3_000_000


def run_stack(tmp: Path, models: list[dict], *, redis_db: int, name: str, parallel: bool = False,
              extra_env: dict | None = None, extra_config: dict | None = None):
    """Start ``manage.py serve`` on a fresh PostgreSQL database and Redis db; yield a Stack; stop it.

    The configuration pins ``"backend": "cpu"`` (``extra_config`` may override it): the tests
    assert CPU admission tables, ``/health`` backends and start-up lines, on any machine."""
    media = tmp / "media"
    media.mkdir()
    for wav in FIXTURES.glob("*.wav"):
        (media / wav.name).write_bytes(wav.read_bytes())
    config = {"host": "127.0.0.1", "port": free_port(), "backend": "cpu", "lease_ttl_ms": 3000,
              "media_roots": [str(media)], "max_request_body_bytes": STACK_MAX_BODY_BYTES, "models": models,
              **(extra_config or {})}
    config_path = tmp / "server.json"
    config_path.write_text(json.dumps(config, indent=2))

    db_name = f"audiosite_{name}_{os.getpid()}"
    admin_dsn = f"{PG_BASE}/postgres"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{db_name}"')
    redis_url = f"{REDIS_BASE}/{redis_db}"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.flushdb()

    env = {k: v for k, v in os.environ.items() if not k.startswith("AUDIOSITE_")}
    env.update(DATABASE_URL=f"{PG_BASE}/{db_name}", REDIS_URL=redis_url, AUDIOSITE_VAR_DIR=str(tmp / "var"),
               PYTHONUNBUFFERED="1", **(extra_env or {}))
    argv = [sys.executable, "manage.py", "serve", "--config", str(config_path)]
    if parallel:
        argv.append("--parallel-jobs")
    log_path = tmp / "serve.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{config['port']}"
    stack = Stack(url, client, f"{PG_BASE}/{db_name}", proc, log_path, media, env)
    deadline = time.monotonic() + 240
    while b"listening on" not in log_path.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("serve did not start:\n" + stack.log_tail())
        time.sleep(0.2)
    yield stack
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()
    client.flushdb()
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')


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
            proc.kill()
            raise AssertionError(log_path.read_text())
        time.sleep(0.2)
    return proc, log_path


def mode_of(path: Path) -> int:
    """The permission bits of ``path`` (e.g. ``0o600``)."""
    return stat.S_IMODE(path.stat().st_mode)


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

    mp3, opus (Ogg), wav: libsndfile (``soundfile``). flac: libsndfile cannot read a FLAC stream whose
    header gives no length (what a streamed response must send), and aac it does not read at all:
    those go through PyAV, and the flac test compares the result sample by sample with the raw pcm
    response instead. pcm: raw s16le at ``pcm_rate``.
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
