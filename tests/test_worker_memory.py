"""Worker memory after unload: what the teardown releases, and how the worker is started.

RSS itself is measured by ``manage.py bench_worker_memory`` (docs/benchmarks.md), not here: these
tests check the mechanisms, with no RSS or timing threshold.

- In this process, with the real adapters: ``Pool.close`` (through the worker's ``destroy_pool``)
  leaves nothing of the model reachable from a pool object someone still holds, and the pool
  itself dies with its last reference, by reference counting alone (the collector is off);
  whisper loads of one checkpoint share one Hugging Face tokenizer (a fresh one per load kept
  native memory after its unload).
- On a real stack (``manage.py serve --parallel-jobs``, PostgreSQL, Redis db 8): the worker
  ``serve`` starts has ``MALLOC_ARENA_MAX`` in its environment, every teardown trims the
  allocator, and load/unload cycles of silero_vad leave its thread count unchanged.
"""
from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from inference import specs
from inference.adapters import get_adapter
from inference.adapters.base import AudioRequest, LoadContext
from inference.adapters.whisper import shared_tokenizer
from inference.management.commands.serve import WORKER_MALLOC_ARENA_MAX
from inference.worker.state import WorkerState
from inference.worker.work import destroy_pool

from .support.audio import FIXTURES
from .support.bounds import MODEL_S, run, within
from .support.clients import body, mclient
from .support.processes import proc_environ, proc_threads
from .support.stacks import run_stack, worker_pid

# One session each ("slots" None): the count every backend admits; this process's backend is the
# default config's ("auto"), not the CPU the stacks are pinned to.
ENTRIES = {"silero_vad": {"family": "silero_vad", "task": "vad", "mode": "offline", "slots": None},
           "whisper": {"family": "whisper", "task": "asr", "mode": "offline", "slots": None}}


def _survivors(refs: dict[str, weakref.ref]) -> dict[str, list[str]]:
    """The still-alive referents of ``refs``, each with the types of what refers to it (for the message)."""
    return {name: [type(r).__name__ for r in gc.get_referrers(ref())] for name, ref in refs.items()
            if ref() is not None}


@pytest.mark.parametrize("family", ["silero_vad", "whisper"])
def test_teardown_releases_sessions_and_weights_even_while_the_pool_object_is_held(family, speech):
    """After ``destroy_pool`` the sessions, the shared object and the model inside it are gone
    although the test still holds the pool (as an orphaned run or a closing thread would); once
    the pool's last reference goes, the pool goes too. The collector is off, so nothing relies on
    a later ``gc`` pass to release a model's memory before the allocator is trimmed."""
    worker = WorkerState()
    pool = worker.build("mem", ENTRIES[family], "{}")
    utterance = speech[0]
    assert utterance.rate == 16000  # both families take 16 kHz
    pool.sessions[0].run(AudioRequest(utterance.samples, utterance.rate, specs.request_defaults(family)))
    refs = {f"session {i}": weakref.ref(s) for i, s in enumerate(pool.sessions)}
    refs["shared"] = weakref.ref(pool.shared)
    inner = pool.shared.session if family == "silero_vad" else pool.shared.feature_extractor
    refs["model part"] = weakref.ref(inner)
    del inner
    gc.collect()
    gc.disable()
    try:
        assert destroy_pool(worker, "mem")["had_pool"] is True
        assert worker.get("mem") is None
        assert _survivors(refs) == {}
        assert pool.sessions == [] and pool.shared is None
        pool_ref = weakref.ref(pool)
        del pool
        assert pool_ref() is None, [type(r).__name__ for r in gc.get_referrers(pool_ref())]
    finally:
        gc.enable()


def test_whisper_loads_of_one_checkpoint_share_one_tokenizer_and_a_changed_file_gets_a_new_one(tmp_path):
    """Two loads of the shipped checkpoint use the same ``tokenizers.Tokenizer`` object; a
    tokenizer file that changed (size or modification time) gets a fresh instance."""
    adapter = get_adapter("whisper")
    checkpoint = specs.resolve_checkpoint("whisper", None)
    ctx = LoadContext(checkpoint, "cpu", 0, 1, {}, {})
    first, second = (adapter.load(specs.get_spec("whisper"), ctx) for _ in range(2))
    try:
        assert first is not second and first.hf_tokenizer is second.hf_tokenizer
        assert first.hf_tokenizer is shared_tokenizer(checkpoint)
    finally:
        adapter.unload(first)
        adapter.unload(second)
    copy = tmp_path / "checkpoint"
    copy.mkdir()
    (copy / "tokenizer.json").write_bytes((checkpoint / "tokenizer.json").read_bytes())
    before = shared_tokenizer(copy)
    assert before is shared_tokenizer(copy) and before is not shared_tokenizer(checkpoint)
    (copy / "tokenizer.json").write_bytes((checkpoint / "tokenizer.json").read_bytes() + b" ")
    assert shared_tokenizer(copy) is not before
    assert shared_tokenizer(tmp_path) is None  # no tokenizer.json there


@pytest.fixture(scope="module")
def mem_stack(tmp_path_factory):
    yield from run_stack(tmp_path_factory.mktemp("memstack"), [], redis_db=8, name="mem", parallel=True,
                         extra_config={"ui_management": True})


def test_the_worker_serve_starts_has_an_arena_limit_and_trims_after_each_teardown(mem_stack):
    """``serve`` puts ``MALLOC_ARENA_MAX`` into the worker's environment (glibc reads it only at
    process start) and the worker does not warn about it; each unload logs the trim."""
    pid = worker_pid(mem_stack)
    assert proc_environ(pid).get("MALLOC_ARENA_MAX") == WORKER_MALLOC_ARENA_MAX
    assert "MALLOC_ARENA_MAX is not set" not in mem_stack.log_path.read_text(errors="replace")


def test_load_unload_cycles_leave_the_worker_thread_count_unchanged(mem_stack):
    """Five cycles of load (silero_vad, 1 slot, 2 intra-op threads: onnxruntime starts a thread
    pool per session) → 4 requests at once → unload. A thread left behind per cycle (a session's
    pool not joined, a helper thread per teardown) would raise the count after every cycle.

    Celery's thread pool only grows, up to its concurrency, when more tasks run at once than it
    has threads; a warm-up with 16 requests at once on 4 slots first grows it past anything a
    1-slot cycle can need (one run at a time, plus tasks that are finishing), so the count after
    each cycle must equal the count after the warm-up. Every teardown also logs the trim."""
    token = mem_stack.manage("issue_token", "operator")
    assert token.returncode == 0, token.stderr
    pid = worker_pid(mem_stack)
    wav = (sorted(FIXTURES.glob("*.wav"))[0]).read_bytes()

    async def cycle(c, slots: int, requests: int) -> None:
        entry = {"id": "memvad", "family": "silero_vad", "slots": slots, "lazy": False,
                 "session_options": {"intra_op_num_threads": 2}}
        resp = await c.post("/v1/models/load", json=entry)
        assert resp.status_code == 200 and resp.json()["loaded"] is True, resp.text
        answers = await within(asyncio.gather(*[c.post("/v1/tasks/run", json=body("memvad", wav))
                                                for _ in range(requests)]), MODEL_S)
        assert [a.status_code for a in answers] == [200] * requests, answers[0].text
        resp = await c.post("/v1/models/unload", json={"id": "memvad"})
        assert resp.status_code == 200, resp.text

    async def scenario() -> list[int]:
        async with mclient(mem_stack, token.stdout.strip(), timeout=MODEL_S) as c:
            await cycle(c, slots=4, requests=16)
            counts = [proc_threads(pid)]
            for _ in range(5):
                await cycle(c, slots=1, requests=4)
                counts.append(proc_threads(pid))
            return counts

    counts = run(scenario())
    assert counts == [counts[0]] * 6, f"threads after the warm-up, then after each cycle: {counts}"
    log = mem_stack.log_path.read_text(errors="replace")
    assert log.count("destroyed the pool of memvad; free memory returned to the OS (malloc_trim)") == 6
