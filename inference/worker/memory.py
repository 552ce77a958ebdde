"""Giving a destroyed pool's memory back to the operating system.

A pool's weights and buffers are allocated by native code (CTranslate2,
onnxruntime) through the C library's ``malloc``. glibc keeps freed memory in
its arenas (one per thread that allocated it, up to ``8 × cores`` of them by
default) and returns it to the kernel only when the top of a heap becomes
free, so after an unload the worker's RSS stays near its peak and a later
load, allocated from another thread's arena, adds to it. Two things bound it:

- ``MALLOC_ARENA_MAX`` in the worker's environment (read by glibc at process
  start; ``manage.py serve`` sets it, operators who start ``celery``
  themselves set it too: docs/operations.md; the worker warns at start when
  it is missing, :func:`warn_if_arenas_unbounded`);
- :func:`release_freed_memory` after a pool's teardown: glibc's
  ``malloc_trim(0)``, which returns the free pages inside every arena to the
  kernel (``madvise``) and shrinks the top of the main heap. It cannot shrink
  the top chunk of the other arenas, which glibc keeps up to its (dynamic, up
  to 64 MB) trim threshold; hence the arena limit of 1 (measured in
  docs/benchmarks.md).

On a C library other than glibc (musl, macOS) the trim is a no-op.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)


@functools.cache
def _glibc_malloc_trim():
    """glibc's ``int malloc_trim(size_t pad)``, or None when the process does not run on glibc.

    glibc is recognised by its own symbol ``gnu_get_libc_version`` in the
    running process (musl and macOS's libc have none).
    """
    try:
        process = ctypes.CDLL(None)
        process.gnu_get_libc_version  # noqa: B018 (a lookup: raises AttributeError off glibc)
        trim = process.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim_supported() -> bool:
    """Whether :func:`release_freed_memory` can call ``malloc_trim`` here (Linux with glibc)."""
    return _glibc_malloc_trim() is not None


def release_freed_memory() -> bool:
    """Return the allocator's free pages to the kernel (glibc ``malloc_trim(0)``).

    Call it after the last reference to a pool's weights was dropped. It walks
    every malloc arena and frees nothing still in use; after a whisper
    teardown it took 9-14 ms here (2 cores), mostly the kernel dropping pages.

    It runs no garbage collection: a pool's objects are freed by reference
    counting as soon as ``Pool.close`` drops them (tests/test_worker_memory.py
    checks it with the collector off), and a full ``gc.collect()`` in a loaded
    worker holds the GIL for about 70 ms.

    Returns:
        True when ``malloc_trim`` ran (glibc), False where it is not available.
    """
    trim = _glibc_malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def arenas_bounded(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` limits glibc's malloc arenas (``MALLOC_ARENA_MAX`` or the
    ``glibc.malloc.arena_max`` tunable in ``GLIBC_TUNABLES``)."""
    return bool(environ.get("MALLOC_ARENA_MAX")) or "glibc.malloc.arena_max=" in environ.get("GLIBC_TUNABLES", "")


def warn_if_arenas_unbounded() -> None:
    """Log a warning at worker start when this glibc process has no arena limit.

    The limit must be in the environment before the process starts (glibc
    reads it once), so the worker can only say so; see docs/operations.md.
    """
    if trim_supported() and not arenas_bounded(os.environ):
        log.warning("MALLOC_ARENA_MAX is not set for this worker: its memory after unloads will grow with the "
                    "number of threads that ran models (set MALLOC_ARENA_MAX=1 in its environment; "
                    "docs/operations.md, 'Worker memory')")
