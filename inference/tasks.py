"""Celery tasks of the GPU worker. They take ids and Redis keys, never audio.

``load_model`` goes to the ``gpu`` queue (any worker may take a cold model);
``run_model`` goes to the owning worker's direct queue (``worker_direct``).
Both write their outcome to a Redis key with a TTL, then publish a wake-up on
the caller's process channel. The worker renews the lease (or the loader
claim) while it works and releases the lease when done, so a web process
that dies mid-request strands nothing (R2.5).
"""
from __future__ import annotations

import functools
import json
import logging
import threading
import time
from contextlib import contextmanager

from celery import shared_task, signals

from audiosite.serverconfig import get_config
from inference import audio
from inference.adapters.base import AudioRequest, InvalidInput
from inference.pools import WORKER
from inference.runtime.context import KEYS, redis_url, sync_redis, sync_redis_bytes, sync_scheduler

log = logging.getLogger(__name__)

RESULT_TTL_MS = 300000  # a result waits 5 min for its reader


@signals.celeryd_after_setup.connect
def _worker_identity(sender, instance, **kwargs):
    """Check the deployment's runtime (R1.4), record this worker's hostname and start its liveness key."""
    from inference.runtime.startup import check_runtime

    check_runtime(sync_redis(), KEYS, warn=False)  # the web process prints the R1.5 warning
    WORKER.start_liveness(sender, sync_redis(), KEYS)
    log.info("worker %s boot %s is alive", sender, WORKER.boot)
    idle_ms = get_config().idle_unload_ms
    if idle_ms:
        threading.Thread(target=_retire_idle_forever, args=(idle_ms,), name="idle retirement", daemon=True).start()


_STOP_RETIRING = threading.Event()


def _retire_idle_forever(idle_ms: int) -> None:
    """Check this worker's pools every ``min(1 s, idle_ms / 4)`` and retire idle ones (R6.4)."""
    every_s = max(0.05, min(1.0, idle_ms / 4000))
    while not _STOP_RETIRING.wait(every_s):
        for model_id in list(WORKER.pools):
            try:
                retire_if_idle(model_id, idle_ms)
            except Exception:
                log.exception("idle retirement of %s failed", model_id)


def retire_if_idle(model_id: str, idle_ms: int) -> bool:
    """Unload this worker's pool of ``model_id`` if it has been idle for ``idle_ms`` (R6.4).

    Idle = ready, no lease of any kind, empty queue, and the last work
    (``last_used_ms``, set when a lease is released or a load finishes)
    ended at least ``idle_ms`` ago in Redis time. Takes the manager lease by
    try-acquire, so a busy or queued model is skipped, never interrupted.

    Returns:
        True when the pool was retired.
    """
    scheduler = sync_scheduler()
    lease = scheduler.try_acquire(model_id, "ready", idle_ms)
    if lease is None:
        return False
    try:
        # The teardown may outlast the lease TTL: keep the lease exclusive until it ends (R4.5).
        with _renewing(lambda: scheduler.renew(model_id, lease.lease_id), scheduler.lease_ttl_ms / 3000):
            return _retire(model_id, idle_ms)
    finally:
        scheduler.release(model_id, lease.lease_id)


def _destroy_pool(model_id: str) -> tuple[bool, str]:
    """Unpublish and close this worker's pool of ``model_id`` (sessions, then weights; R4.5).

    Returns:
        ``(had_pool, error)``; ``error`` is "" unless closing raised.
    """
    pool = WORKER.remove(model_id)
    if pool is None:
        return False, ""
    try:
        pool.close()
    except Exception as exc:
        log.exception("closing the pool of %s failed", model_id)
        return True, f"{type(exc).__name__}: {exc}"
    return True, ""


def _retire(model_id: str, idle_ms: int) -> bool:
    """Tear down this worker's pool of ``model_id`` under a held manager lease (see :func:`retire_if_idle`)."""
    from registry.services import registration_record_unload

    scheduler = sync_scheduler()
    load = sync_redis().hgetall(KEYS.model(model_id) + ":load")
    if load.get("owner") != WORKER.hostname or load.get("boot") != WORKER.boot:
        return False  # another worker's pool: it retires its own
    started = time.monotonic()
    scheduler.set_state(model_id, "unloading")  # logical residency first (R4.5)
    _had_pool, error = _destroy_pool(model_id)
    scheduler.set_state(model_id, "unloaded")
    try:
        registration_record_unload(model_id, not error, detail=error or f"idle for at least {idle_ms} ms",
                                   duration_ms=int((time.monotonic() - started) * 1000),
                                   actor="idle retirement", event="idle_retire")
    except Exception:
        log.exception("recording an idle retirement failed")
    log.info("retired %s after %d ms idle", model_id, idle_ms)
    return True


@signals.worker_shutdown.connect
def _worker_shutdown(**kwargs):
    """Destroy pools (after Celery's warm shutdown drained tasks) and drop liveness."""
    _STOP_RETIRING.set()
    scheduler = sync_scheduler()
    lost = WORKER.close_all()
    for model_id in lost:
        scheduler.mark_unloaded(model_id, WORKER.boot, "worker stopped")
    WORKER.stop_liveness(sync_redis(), KEYS)
    if lost:
        from registry.services import registration_record_lost

        try:
            registration_record_lost(lost, "worker stopped", actor=WORKER.hostname or "")
        except Exception:
            log.exception("recording the unload of %s failed", lost)


@contextmanager
def _renewing(renew, every_s: float):
    """Call ``renew()`` every ``every_s`` seconds in a thread while the block runs."""
    stop = threading.Event()

    def loop():
        while not stop.wait(every_s):
            try:
                if not renew():
                    log.warning("renewal refused: the claim was lost")
            except Exception:
                log.exception("renewal failed")

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _reply(channel: str, key: str, wake: str, payload: dict) -> None:
    client = sync_redis()
    client.set(key, json.dumps(payload), px=RESULT_TTL_MS)
    client.publish(channel, wake)


@shared_task(name="inference.load_model", acks_late=False)
def load_model(model_id: str, token: str, channel: str) -> None:
    """Load ``model_id`` on this worker as the single loader holding ``token`` (R4.2).

    Outcome in ``as:loadout:<token>``: ``{"ok": true, "owner", "boot"}`` or
    ``{"ok": false, "error"}``; wake-up ``load:<token>`` on ``channel``.
    """
    from registry.services import registration_record_load, registration_record_loading

    scheduler = sync_scheduler()
    if not scheduler.renew_load(model_id, token, WORKER.hostname or ""):
        log.info("load of %s (token %s) was abandoned or replaced before it started; skipping", model_id, token)
        return
    started = time.monotonic()
    meta_json = sync_redis().hget(KEYS.models_meta, model_id)
    try:
        registration_record_loading(model_id, actor=WORKER.hostname or "")
    except Exception:
        log.exception("recording the start of a load failed")
    error = ""
    capacity = 0
    built = None
    try:
        if meta_json is None:
            raise LookupError(f"model {model_id!r} is no longer registered")
        with _renewing(lambda: scheduler.renew_load(model_id, token, WORKER.hostname or ""),
                       scheduler.lease_ttl_ms / 3000):
            pool = WORKER.build(model_id, json.loads(meta_json), meta_json, barrier=barrier)
            capacity = pool.capacity
            built = pool
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        log.exception("loading %s failed", model_id)
    duration_ms = int((time.monotonic() - started) * 1000)
    ok = not error
    if scheduler.finish_load(model_id, token, ok, WORKER.hostname, WORKER.boot, error, capacity) == "stale":
        # Our claim was replaced or abandoned (an unload, a takeover): publish nothing.
        if built is not None:
            WORKER.discard(model_id, built)
        ok, error = False, "the load was abandoned or superseded"
        log.info("load of %s (token %s) finished after its claim was gone; discarded", model_id, token)
    try:
        registration_record_load(model_id, ok, error=error, duration_ms=duration_ms, actor=WORKER.hostname or "")
    except Exception:
        log.exception("recording a load outcome failed")
    payload = {"ok": True, "owner": WORKER.hostname, "boot": WORKER.boot} if ok else {"ok": False, "error": error}
    payload["duration_ms"] = duration_ms
    _reply(channel, KEYS.load_result(token), f"load:{token}", payload)


@shared_task(name="inference.run_model", acks_late=False)
def run_model(model_id: str, request_id: str, lease_id: str, boot: str, channel: str) -> None:
    """Serve one request on this worker's pool of ``model_id`` under ``lease_id``.

    Input in ``as:in:<request_id>`` (JSON header line, then float32 samples);
    outcome in ``as:out:<request_id>``: ``{"ok": true, "result", "slot",
    "inference_ms"}`` or ``{"ok": false, "kind": "not_loaded"|"invalid_input"|
    "expired"|"error", "message"}``; wake-up ``done:<request_id>``. The lease is
    released here on every path.
    """
    pool = WORKER.get(model_id)
    if pool is None or boot != WORKER.boot:
        # Never took over: the caller keeps (and later releases) the lease.
        payload = {"ok": False, "kind": "not_loaded", "message": f"model {model_id!r} is not loaded on this worker"}
        _reply(channel, KEYS.result(request_id), f"done:{request_id}", payload)
        return
    scheduler = sync_scheduler()
    payload: dict
    try:
        with _renewing(lambda: scheduler.renew(model_id, lease_id), scheduler.lease_ttl_ms / 3000):
            payload = _run(pool, request_id)
    except Exception as exc:  # a bug in an adapter: report it, keep the worker
        log.exception("run of %s failed", model_id)
        payload = {"ok": False, "kind": "error", "message": f"{type(exc).__name__}: {exc}"}
    finally:
        scheduler.release(model_id, lease_id)
    _reply(channel, KEYS.result(request_id), f"done:{request_id}", payload)


def _run(pool, request_id: str) -> dict:
    raw = sync_redis_bytes().getdel(KEYS.input(request_id))
    if raw is None:
        return {"ok": False, "kind": "expired", "message": "the request's input expired before it ran"}
    header, _, body = raw.partition(b"\n")
    info = json.loads(header)
    options = {**pool.request_defaults, **info["options"]}
    request = AudioRequest(audio.from_bytes(body), int(info["sample_rate_hz"]), options)
    with pool.slot() as slot:
        started = time.monotonic()
        try:
            result = pool.sessions[slot].run(request)
        except InvalidInput as exc:
            return {"ok": False, "kind": "invalid_input", "message": str(exc), "param": exc.param}
        inference_ms = (time.monotonic() - started) * 1000
    return {"ok": True, "result": result, "slot": slot, "inference_ms": round(inference_ms, 3), "worker": WORKER.hostname}


BARRIER_TIMEOUT_S = 120


@functools.cache
def _blocking_redis():
    """A client whose socket timeout outlasts a barrier's BLPOP (redis-py's default is 5 s)."""
    import redis

    return redis.Redis.from_url(redis_url(), decode_responses=True, socket_timeout=BARRIER_TIMEOUT_S + 10)


def barrier(name: str) -> str:
    """Block until a controller releases barrier ``name`` (test family only).

    Protocol (Redis): INCR ``as:fixture:arrived:<name>`` and PUBLISH it on
    ``as:fixture:events``, then BLPOP ``as:fixture:release:<name>``; a
    controller LPUSHes one item per waiter it lets through: ``go``, or
    ``fail`` to make the held step raise.

    Returns:
        The controller's action ('go' or 'fail').

    Raises:
        TimeoutError: nobody released it within 120 s.
    """
    client = _blocking_redis()
    client.incr(f"{KEYS.prefix}fixture:arrived:{name}")
    client.publish(f"{KEYS.prefix}fixture:events", f"arrived:{name}")
    item = client.blpop([f"{KEYS.prefix}fixture:release:{name}"], timeout=BARRIER_TIMEOUT_S)
    if item is None:
        raise TimeoutError(f"barrier {name!r} was not released within {BARRIER_TIMEOUT_S} s")
    return item[1]


@shared_task(name="inference.unload_model", acks_late=False)
def unload_model(model_id: str, boot: str, token: str, channel: str, actor: str = "") -> None:
    """Destroy this worker's pool of ``model_id``: sessions first, then weights (R4.5).

    The caller holds the model's manager lease and has already cleared the
    logical residency. Outcome in ``as:loadout:<token>``: ``{"ok": true,
    "had_pool": bool, "duration_ms"}`` or ``{"ok": false, "error"}``; wake-up
    ``load:<token>``.
    """
    from registry.services import registration_record_unload

    started = time.monotonic()
    had_pool, error = _destroy_pool(model_id) if boot == WORKER.boot else (False, "")
    payload: dict = {"ok": not error, "had_pool": had_pool}
    if error:
        payload["error"] = error
    payload["duration_ms"] = int((time.monotonic() - started) * 1000)
    try:
        registration_record_unload(model_id, payload["ok"], detail=payload.get("error", ""),
                                   duration_ms=payload["duration_ms"], actor=actor or WORKER.hostname or "")
    except Exception:
        log.exception("recording an unload failed")
    _reply(channel, KEYS.load_result(token), f"load:{token}", payload)
