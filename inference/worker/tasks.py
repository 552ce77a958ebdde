"""Celery tasks and signals of the GPU worker: thin, they take ids and Redis keys, never audio.

``load_model`` goes to the ``gpu`` queue (any worker may take a cold model);
``unload_model`` goes to the owning worker's direct queue (``worker_direct``).
Each writes its outcome through ``work.reply``. Runs do not come as Celery
tasks: they come on the worker's own run queue (``runs.RunDispatcher``),
started and stopped by the signals below.
"""
from __future__ import annotations

import logging
import threading

from celery import shared_task, signals
from kombu.asynchronous import get_event_loop

from audiosite.serverconfig import get_config
from inference.runtime.context import KEYS, sync_redis, sync_scheduler
from inference.runtime.startup import check_runtime
from registry import services as records

from . import liveness, memory, retirement, work
from .runs import RunDispatcher
from .state import WORKER

log = logging.getLogger(__name__)

_DISPATCHER: list[RunDispatcher] = []  # this process's run dispatcher, once the worker is set up


@signals.celeryd_after_setup.connect
def _worker_identity(sender, instance, **kwargs):
    """Check the deployment's runtime (R1.4), start liveness (R7.4) and idle retirement (R6.4)."""
    check_runtime(sync_scheduler(), warn=False)  # the web process prints the R1.5 warning
    memory.warn_if_arenas_unbounded()
    liveness.liveness_start(WORKER, sender, sync_redis(), KEYS)
    dispatcher = RunDispatcher(WORKER, threads=instance.concurrency)
    dispatcher.start()
    _DISPATCHER.append(dispatcher)
    log.info("worker %s boot %s is alive", sender, WORKER.boot)
    if get_config().idle_unload_ms:
        retirement.retirement_start(WORKER, get_config().idle_unload_ms)


def _nothing() -> None:
    """A callback that does nothing (queued only to wake Celery's event loop)."""


@signals.worker_shutting_down.connect
def _on_shutting_down(how: str = "Warm", **kwargs):
    """Let Celery's shutdown start now, not up to a second later; on a cold one, stop taking runs.

    Celery's signal handler only sets a flag, which its event loop reads when its poll returns,
    and with no timer due that poll waits up to 1 s (kombu's ``Hub``); a callback queued with
    ``call_soon`` ends the poll at once, but only when queued from another thread than the loop's
    (this handler runs in the loop's thread), hence the thread. A cold shutdown (SIGQUIT, serve's
    second Ctrl-C) sends no ``worker_shutdown``, so :func:`_worker_shutdown` never stops the run
    dispatcher there, and its popping thread (not a daemon) kept the process from exiting: it is
    told to stop popping here (runs in progress still finish; runs still queued are answered by
    their senders' liveness watch, R7.4, as for any worker that goes away).
    """
    hub = get_event_loop()
    dispatchers = list(_DISPATCHER) if how == "Cold" else []

    def wake() -> None:
        for dispatcher in dispatchers:
            dispatcher.stop_popping()
        if hub is not None:
            hub.call_soon(_nothing)

    threading.Thread(target=wake, name="shutting down", daemon=True).start()


@signals.worker_shutdown.connect
def _worker_shutdown(**kwargs):
    """Drain runs, destroy pools (after Celery's warm shutdown drained tasks), record them lost, drop liveness."""
    retirement.retirement_stop()
    stopped = []
    while _DISPATCHER:
        dispatcher = _DISPATCHER.pop()
        refused = dispatcher.stop()
        stopped.append(dispatcher)
        if refused:
            log.info("answered %d queued run(s) not_loaded at shutdown", refused)
    scheduler = sync_scheduler()
    lost = WORKER.close_all()
    for model_id in lost:
        scheduler.mark_unloaded(model_id, WORKER.boot, "worker stopped")
    liveness.liveness_stop(WORKER, sync_redis(), KEYS)
    # A sender that found the model ready just before it was marked unloaded may have pushed a
    # header since: no sender targets this boot any more, so one last drain answers them all.
    for dispatcher in stopped:
        late = dispatcher.drain()
        if late:
            log.info("answered %d late run(s) not_loaded at shutdown", late)
    if lost:
        try:
            records.registration_record_lost(lost, "worker stopped", actor=WORKER.hostname or "")
        except Exception:
            log.exception("recording the unload of %s failed", lost)


@shared_task(name="inference.load_model", acks_late=False)
def load_model(model_id: str, token: str, channel: str) -> None:
    """Load ``model_id`` on this worker as the single loader holding ``token`` (R4.2).

    Outcome in ``Keys.load_result(token)``; wake-up ``load:<token>`` on ``channel``.
    """
    payload = work.load_pool(WORKER, model_id, token)
    if payload is not None:
        work.reply(channel, KEYS.load_result(token), f"load:{token}", payload)


@shared_task(name="inference.unload_model", acks_late=False)
def unload_model(model_id: str, boot: str, token: str, channel: str) -> None:
    """Destroy this worker's pool of ``model_id``: sessions first, then weights (R4.5).

    The caller holds the model's manager lease, has cleared the logical
    residency and records the teardown. Outcome in ``Keys.load_result(token)``:
    ``{"ok", "had_pool", "duration_ms"[, "error"]}``; wake-up ``load:<token>``.
    """
    if boot == WORKER.boot:
        payload = work.destroy_pool(WORKER, model_id)
    else:
        payload = {"ok": True, "had_pool": False, "duration_ms": 0}
    work.reply(channel, KEYS.load_result(token), f"load:{token}", payload)
