"""The floor of ``bench_latency``: the worker part (``python -m bench.reference.floor_worker THREADS``).

Pops runs from the floor's Redis list (``BRPOP``, one at a time, the way audiosite's worker pops
its run queue), decodes the WAV (soundfile, float32), runs one session of our silero_vad adapter
built as audiosite's worker builds it (same checkpoint, CPU backend, ``THREADS`` intra-op threads),
and publishes ``<id> <JSON segments>`` on the channel the run names. See :mod:`bench.reference.floor`.
"""
from __future__ import annotations

import io
import json
import os
import sys

import redis
import soundfile

from inference import specs
from inference.adapters import get_adapter
from inference.adapters.base import AudioRequest, LoadContext

from .floor import FLOOR_QUEUE


def main(threads: int) -> None:
    """Serve runs until killed."""
    family = "silero_vad"
    adapter = get_adapter(family)
    ctx = LoadContext(specs.resolve_checkpoint(family, None), "cpu", 0, threads, {}, {})
    session = adapter.new_session(adapter.load(specs.get_spec(family), ctx), 0)
    defaults = specs.request_defaults(family)
    client = redis.Redis.from_url(os.environ["FLOOR_REDIS_URL"], socket_timeout=None)
    print("floor worker ready", flush=True)
    while True:
        popped = client.brpop([FLOOR_QUEUE], timeout=0)
        if popped is None:
            continue
        element = popped[1]
        assert isinstance(element, bytes)
        run_id, channel, audio = element.split(b" ", 2)
        samples, rate = soundfile.read(io.BytesIO(audio), dtype="float32")
        result = session.run(AudioRequest(samples, rate, defaults))
        client.publish(channel, run_id + b" " + json.dumps(result, default=float).encode())


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
