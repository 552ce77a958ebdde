"""Streams from a worker: the frames of one streamed run (speech synthesis, transcription), read as they come.

The worker pushes each frame on ``Keys.chunks(request_id)`` and announces it on the caller's process
channel; a reader that hears nothing looks at the worker's liveness (R7.4, as for runs).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from audiosite.errors import ServerBusy, WorkerLost

from .context import KEYS, AsyncContext
from .loads import LIVENESS_CHECK_S, Placement, next_check_s, worker_alive_for_s
from .runs import RunInput, queue_header, stage_run

STOP_TTL_MS = 600000  # a stop request outlives any sentence
# Frames a stream takes from Redis per read: the web process holds at most these (plus the one being
# written) per stream while its client reads slowly; the rest wait in Redis. A speech frame is one
# piece of at most ``inference.adapters.piper.PHONEMES_PER_RUN`` phonemes: up to about 1.4 MB of
# PCM at the slowest pace (speed 0.25), 0.35 MB at speed 1.
FRAMES_PER_READ = 4

class WorkerStream:
    """The frames of one streamed speech run on a worker (``inference.worker.work.stream_speech``).

    The caller keeps (and renews) the run's lease: a stream's slot is held
    until its last byte is written or its client leaves (R8.3). Frames arrive
    on ``Keys.chunks(request_id)``; every push also publishes
    ``chunk:<request_id>`` on this process's channel, so waiting costs no
    polling; a watchdog tick checks that the worker still lives (R7.4).

    Attributes:
        final: the end frame's JSON once read (None before).
    """

    def __init__(self, ctx: AsyncContext, model_id: str, placement: Placement):
        self.ctx = ctx
        self.model_id = model_id
        self.placement = placement
        self.request_id = uuid.uuid4().hex
        self.final: dict | None = None
        self._key = KEYS.chunks(self.request_id)
        self._wake_key = f"chunk:{self.request_id}"
        self._check_s = LIVENESS_CHECK_S  # when to look at the worker's liveness if no frame comes

    async def start(self, lease_id: str, text: str, options: dict) -> None:
        """Push the run header ``{"stream": true, "model_id", "request_id", "lease_id", "boot",
        "channel", "text", "options"}`` on the owning worker's run queue (one round trip)."""
        header = json.dumps({"stream": True, "model_id": self.model_id, "request_id": self.request_id,
                             "lease_id": lease_id, "boot": self.placement.boot,
                             "channel": self.ctx.listener.channel, "text": text, "options": options})
        async with self.ctx.redis_bytes.pipeline(transaction=False) as pipe:
            queue_header(pipe, self.placement, header)
            await pipe.execute()

    async def frames(self) -> list[bytes]:
        """The PCM frames available now, waiting for at least one; empty once the end frame was read.

        Each returned item is a frame without its type byte: s16le mono PCM (``a``, speech) or
        JSON (``j``, a transcription segment). The end frame sets :attr:`final` and ends the stream.

        Raises:
            ServerBusy: (code ``worker_lost``) the worker stopped beating before the end frame.
        """
        while self.final is None:
            wake = self.ctx.listener.expect(self._wake_key)
            try:
                items = await self.ctx.redis_bytes.lpop(self._key, FRAMES_PER_READ)
                if items:
                    audio_frames = []
                    for item in items:
                        if item[:1] == b"e":
                            self.final = json.loads(item[1:])
                            break
                        audio_frames.append(item[1:])
                    return audio_frames
                done, _ = await asyncio.wait({wake}, timeout=self._check_s)
                if not done:
                    # Look again just after the worker's liveness would lapse (R7.4, as for runs).
                    left_s = await worker_alive_for_s(self.ctx, self.placement.owner, self.placement.boot)
                    if left_s is None:
                        raise WorkerLost(f"model {self.model_id!r}: its worker stopped responding mid-stream")
                    self._check_s = next_check_s(left_s)
            finally:
                self.ctx.listener.forget(self._wake_key)
        return []

    async def stop(self, wait_s: float) -> bool:
        """Ask the worker to stop after its current sentence and wait (up to ``wait_s``) for its end frame.

        Returns:
            True when the end frame arrived (the worker's slot is free again).
        """
        if self.final is not None:
            return True
        await self.ctx.redis.set(KEYS.stop(self.request_id), "1", px=STOP_TTL_MS)
        deadline = time.monotonic() + wait_s
        try:
            while self.final is None and time.monotonic() < deadline:
                await asyncio.wait_for(self.frames(), timeout=max(0.01, deadline - time.monotonic()))
        except (TimeoutError, ServerBusy):
            return False
        return True

    async def start_transcription(self, lease_id: str, run_input: RunInput) -> None:
        """Send ``run_input``'s samples and push the header ``{"stream": "transcription", "model_id",
        "request_id", "lease_id", "boot", "channel", "sample_rate_hz", "sample_format", "options"}`` (one round trip,
        see :func:`stage_run`); the worker answers with ``j`` frames of JSON per segment
        (``inference.worker.work.stream_transcription``). The stream's ``request_id`` is the input's."""
        self.request_id = run_input.request_id
        self._key = KEYS.chunks(self.request_id)
        self._wake_key = f"chunk:{self.request_id}"
        header = {"stream": "transcription", "model_id": self.model_id, "request_id": self.request_id,
                  "lease_id": lease_id, "boot": self.placement.boot, "channel": self.ctx.listener.channel,
                  "sample_rate_hz": run_input.sample_rate_hz, "sample_format": run_input.sample_format,
                  "options": run_input.options}
        await stage_run(self.ctx, run_input, self.placement, header)

    async def discard(self, keep_input: bool = False) -> None:
        """Delete what is left of the stream in Redis (frames, stop flag, and an input never taken
        unless ``keep_input``: a run the worker refused ``not_loaded`` is sent again)."""
        keys = [self._key, KEYS.stop(self.request_id)]
        if not keep_input:
            keys.append(KEYS.input(self.request_id))
        await self.ctx.redis.delete(*keys)
