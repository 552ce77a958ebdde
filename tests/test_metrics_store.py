"""What ``inference/runtime/metrics.py`` keeps in Redis and how ``/metrics`` reads it back: fractional
counters (audio seconds), a model's series deleted at its unregistration, and the process samples
whose key expired dropped from the exposition and from their index. On the real Redis (database 15);
the exposition is read back with ``prometheus_client``'s parser.
"""
from __future__ import annotations

import os

import pytest
from prometheus_client.parser import text_string_to_metric_families

from inference.runtime import metrics
from inference.runtime.context import KEYS, async_context

from .support.bounds import run

pytestmark = pytest.mark.skipif(not os.environ.get("REDIS_URL", "").endswith("/15"),
                                reason="needs REDIS_URL on database 15 (scripts/test.sh sets it)")


def samples_of(text: bytes) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def gauges(*models: tuple[str, str]) -> list[metrics.ModelGauges]:
    return [metrics.ModelGauges(model_id, 0, 0, 1, False, task) for model_id, task in models]


def test_audio_seconds_add_fractions_and_a_forgotten_model_keeps_nothing(redis_client):
    """``audio_seconds_total`` sums fractional seconds (HINCRBYFLOAT) next to integer counters of the
    same batch; ``forget_model`` deletes every field of that model, counters and histogram parts, and
    leaves the other model's and ``model=""``'s."""
    async def scenario():
        ctx = await async_context()
        await metrics.record(ctx.redis, metrics.audio("a", "asr", 1.25), metrics.audio("a", "asr", 0.5),
                             metrics.audio("b", "tts", 2.0), metrics.count(metrics.REQUESTS, "a", "ok"),
                             metrics.count(metrics.REQUESTS, "", "client_error"),
                             metrics.observe(metrics.INFERENCE, 0.2, "a"), metrics.realtime_partial("a"))
        stored = await metrics.read_stored(ctx.redis)
        text = metrics.exposition(gauges(("a", "asr"), ("b", "tts")), stored, False)
        deleted = await metrics.forget_model(ctx.redis, "a")
        left = await metrics.read_stored(ctx.redis)
        await ctx.listener.close()
        return samples_of(text), deleted, left

    samples, deleted, left = run(scenario())
    assert samples[("audiosite_audio_seconds_total", frozenset({"model": "a", "task": "asr"}.items()))] == 1.75
    assert samples[("audiosite_audio_seconds_total", frozenset({"model": "b", "task": "tts"}.items()))] == 2.0
    assert samples[("audiosite_requests_total", frozenset({"model": "a", "outcome": "ok"}.items()))] == 1
    assert samples[("audiosite_requests_total", frozenset({"model": "b", "outcome": "ok"}.items()))] == 0
    assert deleted == 1 + 1 + 3 + 1  # audio, requests, inference's bucket/count/sum, partials
    fields = [field for rows in left.values() for field in rows]
    assert not any(field.startswith('["a"') for field in fields), fields
    assert '["b","tts"]' in left["audio_seconds_total"] and '["","client_error"]' in left["requests_total"]


def test_a_process_whose_sample_expired_leaves_the_exposition_and_the_index(redis_client):
    """Two processes published; once one's key expires (its process died) ``read_processes`` returns
    only the other and removes the dead one from the index set."""
    async def scenario():
        ctx = await async_context()
        async with ctx.redis.pipeline(transaction=False) as pipe:
            metrics.process_queue(pipe, "web")
            metrics.process_queue(pipe, "worker")
            await pipe.execute()
        both = await metrics.read_processes(ctx.redis)
        dead = f"worker\t{metrics.process_label()}"
        await ctx.redis.delete(KEYS.metric("process:" + dead))  # what its TTL does once it stops publishing
        alive = await metrics.read_processes(ctx.redis)
        index = await ctx.redis.smembers(KEYS.metric("processes"))
        text = metrics.exposition([], {}, False, alive)
        await ctx.listener.close()
        return both, alive, index, samples_of(text)

    both, alive, index, samples = run(scenario())
    assert sorted(p.role for p in both) == ["web", "worker"]
    assert [p.role for p in alive] == ["web"] and index == {f"web\t{metrics.process_label()}"}
    assert alive[0].resident_bytes > 10 * 1024 * 1024 and alive[0].cpu_seconds > 0
    roles = {dict(labels)["role"] for name, labels in samples if name.startswith("audiosite_process_")}
    assert roles == {"web"}
