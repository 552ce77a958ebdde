"""Celery tasks and signals of the GPU worker: thin, they take ids and Redis keys, never audio.

``load_model`` goes to the ``gpu`` queue (any worker may take a cold model);
``unload_model`` goes to the owning worker's direct queue (``worker_direct``).
Each writes its outcome through ``work.reply``. Runs do not come as Celery
tasks: they come on the worker's own run queue (``runs.RunDispatcher``),
started and stopped by the signals below.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

from celery import shared_task, signals
from kombu.asynchronous import get_event_loop

from audiosite.serverconfig import get_config
from inference.runtime.context import KEYS, sync_scheduler
from inference.runtime.startup import check_runtime_at_start
from registry import records

from . import liveness, memory, pool_process, retirement, work
from .runs import RunDispatcher
from .state import WORKER

log = logging.getLogger(__name__)

_DISPATCHER: list[RunDispatcher] = []  # this process's run dispatcher, once the worker is set up

COLD_MAIN_GRACE_S = 1.0
"""After a cold shutdown begins, how long Celery's main thread may take to finish its own shutdown
(a warm shutdown already in progress may be waiting for a run there), in seconds."""

COLD_EXIT_GRACE_S = 0.3
"""Then how long the interpreter may take to exit by itself (it joins the run threads, so a run in
progress would hold it for as long as the run lasts) before the process ends with ``os._exit``."""

COLD_CLEANUP_S = 0.5
"""How long the cold exit may spend deleting the worker's liveness key, in seconds."""


def _recover_lost_redis_state() -> None:
    """Redis restarted empty (its runtime key is gone): drop this worker's pools, which no process can
    reach any more (their load states, leases and owner records went with Redis), and publish every
    registration again from the database, as ``sync_config`` does (``registry_publish`` also records the
    runtime, so the next beat finds it and this runs once per loss; another worker doing the same at
    the same moment publishes the same entries). Models then load again on their next request."""
    dropped = WORKER.forget_all()
    published = records.registry_publish(sync_scheduler(), get_config().runtime)
    log.warning("Redis lost the deployment's state (restarted empty?): dropped this worker's pools %s and "
                "published %d registration(s) again from the database", dropped or "(none)", len(published))


@signals.celeryd_after_setup.connect
def _worker_identity(sender, instance, **kwargs):
    """Check the deployment's runtime (R1.4), start liveness (R7.4) and idle retirement (R6.4).

    Celery logs and swallows an exception of a signal handler and starts the worker anyway, so a worker
    whose set-up failed here would take load tasks without liveness or a run dispatcher. The runtime
    check ends the process instead (SystemExit, exit code 1: another runtime is recorded, or Redis
    stayed unreachable or unanswering for ``REDIS_START_WAIT_S``), and so does any other failure of
    this set-up (SystemExit passes Celery's handler, which catches only ``Exception``).
    """
    try:
        check_runtime_at_start(sync_scheduler, f"worker {sender}", warn=False)  # the web prints R1.5's warning
        _start_identity(sender, instance)
    except Exception:
        log.exception("worker %s: its set-up failed; it exits rather than take tasks half set up", sender)
        raise SystemExit(1) from None


def _start_identity(sender, instance) -> None:
    """What :func:`_worker_identity` starts once the runtime is checked; ``instance``: Celery's worker."""
    memory.warn_if_arenas_unbounded()
    liveness.liveness_start(WORKER, sender, sync_scheduler(), on_state_lost=_recover_lost_redis_state)
    _settle_lost_pools()
    WORKER.on_pool_lost = lambda model_id, reason: work.pool_lost(WORKER, model_id, reason)
    if get_config().model_processes:
        threading.Thread(target=pool_process.fork_server_start, name="fork server", daemon=True).start()
    dispatcher = RunDispatcher(WORKER, threads=instance.concurrency)
    dispatcher.start()
    _DISPATCHER.append(dispatcher)
    log.info("worker %s boot %s is alive", sender, WORKER.boot)
    if get_config().idle_unload_ms:
        retirement.retirement_start(WORKER, get_config().idle_unload_ms)


def _settle_lost_pools() -> None:
    """At start, settle what dead workers left (``Scheduler.settle_lost_pools``: their ready pools unloaded,
    their loads ended) and record it in the database, so a deployment without ``serve`` (whose
    supervisor does this every 2 s) has no stale ``ready`` once a worker (re)starts. Best effort."""
    try:
        scheduler = sync_scheduler()
        settled = scheduler.settle_lost_pools(sorted(scheduler.redis.hkeys(KEYS.models_meta)))
        for model_id, host in settled.pools:
            records.registration_record_lost([model_id], f"worker {host} stopped beating (liveness lapsed)",
                                             actor=WORKER.hostname or "")
        for model_id, host in settled.loads:
            records.registration_record_load(model_id, False, error=scheduler.lost_load_error(host), actor=host)
    except Exception:  # the worker serves anyway; the next start or serve's supervisor settles it
        log.exception("settling the pools of departed workers failed")


def _nothing() -> None:
    """A callback that does nothing (queued only to wake Celery's event loop)."""


@signals.worker_shutting_down.connect
def _on_shutting_down(how: str = "Warm", exitcode: int = 1, **kwargs):
    """Let Celery's shutdown start now, not up to a second later; on a cold one, end the process soon.

    Celery's signal handler only sets a flag, which its event loop reads when its poll returns,
    and with no timer due that poll waits up to 1 s (kombu's ``Hub``); a callback queued with
    ``call_soon`` ends the poll at once, but only when queued from another thread than the loop's
    (this handler runs in the loop's thread), hence the thread.

    A cold shutdown (SIGQUIT: serve's second Ctrl-C, or an operator's) means what it means for
    Celery: stop now, abandoning the work in progress. It sends no ``worker_shutdown``, so the run
    dispatcher is told here to stop popping; and the runs in progress are not waited for: Python
    joins the run threads at exit (they are not daemons), so a long run kept the process alive
    until serve killed it ``FORCED_STOP_S`` later, or forever under another supervisor. Once the
    main thread has finished (``COLD_MAIN_GRACE_S`` at most: a warm shutdown begun before may be
    waiting for those runs in it) and the interpreter has had ``COLD_EXIT_GRACE_S`` to exit on its
    own, the process ends with ``os._exit(exitcode)`` (Celery's cold exit code, 1). The senders of
    abandoned runs get ``worker_lost`` from their liveness watch (R7.4), as for a killed worker;
    runs still queued likewise.
    """
    hub = get_event_loop()
    cold = how == "Cold"
    dispatchers = list(_DISPATCHER) if cold else []

    def wake() -> None:
        for dispatcher in dispatchers:
            dispatcher.stop_popping()
        if hub is not None:
            hub.call_soon(_nothing)
        if cold:
            _exit_after_cold_shutdown(exitcode)

    threading.Thread(target=wake, name="shutting down", daemon=True).start()


def _exit_after_cold_shutdown(exitcode: int) -> None:
    """End the process with ``exitcode`` unless it ends by itself first (see :func:`_on_shutting_down`).

    Before ``os._exit``, the worker's liveness key is deleted (at most ``COLD_CLEANUP_S``, in a
    thread of its own: an unreachable Redis must not hold the exit), so the senders of abandoned
    runs learn at their next look, not when the key would have expired (``LIVENESS_TTL_MS``).
    """
    threading.main_thread().join(COLD_MAIN_GRACE_S)
    time.sleep(COLD_EXIT_GRACE_S)
    log.warning("cold shutdown: exiting now; runs still in progress are abandoned (their senders "
                "answer worker_lost)")

    def forget() -> None:
        try:
            liveness.liveness_stop(WORKER, sync_scheduler())
        except Exception:  # the key expires by itself
            log.warning("cold shutdown: could not delete the liveness key; it expires by itself")
    cleanup = threading.Thread(target=forget, name="cold cleanup", daemon=True)
    cleanup.start()
    cleanup.join(COLD_CLEANUP_S)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(exitcode)


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
    sync_scheduler().redis.delete(KEYS.pool_pids(WORKER.hostname or ""))
    for model_id in lost:
        scheduler.mark_unloaded(model_id, WORKER.boot, "worker stopped")
    liveness.liveness_stop(WORKER, scheduler)
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
