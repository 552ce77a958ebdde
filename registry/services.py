"""Writes to the registry: the only module that changes a ``ModelRegistration``.

Names follow ``<entity>_<action>``. Every transition writes a
``LifecycleEvent``. Registrations are also published to Redis (one JSON per
model in ``as:models``) so every web and worker process reads the same
metadata without touching the database on the request path.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.db import DataError, transaction
from django.utils import timezone
from pydantic import ValidationError

from audiosite.errors import ApplicationError, InvalidRequest, ModelLoadFailed, NotFound
from audiosite.serverconfig import ModelConfig, ServerConfig, get_config
from inference import specs
from inference.backend import resolve_backend
from inference.runtime import dispatch, runtime_name
from inference.runtime.context import KEYS
from inference.scheduler import Lease

from .models import LifecycleEvent, LifecycleState, ModelRegistration
from .selectors import model_meta_all, model_meta_get

log = logging.getLogger(__name__)


def _entry_fields(entry: ModelConfig) -> dict:
    return {
        "family": entry.family,
        "task": entry.task or specs.default_task(entry.family),
        "mode": entry.mode,
        "path": entry.path or "",
        "options": {
            "load_options": entry.load_options,
            "session_options": entry.session_options,
            "default_request_options": entry.default_request_options,
        },
        "busy_timeout_ms": entry.busy_timeout_ms,
        "slots": entry.slots,
        "lazy": entry.lazy,
    }


def lifecycle_event_create(model_id: str, event: str, ok: bool, *, actor: str = "", detail: str = "",
                           duration_ms: int | None = None) -> LifecycleEvent:
    """Append one audit row."""
    return LifecycleEvent.objects.create(
        model_id=model_id,
        event=event,
        outcome=LifecycleEvent.Outcome.OK if ok else LifecycleEvent.Outcome.FAILED,
        actor=actor,
        detail=detail[:4000],
        duration_ms=duration_ms,
    )


@transaction.atomic
def registration_sync_config(config: ServerConfig, actor: str = "config") -> dict[str, list[str]]:
    """Upsert the config file's models; remove config-sourced rows the file no longer lists.

    Registrations made through the management API are left alone. A config
    entry whose id is held by an API registration takes it over (the file wins).

    Returns:
        ``{"created": [...], "updated": [...], "unchanged": [...], "removed": [...]}`` (model ids).
    """
    report: dict[str, list[str]] = {"created": [], "updated": [], "unchanged": [], "removed": []}
    listed = set()
    for entry in config.models:
        listed.add(entry.id)
        fields = _entry_fields(entry)
        row = ModelRegistration.objects.select_for_update().filter(model_id=entry.id).first()
        if row is None:
            ModelRegistration.objects.create(model_id=entry.id, source=ModelRegistration.Source.CONFIG, **fields)
            lifecycle_event_create(entry.id, "register", True, actor=actor, detail=json.dumps(fields))
            report["created"].append(entry.id)
            continue
        changed = any(getattr(row, k) != v for k, v in fields.items()) or row.source != ModelRegistration.Source.CONFIG
        if changed:
            for key, value in fields.items():
                setattr(row, key, value)
            row.source = ModelRegistration.Source.CONFIG
            row.state = LifecycleState.UNLOADED
            row.save()
            lifecycle_event_create(entry.id, "update", True, actor=actor, detail=json.dumps(fields))
            report["updated"].append(entry.id)
        else:
            report["unchanged"].append(entry.id)
    stale = ModelRegistration.objects.filter(source=ModelRegistration.Source.CONFIG).exclude(model_id__in=listed)
    for row in stale:
        lifecycle_event_create(row.model_id, "unregister", True, actor=actor, detail="no longer in the config file")
        report["removed"].append(row.model_id)
    stale.delete()
    return report


def _queue_publish(pipe, keys, meta: dict, runtime: str) -> str:
    """Queue the commands that publish one entry and its slot count on ``pipe``; returns the entry's JSON.

    The slot count is ``slots`` (1 when unset) on the parallel runtime, always 1 on legacy (R1.1).
    """
    text = json.dumps(meta, sort_keys=True)
    pipe.hset(keys.models_meta, meta["id"], text)
    pipe.set(keys.model(meta["id"]) + ":cap", (meta.get("slots") or 1) if runtime == "parallel" else 1)
    return text


def registry_publish(redis_client, keys, runtime: str = "legacy") -> list[str]:
    """Publish every registration to Redis, replacing what was there (one MULTI).

    Each model's slot count is its ``slots`` (1 when unset; always 1 on the
    legacy runtime). A model whose published metadata changed is marked
    unloaded so the next request loads the new configuration. The runtime
    name is recorded in ``as:runtime`` (see :func:`runtime_claim`).

    Args:
        redis_client: synchronous ``redis.Redis`` (decode_responses=True).
        keys: ``inference.scheduler.Keys``.

    Returns:
        The published model ids.
    """
    rows = list(ModelRegistration.objects.all())
    previous = redis_client.hgetall(keys.models_meta)
    pipe = redis_client.pipeline(transaction=True)
    pipe.delete(keys.models_meta)
    for row in rows:
        meta = _queue_publish(pipe, keys, row.as_meta(), runtime)
        if previous.get(row.model_id) not in (None, meta):
            pipe.hset(keys.model(row.model_id) + ":load", mapping={"state": "unloaded", "error": "configuration changed"})
    pipe.set(keys.runtime, runtime)
    pipe.execute()
    return [row.model_id for row in rows]


def registration_record_load(model_id: str, ok: bool, *, error: str = "", duration_ms: int | None = None,
                             actor: str = "") -> None:
    """Record the outcome of a load: state ready/unloaded, last error, an audit row."""
    updates = {"state": LifecycleState.READY if ok else LifecycleState.UNLOADED, "last_error": "" if ok else error,
               "updated_at": timezone.now()}
    if ok:
        updates["loaded_at"] = timezone.now()
    ModelRegistration.objects.filter(model_id=model_id).update(**updates)
    lifecycle_event_create(model_id, "load", ok, actor=actor, detail=error, duration_ms=duration_ms)


def registration_record_loading(model_id: str, actor: str = "") -> None:
    """Record that a load started (state ``loading``)."""
    _registration_set_state(model_id, LifecycleState.LOADING)


def registration_record_lost(model_ids: list[str], reason: str, actor: str = "") -> None:
    """Record that loaded pools are gone (worker stopped or died): state ``unloaded``."""
    if not model_ids:
        return
    ModelRegistration.objects.filter(model_id__in=model_ids).update(
        state=LifecycleState.UNLOADED, last_error=reason, updated_at=timezone.now()
    )
    for model_id in model_ids:
        lifecycle_event_create(model_id, "unload", True, actor=actor, detail=reason)


class RuntimeMismatch(Exception):
    """Another runtime is already recorded for this deployment (R1.4)."""


def runtime_claim(redis_client, keys, runtime: str) -> None:
    """Record ``runtime`` for the deployment, or refuse when another one is recorded (R1.4).

    Raises:
        RuntimeMismatch: Redis already records a different runtime; every
            process of one deployment must run the same runtime.
    """
    redis_client.set(keys.runtime, runtime, nx=True)
    recorded = redis_client.get(keys.runtime)
    if recorded != runtime:
        raise RuntimeMismatch(
            f"this deployment runs the {recorded} runtime (recorded in Redis key {keys.runtime}); "
            f"refusing to start a {runtime} process. Stop every process, delete that key, and start all "
            "processes with the same runtime."
        )


def registration_record_unload(model_id: str, ok: bool, *, detail: str = "", duration_ms: int | None = None,
                               actor: str = "", event: str = "teardown") -> None:
    """Record a pool's destruction: state ``unloaded`` and an audit row (``event``: teardown, idle_retire)."""
    ModelRegistration.objects.filter(model_id=model_id).update(
        state=LifecycleState.UNLOADED, last_error="" if ok else detail, updated_at=timezone.now()
    )
    lifecycle_event_create(model_id, event, ok, actor=actor, detail=detail, duration_ms=duration_ms)


# -- management transitions (CONTRACT R4–R5; the routes of registry.apis call these) ----------------
#
# Each transition runs under the model's manager lease (a barrier, R2.2):
# older requests drain first, later ones bind the configuration it leaves
# (R2.3). Database writes run in a thread (sync_to_async); Redis holds the
# published metadata every process reads.

MANAGEMENT_FIELDS = ("id", "family", "path", "task", "mode", "slots", "busy_timeout_ms", "lazy",
                     "load_options", "session_options", "default_request_options")


@dataclass(frozen=True)
class ValidatedEntry:
    """A management body that passed private validation (R4.4, R4.6).

    ``entry`` is the parsed model entry; ``count_problem`` is set when the count is a valid
    integer the model cannot run (above the advertised ``capacity=N`` or the
    admitted counts): refused for an existing id, registered-but-unloaded
    for a new one.
    """

    entry: ModelConfig
    count_problem: str | None


def registration_validate(body, runtime: str, backend: str) -> ValidatedEntry:
    """Check a ``POST /v1/models/load`` body privately: nothing live is touched (R4.4, R7.1).

    Checks the shape and types (strict), the family, task and mode, the
    option blocks against the family schema, that ``path`` (or the packaged
    default checkpoint) exists, and the slot count (R1.2, R1.3, R9).

    Args:
        body: the decoded JSON object.
        runtime: 'legacy' or 'parallel'.
        backend: the resolved backend ('cpu' or 'cuda') for the capacity probe.

    Text with NUL characters or unpaired surrogates is refused at the edges
    (``registry.apis``, the admin form) before it gets here.

    Raises:
        InvalidRequest: the first problem found, with ``param`` naming the key.
    """
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object with at least 'id' and 'family'")
    unknown = sorted(set(body) - set(MANAGEMENT_FIELDS))
    if unknown:
        raise InvalidRequest(f"unknown key(s) {unknown}; allowed: {list(MANAGEMENT_FIELDS)}", param=unknown[0])
    if "slots" in body and runtime != "parallel":
        raise InvalidRequest("slots requires --parallel-jobs: the legacy runtime serves one session per model and "
                             "refuses any explicit slots, including 1 and null (R1.2)", param="slots")
    try:
        entry = ModelConfig.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or None
        message = "required" if err["type"] == "missing" else err["msg"]
        raise InvalidRequest(f"key {key!r}: {message}", param=key) from None
    problems = specs.check_model_entry(entry.model_dump())
    if problems:
        raise InvalidRequest(problems[0], param=problems[0].split("'")[1] if problems[0].startswith("key '") else None)
    try:
        specs.resolve_checkpoint(entry.family, entry.path)
    except FileNotFoundError as exc:
        raise InvalidRequest(f"key 'path': {exc}", param="path") from None
    count_problem = None
    if "slots" in body:
        problem = specs.slots_value_problem(body["slots"])
        if problem:
            raise InvalidRequest(problem, param="slots")
        task = entry.task or specs.default_task(entry.family)
        count_problem = specs.slots_count_problem(entry.family, task, entry.mode, body["slots"], backend)
    return ValidatedEntry(entry, count_problem)


def _meta_of(entry: ModelConfig, source: str) -> dict:
    """The metadata ``entry`` would publish once saved (``ModelRegistration.as_meta`` of an unsaved row)."""
    return ModelRegistration(model_id=entry.id, source=source, **_entry_fields(entry)).as_meta()


def _same_configuration(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k != "source"} == {k: v for k, v in b.items() if k != "source"}


async def _save(entry: ModelConfig, actor: str, event: str, state: str) -> None:
    """Write the row; a value the database refuses (e.g. out of range) is the caller's fault: 400."""
    try:
        await sync_to_async(_registration_save)(entry, actor, event, state)
    except DataError as exc:
        raise InvalidRequest(f"the entry cannot be stored: {str(exc).splitlines()[0]}") from None


@transaction.atomic
def _registration_save(entry: ModelConfig, actor: str, event: str, state: str) -> ModelRegistration:
    fields = _entry_fields(entry)
    row = ModelRegistration.objects.select_for_update().filter(model_id=entry.id).first()
    if row is None:
        row = ModelRegistration.objects.create(model_id=entry.id, source=ModelRegistration.Source.API, **fields)
    else:
        for key, value in fields.items():
            setattr(row, key, value)
        row.state = state
        row.save()
    lifecycle_event_create(entry.id, event, True, actor=actor, detail=json.dumps(fields))
    return row


def _registration_set_state(model_id: str, state: str, error: str | None = None) -> None:
    updates = {"state": state, "updated_at": timezone.now()}
    if error is not None:
        updates["last_error"] = error
    ModelRegistration.objects.filter(model_id=model_id).update(**updates)


@transaction.atomic
def _registration_remove(model_id: str, actor: str, duration_ms: int) -> None:
    ModelRegistration.objects.filter(model_id=model_id).delete()
    lifecycle_event_create(model_id, "unregister", True, actor=actor, duration_ms=duration_ms)


def _first_load_published(model_id: str) -> bool:
    return ModelRegistration.objects.filter(model_id=model_id, loaded_at__isnull=False).exists()


async def _publish_meta(ctx, model_id: str, meta: dict, runtime: str) -> None:
    """Publish one entry and its slot count in one MULTI (every process sees old or new, R4.7)."""
    pipe = ctx.redis.pipeline(transaction=True)
    _queue_publish(pipe, KEYS, meta, runtime)
    await pipe.execute()


async def model_teardown(ctx, model_id: str, actor: str, state: str = LifecycleState.UNLOADING) -> str:
    """Unload under a held manager lease, recording ``state`` then ``unloaded`` in the database too (R4).

    Returns:
        The outcome of ``inference.runtime.dispatch.unload_held``.
    """
    await sync_to_async(_registration_set_state)(model_id, state)
    outcome = await dispatch.unload_held(ctx, model_id, actor=actor, state=state)
    await sync_to_async(_registration_set_state)(model_id, LifecycleState.UNLOADED)
    return outcome


async def _load_now(ctx, model_id: str, meta: dict) -> bool:
    """Load under the caller's manager lease unless the entry is lazy. Returns whether it is loaded.

    Raises:
        ModelLoadFailed, ServerBusy, InsufficientMemory: the load failed; the
            entry stays registered and unloaded (R4.2, R4.4, R4.6).
    """
    lazy = meta["lazy"] if meta.get("lazy") is not None else get_config().lazy_load
    if lazy:
        return False
    try:
        await dispatch.ensure_loaded(ctx, model_id)
    except ApplicationError as exc:
        exc.committed = True  # the entry is registered; only its load failed
        exc.message += "; the entry is registered and stays unloaded (the next request retries the load)"
        if not isinstance(exc, ModelLoadFailed):  # a worker's failed load writes its own event
            await sync_to_async(lifecycle_event_create)(model_id, "load", False, detail=exc.message)
        raise
    return True


async def model_register_or_reconfigure(ctx, body, actor: str) -> dict:
    """``POST /v1/models/load``: register a new id (R4.6) or reconfigure an existing one (R4.4).

    New id: validate privately, take the id's manager lease (a second
    registration of the same id queues on it), publish one complete entry
    (visible as ``loading``/``unloaded`` while its first load runs), then load
    unless lazy. A count the model cannot run registers the entry unloaded
    and answers 400 with ``capacity=``; a failed first load leaves the entry
    registered and unloaded.

    Existing id: validate privately (an unsupported count is refused with
    400 and nothing changes), take the manager lease under the model's busy
    timeout (older requests drain), then: same configuration → just make
    sure it is loaded (``reconfigured: false``); otherwise retire the old
    pool (state ``reconfiguring``), commit the new metadata, load the
    replacement. A post-commit load failure leaves the new metadata
    registered and unloaded; the next request retries.

    Returns:
        ``{"id", "loaded": bool, "reconfigured": bool}``.

    Raises:
        InvalidRequest: invalid body or unsupported count (R4.4, R1.2).
        ServerBusy: manager admission timeout or fail-fast (R3.4).
        ModelLoadFailed / InsufficientMemory / ServerBusy: the (re)load failed after commit.
    """
    runtime = runtime_name()
    backend = await asyncio.to_thread(resolve_backend, get_config().backend)
    valid = await asyncio.to_thread(registration_validate, body, runtime, backend)
    entry, model_id = valid.entry, valid.entry.id
    existing = await model_meta_get(ctx, model_id)
    if existing is not None and valid.count_problem:
        raise InvalidRequest(valid.count_problem + "; the registration is unchanged", param="slots")
    async def transition() -> dict:
        started = time.monotonic()
        existing = await model_meta_get(ctx, model_id)  # may have changed while we queued
        if existing is None:
            meta = _meta_of(entry, ModelRegistration.Source.API)
            await _save(entry, actor, "register", LifecycleState.UNLOADED)
            await ctx.scheduler.set_state(model_id, "unloaded")
            await _publish_meta(ctx, model_id, meta, runtime)
            if valid.count_problem:
                await sync_to_async(_registration_set_state)(model_id, LifecycleState.UNLOADED,
                                                             valid.count_problem)
                raise InvalidRequest(valid.count_problem + f"; model {model_id!r} is registered but stays "
                                     "unloaded until it is reconfigured with a supported count", param="slots")
            return {"id": model_id, "loaded": await _load_now(ctx, model_id, meta), "reconfigured": False}
        if valid.count_problem:
            raise InvalidRequest(valid.count_problem + "; the registration is unchanged", param="slots")
        meta = _meta_of(entry, existing.get("source") or ModelRegistration.Source.API)
        if _same_configuration(meta, existing):
            return {"id": model_id, "loaded": await _load_now(ctx, model_id, meta), "reconfigured": False}
        # The row is written first (state reconfiguring): a value the database refuses is a
        # 400 while the old pool still serves. Then the commit point: retire the old pool and
        # publish the complete new metadata (R4.4); traffic reads only the published entry.
        await _save(entry, actor, "reconfigure", LifecycleState.RECONFIGURING)
        await model_teardown(ctx, model_id, f"reconfigure by {actor}", LifecycleState.RECONFIGURING)
        await _publish_meta(ctx, model_id, meta, runtime)
        await ctx.scheduler.set_state(model_id, "unloaded")
        loaded = await _load_now(ctx, model_id, meta)
        log.info("reconfigured %s in %.0f ms", model_id, (time.monotonic() - started) * 1000)
        return {"id": model_id, "loaded": loaded, "reconfigured": True}

    return await dispatch.run_as_manager(ctx, model_id, dispatch.ceiling_ms(existing), transition)


async def _registered_meta(ctx, model_id: str) -> dict:
    """Published metadata of ``model_id``; raises NotFound (404, param ``id``) when it is not registered."""
    meta = await model_meta_get(ctx, model_id)
    if meta is None:
        raise NotFound(f"model {model_id!r} is not registered", param="id")
    return meta


async def model_unload(ctx, model_id: str, actor: str) -> dict:
    """``POST /v1/models/unload``: unload one model as a manager (R4.5). Idempotent.

    Returns:
        ``{"id", "loaded": false}``.

    Raises:
        NotFound: the id is not registered.
        ServerBusy: manager admission timeout or fail-fast (R3.4).
    """
    meta = await _registered_meta(ctx, model_id)
    async def transition() -> dict:
        started = time.monotonic()
        outcome = await model_teardown(ctx, model_id, actor)
        await sync_to_async(lifecycle_event_create)(model_id, "unload", True, actor=actor, detail=outcome,
                                                    duration_ms=int((time.monotonic() - started) * 1000))
        return {"id": model_id, "loaded": False}

    return await dispatch.run_as_manager(ctx, model_id, dispatch.ceiling_ms(meta), transition)


async def model_unregister(ctx, model_id: str, actor: str) -> dict:
    """``DELETE /v1/models/{id}``: barrier, unload, then remove the registration.

    Requests queued behind the barrier then answer 404. An entry of the
    config file comes back at the next start (the file is the source of
    truth for its entries).

    Returns:
        ``{"id", "deleted": true}``.

    Raises:
        NotFound: the id is not registered.
        ServerBusy: manager admission timeout or fail-fast (R3.4).
    """
    meta = await _registered_meta(ctx, model_id)
    async def transition() -> dict:
        started = time.monotonic()
        await _registered_meta(ctx, model_id)  # an earlier manager may have removed it
        await model_teardown(ctx, model_id, f"unregister by {actor}")
        pipe = ctx.redis.pipeline(transaction=True)
        pipe.hdel(KEYS.models_meta, model_id)
        pipe.delete(KEYS.model(model_id) + ":load", KEYS.model(model_id) + ":cap")
        await pipe.execute()
        await sync_to_async(_registration_remove)(model_id, actor, int((time.monotonic() - started) * 1000))
        return {"id": model_id, "deleted": True}

    return await dispatch.run_as_manager(ctx, model_id, dispatch.ceiling_ms(meta), transition)


async def models_bulk_unload(ctx, model_ids: list[str] | None, actor: str) -> dict:
    """Bulk unload (R5): ``POST /v1/tasks/unload_models`` (a selection) or ``unload_all_models`` (None).

    Snapshot of the selected registered models (unknown ids go to
    ``not_found``; duplicates count once; later registrations are not
    covered, R5.3), then one manager ticket on every selected model in one
    atomic publication (R5.1, R5.2), then unload the models granted at once
    (ready-idle) first and the rest as their older work drains. Waits without
    bound (R3.4). On the legacy runtime, models whose first load is still
    running are skipped (R5.4) and listed in ``skipped``. If the caller goes
    away, every ticket and lease still held is given back.

    Returns:
        ``{"unloaded": [ids, in selection order], "not_found": [ids], "skipped": [ids]}``.
    """
    metas = await model_meta_all(ctx)
    if model_ids is None:
        wanted = list(metas)
    else:
        wanted = list(dict.fromkeys(model_ids))
    selected = [m for m in wanted if m in metas]
    not_found = [m for m in wanted if m not in metas]
    skipped: list[str] = []
    if runtime_name() == "legacy" and selected:
        snapshot = await ctx.scheduler.snapshot(selected)
        for model_id in selected:
            status = snapshot[model_id]
            # A first load is under way when the model was never loaded and someone holds it
            # (a request or a registration loading it, perhaps still waiting on the cold-load guard).
            busy = status["state"] == "loading" or status["active_leases"] or status["manager_leases"]
            if status["state"] != "ready" and busy and not await sync_to_async(_first_load_published)(model_id):
                skipped.append(model_id)
        selected = [m for m in selected if m not in skipped]
    tickets: dict[str, str] = {}
    futures = await ctx.scheduler.acquire_many(ctx.listener, selected, tickets) if selected else {}
    pending = dict(futures)  # not yet unloaded (granted or still queued)
    unloaded: set[str] = set()
    gone: list[str] = []

    async def keep_alive() -> None:
        """Renew granted leases that wait their turn; reap for queued tickets (R2.5, lost wake-ups)."""
        every_s = ctx.scheduler.lease_ttl_ms / 3000
        while True:
            await asyncio.sleep(every_s)
            for model_id, future in list(pending.items()):
                if future.done():
                    await ctx.scheduler.renew(model_id, tickets[model_id])
                    continue
                reaped = await ctx.scheduler.reap(model_id, tickets[model_id])
                if reaped[2] == "granted" and not future.done():  # the wake-up was lost
                    future.set_result(Lease(model_id, tickets[model_id], 0, 0.0, "manager"))

    async def teardown(model_id: str) -> None:
        if await model_meta_get(ctx, model_id) is None:  # unregistered by a manager ahead of us
            gone.append(model_id)
            return
        started = time.monotonic()
        outcome = await model_teardown(ctx, model_id, f"bulk unload by {actor}")
        await sync_to_async(lifecycle_event_create)(model_id, "unload", True, actor=actor,
                                                    detail=f"bulk unload: {outcome}",
                                                    duration_ms=int((time.monotonic() - started) * 1000))
        unloaded.add(model_id)

    async def unload_one(model_id: str) -> None:
        lease = pending.pop(model_id).result()
        # Once granted, the teardown finishes even if the caller leaves (R4.5).
        await dispatch.run_to_completion(dispatch.with_manager_lease(ctx, model_id, lease, teardown(model_id)))

    keeper = asyncio.create_task(keep_alive())
    try:
        for model_id in [m for m, f in futures.items() if f.done()]:  # ready-idle first (R5.1)
            await unload_one(model_id)
        while pending:
            await asyncio.wait(set(pending.values()), return_when=asyncio.FIRST_COMPLETED)
            for model_id in [m for m, f in pending.items() if f.done()]:
                await unload_one(model_id)
    finally:
        keeper.cancel()
        for model_id in list(pending):  # caller gone or an error: leave nothing behind
            await ctx.scheduler.abandon(model_id, tickets[model_id])
    return {"unloaded": [m for m in selected if m in unloaded], "not_found": not_found + gone, "skipped": skipped}
