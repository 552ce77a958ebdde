"""The registry's services: the management transitions (CONTRACT R4–R5) register, reconfigure, unload,
unregister, bulk unload; and the private check of a management entry before its transition.

The routes of ``registry.apis``, the Django admin, the UI's actions
(``ui.views``) and ``manage.py unload_model`` call these. Each transition runs
under the model's manager lease (a barrier, R2.2): older requests drain first,
later ones bind the configuration it leaves (R2.3). Teardowns go through
``inference.services.model_teardown``; database writes through
``registry.records`` (in a thread); Redis holds the published metadata every
process reads. Names follow ``<entity>_<action>`` (``model_register``,
``models_bulk_unload``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from pydantic import ValidationError

from audiosite.errors import ApplicationError, InvalidRequest, ModelLoadFailed, NotFound
from audiosite.serverconfig import ModelConfig, ServerConfig, get_config, slot_count
from inference import services as inference_services
from inference import specs
from inference.backend import resolve_backend
from inference.runtime import leases, metrics
from inference.runtime.context import AsyncContext
from inference.runtime.published import ceiling_ms, is_lazy
from inference.scheduler import Lease, ModelState

from . import records
from .models import LifecycleState, ModelRegistration
from .selectors import (ENTRY_KEYS, model_meta_all, model_meta_get, registration_body_of,
                        registration_first_load_published)

log = logging.getLogger(__name__)


_NOT_CONFIGURATION = ("source", "created")


def _same_configuration(a: dict, b: dict) -> bool:
    return ({k: v for k, v in a.items() if k not in _NOT_CONFIGURATION}
            == {k: v for k, v in b.items() if k not in _NOT_CONFIGURATION})


async def _registered_meta(ctx: AsyncContext, model_id: str) -> dict:
    """Published metadata of ``model_id``; raises NotFound (404, param ``id``) when it is not registered."""
    meta = await model_meta_get(ctx, model_id)
    if meta is None:
        raise NotFound(f"model {model_id!r} is not registered", param="id")
    return meta


async def _load_now(ctx: AsyncContext, model_id: str, meta: dict, asked: bool = False) -> bool:
    """Load under the caller's manager lease unless the entry is lazy and the load was not ``asked`` for
    (a plain load of a registration: the caller wants it loaded now, and its ``lazy`` stays as it is).
    Returns whether it is loaded.

    Raises:
        ModelLoadFailed, ServerBusy, InsufficientMemory: the load failed; the
            entry stays registered and unloaded (R4.2, R4.4, R4.6): a new error of the load's
            class, ``committed`` (``ApplicationError.entry_committed``).
    """
    if is_lazy(meta) and not asked:
        return False
    try:
        await inference_services.model_ensure_loaded(ctx, model_id, force=True)  # explicit: no backoff (R6.7)
    except ApplicationError as exc:
        failed = exc.entry_committed()  # the entry is registered; only its load failed
        if not isinstance(exc, ModelLoadFailed):  # a worker's failed load writes its own event
            await sync_to_async(records.lifecycle_event_create)(model_id, "load", False, detail=failed.message)
        raise failed from exc
    return True


# -- management entries: checked privately before any transition (R4.4, R4.6, R7.1) ------------------

def registration_merge(body: Any, meta: dict | None) -> Any:
    """A ``POST /v1/models/load`` body applied to the registered entry ``meta`` (None: a new id).

    Only the keys the caller sends change (each replaces that key as a whole: an options block sent
    replaces the old block); ``{"id": ...}`` alone gives the entry as it is. A body that names another
    family is a new entry of that family (the old options belong to the old family), so it replaces
    the entry instead. A body that is not an object is returned as it is (validation refuses it).
    """
    if meta is None or not isinstance(body, dict):
        return body
    if "family" in body and body["family"] != meta.get("family"):
        return body
    return {**registration_body_of(meta), **body}


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


def registration_validate(body, runtime: str, backend: str, current: dict | None = None) -> ValidatedEntry:
    """Check a ``POST /v1/models/load`` body privately: nothing live is touched (R4.4, R7.1).

    Checks the shape and types (strict), the family, task and mode, the
    option blocks against the family schema, that ``path`` (or the packaged
    default checkpoint) exists, the slot count (R1.2, R1.3, R9) and, on the parallel runtime, a sent
    ``max_batch`` against the admitted batch sizes (R9.2).

    Args:
        body: the decoded JSON object.
        runtime: 'legacy' or 'parallel'.
        backend: the resolved backend ('cpu' or 'cuda') for the capacity probe.
        current: the published entry of ``body``'s id when it is registered: the body is applied to
            it (:func:`registration_merge`: only the keys sent change) and the result is checked.
            The legacy runtime's refusal of ``slots`` and the count check concern the keys sent.

    Text with NUL characters or unpaired surrogates is refused at the edges
    (``registry.apis``, the admin form) before it gets here.

    Raises:
        InvalidRequest: the first problem found, with ``param`` naming the key.
    """
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object with at least 'id' and 'family'")
    unknown = sorted(set(body) - set(ENTRY_KEYS))
    if unknown:
        raise InvalidRequest(f"unknown key(s) {unknown}; allowed: {list(ENTRY_KEYS)}", param=unknown[0])
    if "slots" in body and runtime != "parallel":
        raise InvalidRequest("slots requires --parallel-jobs: the legacy runtime serves one session per model and "
                             "refuses any explicit slots, including 1 and null (R1.2)", param="slots")
    sent = body
    body = registration_merge(body, current)
    try:
        entry = ModelConfig.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or None
        message = "required" if err["type"] == "missing" else err["msg"]
        raise InvalidRequest(f"key {key!r}: {message}", param=key) from None
    problems = specs.check_model_entry(entry.model_dump())
    if problems:
        raise InvalidRequest(str(problems[0]), param=problems[0].param)
    try:
        specs.resolve_checkpoint(entry.family, entry.path)
    except FileNotFoundError as exc:
        raise InvalidRequest(f"key 'path': {exc}", param="path") from None
    count_problem = None
    if "slots" in sent:
        problem = specs.slots_value_problem(body["slots"])
        if problem:
            raise InvalidRequest(problem, param="slots")
        task = entry.task or specs.default_task(entry.family)
        count_problem = specs.slots_count_problem(entry.family, task, entry.mode, body["slots"], backend)
    if "max_batch" in sent and runtime == "parallel":
        problem = specs.batch_size_problem(entry.family, entry.task or specs.default_task(entry.family),
                                           entry.max_batch, backend)
        if problem:
            raise InvalidRequest(problem, param="max_batch")
    return ValidatedEntry(entry, count_problem)



# -- transitions ---------------------------------------------------------------------------------------

async def model_register_or_reconfigure(ctx: AsyncContext, body, actor: str) -> dict:
    """``POST /v1/models/load`` (and the admin's and the UI's forms): look the body's ``id`` up, then
    :func:`model_register` (not registered, R4.6) or :func:`model_reconfigure` (registered, R4.4).

    Either one applies the body to the entry as it is when its manager lease is granted: an id
    registered by another caller while this one queued is reconfigured, one unregistered while it
    queued is registered anew.

    Returns / Raises: as :func:`model_register` and :func:`model_reconfigure`.
    """
    named = body.get("id") if isinstance(body, dict) else None
    existing = await model_meta_get(ctx, named) if isinstance(named, str) and named else None
    if existing is None:
        return await model_register(ctx, body, actor)
    return await model_reconfigure(ctx, body, actor, existing)


async def model_register(ctx: AsyncContext, body, actor: str) -> dict:
    """Register a new id (R4.6): ``body`` is a whole entry (at least ``id`` and ``family``).

    Validate privately, take the id's manager lease (a second registration of
    the same id queues on it), publish one complete entry (visible as
    ``loading``/``unloaded`` while its first load runs), then load unless
    lazy. A count the model cannot run registers the entry unloaded and
    answers 400 with ``capacity=``; a failed first load leaves the entry
    registered and unloaded. If the id was registered by the time the lease
    is granted, the body reconfigures that entry (:func:`model_reconfigure`'s
    transition).

    Returns:
        ``{"id", "loaded": bool, "reconfigured": bool}``.

    Raises:
        InvalidRequest: invalid body, or a count the model cannot run (the entry is then registered
            and unloaded) (R4.6, R1.2).
        ServerBusy: manager admission timeout or fail-fast (R3.4).
        ModelLoadFailed / InsufficientMemory / ServerBusy: the first load failed (the entry stays
            registered and unloaded).
    """
    config = get_config()
    backend = await asyncio.to_thread(resolve_backend, config.backend)
    valid = await asyncio.to_thread(registration_validate, body, config.runtime, backend, None)
    return await _entry_transition(ctx, body, actor, None, valid, config, backend)


async def model_reconfigure(ctx: AsyncContext, body, actor: str, existing: dict) -> dict:
    """Reconfigure the registered entry ``existing`` (its published metadata) with ``body`` (R4.4).

    ``body`` holds ``id`` and the keys to change: it is applied to the entry as it is when the
    manager lease is granted (``registration_merge``), so ``{"id": ...}`` alone loads the
    registration unchanged, and a key no caller sent (voice presets, say) is never lost.

    Validate privately (an unsupported count is refused with 400 and nothing
    changes), take the manager lease under the model's busy timeout (older
    requests drain), then: same configuration → just make sure it is loaded, a lazy
    registration too (``reconfigured: false``; its ``lazy`` stays); otherwise retire the old pool (state
    ``reconfiguring``), commit the new metadata, load the replacement. A
    post-commit load failure leaves the new metadata registered and
    unloaded; the next request retries. If the id was unregistered by the
    time the lease is granted, the body registers it anew
    (:func:`model_register`'s transition).

    Returns:
        ``{"id", "loaded": bool, "reconfigured": bool}``.

    Raises:
        InvalidRequest: invalid body or unsupported count (R4.4, R1.2).
        ServerBusy: manager admission timeout or fail-fast (R3.4).
        ModelLoadFailed / InsufficientMemory / ServerBusy: the (re)load failed after commit.
    """
    config = get_config()
    backend = await asyncio.to_thread(resolve_backend, config.backend)
    valid = await asyncio.to_thread(registration_validate, body, config.runtime, backend, existing)
    if valid.count_problem:
        raise InvalidRequest(valid.count_problem + "; the registration is unchanged", param="slots")
    return await _entry_transition(ctx, body, actor, existing, valid, config, backend)


async def _entry_transition(ctx: AsyncContext, body, actor: str, existing: dict | None,
                            valid: ValidatedEntry, config: ServerConfig, backend: str) -> dict:
    """Run the register or reconfigure transition of ``valid.entry.id`` under its manager lease.

    ``existing`` is the entry ``valid`` was checked against (None: not registered). Once the lease is
    granted the entry is read again: when it changed while we queued, ``body`` is checked again against
    the entry as it is now, and that entry (None or not) chooses the transition.
    """
    model_id = valid.entry.id

    async def transition(lease: Lease) -> dict:
        started = time.monotonic()
        current = await model_meta_get(ctx, model_id)  # may have changed while we queued
        checked = valid
        if current != existing:  # apply the keys sent to the entry as it is now
            checked = await asyncio.to_thread(registration_validate, body, config.runtime, backend, current)
        if current is None:
            return await _register_granted(ctx, lease, checked, actor, config.runtime)
        outcome = await _reconfigure_granted(ctx, lease, checked, current, actor, config.runtime)
        if outcome["reconfigured"]:
            log.info("reconfigured %s in %.0f ms", model_id, (time.monotonic() - started) * 1000)
        return outcome

    return await leases.run_as_manager(ctx, model_id, ceiling_ms(existing), transition)


async def _register_granted(ctx: AsyncContext, lease: Lease, valid: ValidatedEntry, actor: str,
                            runtime: str) -> dict:
    """Register ``valid.entry`` (not registered) under the granted manager ``lease``, then load it unless lazy."""
    entry, model_id = valid.entry, valid.entry.id
    meta = records.registration_meta_of(entry, ModelRegistration.Source.API)
    meta["created"] = int(time.time())
    await sync_to_async(records.registration_save)(entry, actor, "register", LifecycleState.UNLOADED)
    await ctx.scheduler.publish_entry(meta, slot_count(meta.get("slots"), runtime), lease.lease_id, reset=True)
    if valid.count_problem:
        await sync_to_async(records.registration_record_state)(model_id, LifecycleState.UNLOADED,
                                                                valid.count_problem)
        raise InvalidRequest(valid.count_problem + f"; model {model_id!r} is registered but stays "
                             "unloaded until it is reconfigured with a supported count", param="slots")
    return {"id": model_id, "loaded": await _load_now(ctx, model_id, meta), "reconfigured": False}


async def _reconfigure_granted(ctx: AsyncContext, lease: Lease, valid: ValidatedEntry, current: dict,
                               actor: str, runtime: str) -> dict:
    """Apply ``valid.entry`` over the registered ``current`` under the granted manager ``lease`` (R4.4)."""
    entry, model_id = valid.entry, valid.entry.id
    if valid.count_problem:
        raise InvalidRequest(valid.count_problem + "; the registration is unchanged", param="slots")
    meta = records.registration_meta_of(entry, current.get("source") or ModelRegistration.Source.API)
    meta["created"] = current.get("created")
    if _same_configuration(meta, current):  # a plain load: load it now, lazy or not
        return {"id": model_id, "loaded": await _load_now(ctx, model_id, meta, asked=True), "reconfigured": False}
    # The row is written first (state reconfiguring): a value the database refuses is a
    # 400 while the old pool still serves. Then the commit point: retire the old pool and
    # publish the complete new metadata (R4.4); traffic reads only the published entry.
    await sync_to_async(records.registration_save)(entry, actor, "reconfigure", LifecycleState.RECONFIGURING)
    await inference_services.model_teardown(ctx, lease, f"reconfigure by {actor}", state=ModelState.RECONFIGURING)
    await ctx.scheduler.publish_entry(meta, slot_count(meta.get("slots"), runtime), lease.lease_id, reset=True)
    return {"id": model_id, "loaded": await _load_now(ctx, model_id, meta), "reconfigured": True}


async def _unload_recorded(ctx: AsyncContext, lease: Lease, actor: str, via: str = "") -> str:
    """Tear down under ``lease`` and add the operation's ``unload`` audit row (``detail``: ``via`` + outcome).

    Returns:
        The teardown's outcome ('destroyed', 'not_loaded' or 'worker_lost').
    """
    result = await inference_services.model_teardown(ctx, lease, f"{via} by {actor}" if via else actor)
    await sync_to_async(records.lifecycle_event_create)(lease.model_id, "unload", True, actor=actor,
                                                        detail=f"{via}: {result.outcome}" if via else
                                                        str(result.outcome), duration_ms=result.duration_ms)
    return str(result.outcome)


async def model_unload(ctx: AsyncContext, model_id: str, actor: str, timeout_ms: int | None = None) -> dict:
    """``POST /v1/models/unload`` and ``manage.py unload_model``: unload one model as a manager (R4.5). Idempotent.

    Args:
        timeout_ms: manager admission bound (R3.4); None = the model's busy timeout ceiling, 0 = unbounded.

    Returns:
        ``{"id", "loaded": false, "outcome": "destroyed"|"not_loaded"|"worker_lost"}``
        (the route answers without ``outcome``).

    Raises:
        NotFound: the id is not registered.
        ServerBusy: manager admission timeout or fail-fast (R3.4).
    """
    meta = await _registered_meta(ctx, model_id)

    async def transition(lease: Lease) -> dict:
        return {"id": model_id, "loaded": False, "outcome": await _unload_recorded(ctx, lease, actor)}

    return await leases.run_as_manager(ctx, model_id, ceiling_ms(meta) if timeout_ms is None else timeout_ms,
                                       transition)


async def model_unregister(ctx: AsyncContext, model_id: str, actor: str) -> dict:
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

    async def transition(lease: Lease) -> dict:
        started = time.monotonic()
        await _registered_meta(ctx, model_id)  # an earlier manager may have removed it
        await inference_services.model_teardown(ctx, lease, f"unregister by {actor}")
        await ctx.scheduler.unregister(model_id, lease.lease_id)
        await sync_to_async(records.registration_remove)(model_id, actor, int((time.monotonic() - started) * 1000))
        await metrics.forget_model(ctx.redis, model_id)  # its /metrics series go with it
        return {"id": model_id, "deleted": True}

    return await leases.run_as_manager(ctx, model_id, ceiling_ms(meta), transition)


async def _first_loads_under_way(ctx: AsyncContext, model_ids: list[str]) -> list[str]:
    """The ids of ``model_ids`` (in that order) whose first load is still running, which a bulk unload on
    the legacy runtime skips (R5.4): never loaded (not ``ready``), someone holds it (a request or a
    registration loading it, perhaps still waiting on the cold-load guard, or state ``loading``), and no
    first load recorded as published (``registration_first_load_published``). One scheduler snapshot."""
    skipped: list[str] = []
    snapshot = await ctx.scheduler.snapshot(model_ids)
    for model_id in model_ids:
        status = snapshot[model_id]
        # A first load is under way when the model was never loaded and someone holds it
        # (a request or a registration loading it, perhaps still waiting on the cold-load guard).
        busy = status["state"] == ModelState.LOADING or status["active_leases"] or status["manager_leases"]
        if status["state"] != ModelState.READY and busy and \
                not await sync_to_async(registration_first_load_published)(model_id):
            skipped.append(model_id)
    return skipped


async def models_bulk_unload(ctx: AsyncContext, model_ids: list[str] | None, actor: str) -> dict:
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
    wanted = list(metas) if model_ids is None else list(dict.fromkeys(model_ids))
    selected = [m for m in wanted if m in metas]
    not_found = [m for m in wanted if m not in metas]
    skipped: list[str] = []
    if get_config().runtime == "legacy" and selected:
        skipped = await _first_loads_under_way(ctx, selected)
        selected = [m for m in selected if m not in skipped]
    tickets: dict[str, str] = {}
    futures = await ctx.scheduler.acquire_many(ctx.listener, selected, tickets) if selected else {}
    pending = dict(futures)  # granted or still queued, not yet handed to a teardown
    unloaded: set[str] = set()
    gone: list[str] = []

    async def teardown(lease: Lease) -> None:
        model_id = lease.model_id
        if await model_meta_get(ctx, model_id) is None:  # unregistered by a manager ahead of us
            gone.append(model_id)
            return
        await _unload_recorded(ctx, lease, actor, via="bulk unload")
        unloaded.add(model_id)

    async def unload_one(model_id: str) -> None:
        # Once granted, the teardown finishes even if the caller leaves (R4.5).
        await leases.hold(ctx, pending.pop(model_id).result(), teardown)

    try:
        async with ctx.scheduler.keep_bulk(pending, tickets):
            for model_id in [m for m, f in futures.items() if f.done()]:  # ready-idle first (R5.1)
                await unload_one(model_id)
            while pending:
                await asyncio.wait(set(pending.values()), return_when=asyncio.FIRST_COMPLETED)
                for model_id in [m for m, f in pending.items() if f.done()]:
                    await unload_one(model_id)
    finally:
        for model_id in list(pending):  # caller gone or an error: leave nothing behind
            await ctx.scheduler.abandon(model_id, tickets[model_id])
    return {"unloaded": [m for m in selected if m in unloaded], "not_found": not_found + gone, "skipped": skipped}
