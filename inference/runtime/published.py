"""Published registrations: what every process reads instead of the database (R4.7).

Registrations are JSON objects in the Redis HASH ``Keys.models_meta`` (see
``registry.models.ModelRegistration.as_meta`` for the fields). Writes go
through the scheduler's scripts (``publish_entry``, ``unregister``,
``publish_registry``); this module reads and derives.
"""
from __future__ import annotations

import json

from audiosite.serverconfig import get_config

from .context import KEYS, AsyncContext


async def meta_get(ctx: AsyncContext, model_id: str) -> dict | None:
    """Published registration of one model, or None when it is not registered."""
    raw = await ctx.redis.hget(KEYS.models_meta, model_id)
    return json.loads(raw) if raw else None


async def ids_all(ctx: AsyncContext) -> list[str]:
    """The ids of every published registration, sorted (``HKEYS``: no registration is read or parsed)."""
    return sorted(await ctx.redis.hkeys(KEYS.models_meta))


async def meta_all(ctx: AsyncContext) -> dict[str, dict]:
    """Published registration of every model, keyed by id (sorted)."""
    raw = await ctx.redis.hgetall(KEYS.models_meta)
    return {model_id: json.loads(value) for model_id, value in sorted(raw.items())}


def is_lazy(meta: dict, lazy_default: bool | None = None) -> bool:
    """Whether a published registration loads on its first request (``lazy``) rather than at start-up
    and registration: its own ``lazy`` flag, else ``lazy_default`` (None: the server's ``lazy_load``)."""
    if meta.get("lazy") is not None:
        return bool(meta["lazy"])
    return get_config().lazy_load if lazy_default is None else lazy_default


def eager_ids(metas: dict[str, dict], lazy_default: bool | None = None) -> list[str]:
    """The ids of ``metas`` (published registrations keyed by id) that are not lazy (see :func:`is_lazy`),
    sorted."""
    return sorted(model_id for model_id, meta in metas.items() if not is_lazy(meta, lazy_default))


def legacy_slots_ignored(metas: dict[str, dict], runtime: str) -> str | None:
    """On the legacy runtime, the start-up warning for registrations that ask for more than one slot
    (made through the API while the deployment ran ``--parallel-jobs``; the legacy runtime serves every
    model with one session, R1.1), naming them; else None."""
    if runtime != "legacy":
        return None
    named = sorted(f"{model_id} (slots={meta['slots']})" for model_id, meta in metas.items()
                   if isinstance(meta.get("slots"), int) and meta["slots"] > 1)
    if not named:
        return None
    return ("warning: the legacy runtime serves one session per model; these registrations (made under "
            f"--parallel-jobs) keep their slots but run with one: {', '.join(named)}")


def ceiling_ms(meta: dict | None) -> int:
    """A model's admission ceiling in ms (R3.1): its ``busy_timeout_ms``, else the server's."""
    if meta is not None and meta.get("busy_timeout_ms") is not None:
        return meta["busy_timeout_ms"]
    return get_config().busy_timeout_ms
