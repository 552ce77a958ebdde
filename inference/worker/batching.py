"""Native batching: runs of one model granted close together share one session call.

A registration may set ``max_batch`` (requests per call, default 1) and ``batch_window_ms`` (how long
the first run of a call waits for others, default 0); with ``max_batch`` 1 nothing here is used. The
run queue is unchanged (``inference.worker.runs``): every popped run is served by its own run thread,
which holds its own lease (renewed by ``work.run_request``) and sends its own reply (releasing its own
lease). Only the session call is shared:

- the first run of a model to arrive finds no open batch, opens one and becomes its leader; it waits up
  to ``batch_window_ms`` or until ``max_batch`` runs have joined;
- each run arriving meanwhile joins the open batch (in arrival order, which is the queue's FIFO
  order) and waits for the leader's call;
- the leader closes the batch (later runs open the next one), makes one call
  (``execute_batch`` of the pool: one pipe, one session) and hands each member its own reply.

So a batch is formed only from runs already granted leases: admission, FIFO and busy timeouts are
unchanged, a batch of N holds N leases (and N slots' worth of admission) while it uses one session, and
a run never waits behind a later one (a batch runs when its window closes, before any batch opened
after it). Each member is answered alone: its own failure (expired input, ``invalid_input``, its
client left) does not touch the others (``serving.execute_batch``); a member whose client leaves is
answered ``cancelled`` at once and its lease released, while the call goes on for the others (the
last member still waiting keeps its lease until the call ends: a call in progress always holds at least
one lease for the session it occupies).
The call itself runs on a thread of its own (started by the leader), so every member, the leader
included, can leave while it runs. A batch's deadline (R3.6) is the
sum of its members' deadlines (what they would take one after the other); past it the model's process
is killed and every member answers ``deadline``.
"""
from __future__ import annotations

import functools
import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from inference.runtime import metrics
from inference.runtime.context import sync_redis
from inference.runtime.runs import RunFailure

from . import serving

log = logging.getLogger(__name__)

BATCH_LOCK = threading.Lock()
"""Guards the creation of a pool's :class:`Batcher` (one per pool object)."""


@functools.lru_cache(maxsize=256)
def batch_terms(meta_json: str) -> tuple[int, float]:
    """``(max_batch, window_s)`` of a published registration (its JSON): ``max_batch`` (default 1) and
    ``batch_window_ms`` (default 0) converted to seconds."""
    meta = json.loads(meta_json) if meta_json else {}
    return int(meta.get("max_batch") or 1), float(meta.get("batch_window_ms") or 0) / 1000


@dataclass
class _Batch:
    """One session call being formed: its members ``(header, inline, deadline_s)`` in arrival order."""

    members: list[tuple[dict, Any, float | None]] = field(default_factory=list)
    waiting: int = 0
    """Members still waiting for the call (each holds its lease): a leaving member may go early only
    while another one stays, so a busy session always has a lease held for it."""
    full: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    replies: list[dict] = field(default_factory=list)


class Batcher:
    """Forms the batches of one pool (see the module docstring).

    Args:
        max_batch: the most runs one call serves (>= 2).
        window_s: how long the leader waits for more runs (s, >= 0).
    """

    def __init__(self, max_batch: int, window_s: float):
        self.max_batch = max_batch
        self.window_s = window_s
        self._lock = threading.Lock()
        self._open: _Batch | None = None

    def run(self, pool: Any, header: dict, inline: Any, deadline_s: float | None) -> dict:
        """Serve one run as a member of a batch; returns its own reply (as ``pool.execute`` would).

        While the call goes on, the member watches its stop marker (``serving.left_checker``, every
        ``serving.CANCEL_CHECK_EVERY_S``): once its client left it returns a ``cancelled`` reply at once,
        so its run thread answers and releases its lease without waiting for the others (the session
        drops its request at its next step, ``VadSession.probabilities_many``). The last member still
        waiting does not leave early: it keeps its lease until the call ends, since the call still
        occupies one of the model's sessions (pipes); freeing every lease of a busy call would let
        admission grant a run that finds no free session (500 "no free slot")."""
        with self._lock:
            batch = self._open
            leader = batch is None
            if batch is None:
                batch = self._open = _Batch()
            index = len(batch.members)
            batch.members.append((header, inline, deadline_s))
            batch.waiting += 1
            if len(batch.members) >= self.max_batch:
                self._open = None
                batch.full.set()
        if leader:
            batch.full.wait(self.window_s)
            with self._lock:
                if self._open is batch:
                    self._open = None  # closed: nobody joins after this
            threading.Thread(target=self._call, args=(pool, batch), name=f"batch {header['model_id']}",
                             daemon=True).start()
        left = serving.left_checker(header["request_id"])
        while not batch.done.wait(serving.CANCEL_CHECK_EVERY_S):
            if left():
                with self._lock:
                    if batch.waiting > 1:  # another member keeps a lease for the session the call holds
                        batch.waiting -= 1
                        return {"ok": False, "kind": RunFailure.CANCELLED,
                                "message": "the request's client left its batch"}
        return batch.replies[index]

    @staticmethod
    def _call(pool: Any, batch: _Batch) -> None:
        """Make the batch's session call, hand each member its reply, then count the call."""
        model_id = batch.members[0][0]["model_id"]
        try:
            batch.replies = Batcher._replies(pool, batch.members)
        except Exception as exc:  # a bug on the worker's side: every member answers it
            batch.replies = [serving.failure(exc, f"batch of {model_id}")] * len(batch.members)
        finally:
            batch.done.set()
        try:  # after the replies were handed out: a metric never delays an answer
            metrics.record_sync(sync_redis(), metrics.count(metrics.BATCH_CALLS, model_id, str(len(batch.members))))
        except Exception:
            log.warning("counting a batch call of %s failed", model_id, exc_info=True)

    @staticmethod
    def _replies(pool: Any, members: list[tuple[dict, Any, float | None]]) -> list[dict]:
        """One session call for ``members``: a lone run goes the plain way (``pool.execute``)."""
        if len(members) == 1:
            header, inline, deadline_s = members[0]
            replies = [pool.execute(serving.RUN, header, inline, deadline_s)]
        else:
            deadlines = [d for _h, _i, d in members]
            deadline_s = None if any(d is None for d in deadlines) else sum(d for d in deadlines if d is not None)
            replies = pool.execute_batch([h for h, _i, _d in members], [i for _h, i, _d in members], deadline_s)
        return replies


def execute_run(pool: Any, header: dict, inline: Any, deadline_s: float | None, held: bool = False) -> dict:
    """Serve one ``run`` on ``pool``: through the pool's :class:`Batcher` when its registration batches
    (``max_batch`` > 1) and the run is not ``held`` (a live turn's decode), else ``pool.execute`` alone.

    A batch never holds more runs than the pool has slots (each member holds a lease), so a batch closes
    as soon as ``min(max_batch, slots)`` runs joined, and a pool of one slot (the legacy runtime) does
    not batch: its leader would otherwise wait the whole ``batch_window_ms`` for runs that cannot come."""
    max_batch, window_s = batch_terms(pool.meta_json)
    max_batch = min(max_batch, getattr(pool, "slots", max_batch))
    if max_batch <= 1 or held or not hasattr(pool, "execute_batch"):
        return pool.execute(serving.RUN, header, inline, deadline_s)
    batcher = getattr(pool, "batcher", None)
    if batcher is None:
        with BATCH_LOCK:
            batcher = getattr(pool, "batcher", None)
            if batcher is None:
                batcher = Batcher(max_batch, window_s)
                pool.batcher = batcher
    return batcher.run(pool, header, inline, deadline_s)
