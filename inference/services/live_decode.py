"""Live decode: one decode of a live transcription turn (``inference.realtime``) under a lease its caller
holds across several runs (R8.3)."""
from __future__ import annotations

import asyncio

from audiosite.errors import WorkerLost
from inference.runtime import runs
from inference.runtime.context import AsyncContext
from inference.runtime.loads import Placement
from inference.scheduler import Lease

from .loading import model_ensure_loaded
from .request import reply_error


async def live_turn_decode(ctx: AsyncContext, model_id: str, lease: Lease, samples, sample_rate_hz: int, options: dict,
                      timeout_ms: int) -> dict:
    """Transcribe ``samples`` (float32 ``(n,)`` at ``sample_rate_hz``) on ``model_id``'s pool under a
    request ``lease`` that the caller holds and renews across several runs (a live turn, R8.3); the
    worker neither renews nor releases it (a ``held`` run, ``inference.runtime.runs.run_on_worker``).

    The model is loaded first if needed (a turn after an unload reloads it); a pool lost before the
    worker took the run is loaded once more. Cancelled while the model loads or waits for residency
    room (its client left), it stops waiting at once, as a file request does
    (:func:`model_ensure_loaded`): the caller can give the lease back, and nothing is evicted or
    loaded for it. Once the run is handed to the worker, the caller must not release the lease:
    cancelled then, it still waits for the worker's reply (the decode finishes: at most one decode
    step, R8.2), then re-raises.

    Args:
        timeout_ms: the turn's effective busy timeout, bounding a cold load's wait for room.

    Returns:
        The adapter's result (``text``, ``segments``, ``language``, ``duration``).

    Raises:
        ServerBusy: the worker was lost (``worker_lost``), or could not load (``no_worker``, ``residency_full``).
        ModelLoadFailed: the model could not be loaded.
        InvalidRequest: the adapter refused the options (e.g. a language the checkpoint lacks).
        ApplicationError: the adapter failed on valid input (a bug).
    """
    run_input = runs.RunInput(samples, sample_rate_hz, options)
    try:
        for _attempt in range(2):
            left_ms = max(1, timeout_ms - int(lease.waited_ms)) if timeout_ms else 0
            placement = await model_ensure_loaded(ctx, model_id, room_timeout_ms=left_ms)
            reply = await _held_run(ctx, model_id, lease, placement, run_input)
            if reply is None:
                await ctx.scheduler.mark_unloaded(model_id, placement.boot, "worker lost")
                raise WorkerLost(f"model {model_id!r}: its worker stopped responding; retry")
            if reply.get("kind") == runs.RunFailure.NOT_LOADED:
                await ctx.scheduler.mark_unloaded(model_id, placement.boot, "pool lost")
                continue
            break
        else:
            raise WorkerLost(f"model {model_id!r}: its pool was lost twice; retry later")
        error = reply_error(model_id, reply, "turn")
        if error is not None:
            raise error
        return reply["result"]
    finally:
        run_input.release_samples()
        await asyncio.shield(runs.drop_input(ctx, run_input))


async def _held_run(ctx: AsyncContext, model_id: str, lease: Lease, placement: Placement,
                    run_input: runs.RunInput) -> dict | None:
    """``runs.run_on_worker`` of one held run, finished even when cancelled (then re-raised): the
    worker decodes under the caller's lease, which must not go back before the reply."""
    task = asyncio.ensure_future(runs.run_on_worker(ctx, model_id, lease.lease_id, placement, run_input,
                                                    runs.Handover(), held=True))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        try:
            await task
        except Exception:
            pass
        raise
