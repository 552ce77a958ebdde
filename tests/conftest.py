"""Shared test fixtures: real PostgreSQL, real Redis, a real server stack.

Helpers (stack start-up, requests, bounds) live in the tests/support package; test modules
import from there and never from one another. Named actors:
- ``stack``: ``manage.py serve`` run as a user would (daphne + one Celery
  worker) against a fresh PostgreSQL database and Redis database 14, with the
  test configuration below. Session-scoped.
- ``redis_client``: a client of Redis database 15 (flushed per test) for the
  scheduler's own tests.
- ``speech``: the LibriSpeech utterances of ``samples/`` (in the repo).
"""
from __future__ import annotations

import pytest
import redis

from .support.audio import FIXTURES, Utterance, load_speech
from .support.stacks import REDIS_BASE, Stack, run_stack

# The modules that take longest (seconds of setup + call + teardown under ``-n 2`` on 2 cores,
# measured: 87, 66, 65, 64, 62, 61, 55, 55, 53, 53, 46, 46, 44, 41) run first: under
# ``pytest -n 3 --dist loadfile`` (scripts/test.sh) each worker takes the next module when it is free,
# and a long module begun last would leave the other workers idle at the end. A module missing here
# only runs later; the order changes nothing else.
LONGEST_FIRST = ("test_validation", "test_operations", "test_load_end_wakeups", "test_streaming",
                 "test_parallel", "test_speech", "test_management", "test_ui", "test_serve", "test_residency",
                 "test_validate_slots_cli", "test_scale", "test_http", "test_catalogue")


def pytest_collection_modifyitems(config, items) -> None:
    """Run the modules of ``LONGEST_FIRST`` first, in that order (each module's tests stay together and
    in their own order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))


if not any(FIXTURES.glob("*.wav")):
    pytest.exit(f"the speech fixtures are missing from {FIXTURES} (part of the repository)", returncode=4)


@pytest.fixture(scope="session")
def speech() -> list[Utterance]:
    return load_speech()


@pytest.fixture
def redis_client():
    client = redis.Redis.from_url(f"{REDIS_BASE}/15", decode_responses=True)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


STACK_MODELS = [
    {"id": "whisper", "family": "whisper", "task": "asr"},
    {"id": "whisper-unbounded", "family": "whisper", "task": "asr", "busy_timeout_ms": 0},
    {"id": "vad", "family": "silero_vad", "task": "vad"},
    {"id": "vad-lazy", "family": "silero_vad", "task": "vad", "lazy": True},
    {"id": "vad-broken", "family": "silero_vad", "task": "vad", "lazy": True, "path": "BROKEN"},
]


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Stack:
    """The legacy runtime, as a user starts it, on PostgreSQL and Redis db 14."""
    tmp = tmp_path_factory.mktemp("stack")
    broken = tmp / "broken.onnx"
    broken.write_bytes(b"this is not an onnx graph" * 10)
    models = [dict(m, path=str(broken)) if m.get("path") == "BROKEN" else m for m in STACK_MODELS]
    yield from run_stack(tmp, models, redis_db=14, name="e2e")
