"""Typed reads of the process environment: ``env_str``, ``env_bool``, ``env_url``, ``env_json``, ``env_path``.

Pure functions of ``os.environ``: importing this module reads nothing and writes
nothing (unlike ``audiosite.settings``, whose import generates the secret key
into ``var/secret_key`` when none is set). Modules that only need an
environment variable (``audiosite.serverconfig``, ``inference.specs``, the
management commands) import these helpers from here, so importing them never
touches the disk.

Every helper fails loudly (``ImproperlyConfigured``) on a malformed value
instead of falling back silently.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from django.core.exceptions import ImproperlyConfigured


def env_str(name: str, default: str | None = None) -> str | None:
    """Return the environment variable ``name`` stripped, or ``default`` when unset or empty."""
    value = os.environ.get(name, "").strip()
    return value if value else default


def env_bool(name: str, default: bool) -> bool:
    """Parse ``name`` as a boolean (1/0, true/false, yes/no, on/off).

    Raises:
        ImproperlyConfigured: the value is set but is none of those words.
    """
    raw = env_str(name)
    if raw is None:
        return default
    lowered = raw.lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def env_url(name: str, default: str | None, schemes: tuple[str, ...]) -> str | None:
    """Return ``name`` as a URL whose scheme is one of ``schemes``.

    Raises:
        ImproperlyConfigured: the value is set but has another scheme.
    """
    raw = env_str(name, default)
    if raw is None:
        return None
    scheme = raw.split("://", 1)[0] if "://" in raw else ""
    if scheme not in schemes:
        raise ImproperlyConfigured(f"{name}={raw!r}: scheme must be one of {', '.join(schemes)}")
    return raw


def env_json(name: str, default: Any) -> Any:
    """Parse ``name`` as JSON, or return ``default`` when unset or empty.

    Raises:
        ImproperlyConfigured: the value is set but is not valid JSON.
    """
    raw = env_str(name)
    if raw is None:
        return default
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ImproperlyConfigured(f"{name} is not valid JSON: {exc.msg}") from None
    except ValueError as exc:  # an integer literal over Python's 4300-digit conversion limit
        raise ImproperlyConfigured(f"{name} is not valid JSON: {exc}") from None


def env_path(name: str, default: Path) -> Path:
    """Return ``name`` as a filesystem path, or ``default`` when unset or empty."""
    raw = env_str(name)
    return Path(raw) if raw else default
