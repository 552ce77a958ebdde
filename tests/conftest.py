"""Shared test base: real PostgreSQL, real Redis, a real server stack.

Named actors:
- ``stack``: ``manage.py serve`` run as a user would (daphne + one Celery
  worker) against a fresh PostgreSQL database and Redis database 14, with the
  test configuration below. Session-scoped.
- ``redis_client``: a client of Redis database 15 (flushed per test) for the
  scheduler's own tests.
- ``speech``: the LibriSpeech fixtures of ../shared/fixtures/speech.
"""
from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import psycopg
import pytest
import redis
import soundfile

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = (ROOT.parent / "shared" / "fixtures" / "speech").resolve()
if not FIXTURES.exists():
    pytest.exit(f"the tests need the shared fixtures at {FIXTURES} (the 'shared' folder beside this checkout)",
                returncode=4)
REDIS_BASE = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15").rsplit("/", 1)[0]
PG_BASE = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/audiosite").rsplit("/", 1)[0]


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


@pytest.fixture(scope="session")
def speech() -> list[Utterance]:
    return load_speech()


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


@pytest.fixture
def redis_client():
    client = redis.Redis.from_url(f"{REDIS_BASE}/15", decode_responses=True)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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

    def manage(self, *args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
        """Run ``manage.py <args>`` against this stack (its database and Redis; ``env`` adds variables)."""
        return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout)

    def manage_async(self, *args: str) -> subprocess.Popen:
        """Start ``manage.py <args>`` against this stack without waiting."""
        return subprocess.Popen([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 120), **kw)

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


STACK_MODELS = [
    {"id": "whisper", "family": "whisper", "task": "asr"},
    {"id": "whisper-unbounded", "family": "whisper", "task": "asr", "busy_timeout_ms": 0},
    {"id": "vad", "family": "silero_vad", "task": "vad"},
    {"id": "vad-lazy", "family": "silero_vad", "task": "vad", "lazy": True},
    {"id": "vad-broken", "family": "silero_vad", "task": "vad", "lazy": True, "path": "BROKEN"},
]
STACK_MAX_BODY_BYTES = 3_000_000


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    """The legacy runtime, as a user starts it, on PostgreSQL and Redis db 14."""
    tmp = tmp_path_factory.mktemp("stack")
    broken = tmp / "broken.onnx"
    broken.write_bytes(b"this is not an onnx graph" * 10)
    models = [dict(m, path=str(broken)) if m.get("path") == "BROKEN" else m for m in STACK_MODELS]
    yield from run_stack(tmp, models, redis_db=14, name="e2e")


def run_stack(tmp: Path, models: list[dict], *, redis_db: int, name: str, parallel: bool = False,
              extra_env: dict | None = None, extra_config: dict | None = None):
    """Start ``manage.py serve`` on a fresh PostgreSQL database and Redis db; yield a Stack; stop it."""
    media = tmp / "media"
    media.mkdir()
    for wav in FIXTURES.glob("*.wav"):
        (media / wav.name).write_bytes(wav.read_bytes())
    config = {"host": "127.0.0.1", "port": free_port(), "lease_ttl_ms": 3000, "media_roots": [str(media)],
              "max_request_body_bytes": STACK_MAX_BODY_BYTES, "models": models, **(extra_config or {})}
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


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"
