"""Start-up checks shared by every process: the runtime claim (R1.4) and the
parallel runtime's warning (R1.5)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis.exceptions

from audiosite.serverconfig import get_config
from inference import specs
from inference.scheduler import RuntimeMismatch, Scheduler

log = logging.getLogger("audiosite")

REDIS_START_WAIT_S = 60.0
"""How long a starting process waits for a Redis that cannot be reached yet (a deployment whose
processes start in another order), in seconds, before it gives up (:func:`check_runtime_at_start`)."""

UNTESTED_RULES: tuple[str, ...] = ()
"""Contract rules labelled U (untested or not built) in ``docs/contract.md``; named by the R1.5 warning.
``tests/test_layout.py`` checks that this list and the document agree."""


def experimental_warning() -> str:
    """The one-line-per-topic warning printed when the parallel runtime starts (R1.5).

    Names the validated multi-slot scope (admission tables) and the contract
    rules still labelled U (:data:`UNTESTED_RULES`).
    """
    scope = []
    for backend in ("cpu", "cuda"):
        for family, rows in sorted(specs.admission_rows(backend).items()):
            if family not in specs.all_specs():
                continue
            for task_mode in sorted(rows):
                task, mode = task_mode.split("/")
                top = specs.admitted_counts(family, task, mode, backend)
                if top > 1:
                    limit = f"batch sizes up to {top}" if mode == "batch" else f"up to {top} slots"
                    scope.append(f"{family} {task_mode} on {backend} {limit}")
    return ("EXPERIMENTAL: the parallel runtime (--parallel-jobs) is experimental. Multi-slot admission is "
            f"validated only for: {'; '.join(scope) or 'nothing'}; every other family/task/mode/backend serves "
            "one slot. Lifecycle areas without test coverage (docs/contract.md, label U): "
            f"{', '.join(UNTESTED_RULES) or 'none'}.")


def check_runtime(scheduler: Scheduler, warn: bool = True) -> str:
    """Claim or verify this deployment's runtime (R1.4) and warn on parallel (R1.5).

    Args:
        scheduler: a scheduler on a synchronous client.

    Returns:
        The runtime name.

    Raises:
        inference.scheduler.RuntimeMismatch: another runtime is recorded.
    """
    runtime = get_config().runtime
    scheduler.claim_runtime(runtime)
    if runtime == "parallel" and warn:
        log.warning(experimental_warning())
    return runtime


def check_runtime_at_start(scheduler_for: Callable[[], Scheduler], process: str, warn: bool = True,
                           wait_s: float = REDIS_START_WAIT_S) -> str:
    """:func:`check_runtime` for a process that is starting: a Redis that cannot be reached yet, or does
    not answer (paused, frozen, busy in a script, loading; or something else on its port), is tried
    again every second for up to ``wait_s`` seconds (one warning, on the first failure).

    Args:
        scheduler_for: makes a scheduler on a synchronous client (called for each attempt).
        process: what is starting, for the log lines (e.g. "this web process").

    Returns:
        The runtime name.

    Raises:
        SystemExit: (code 1) another runtime is recorded (R1.4), or Redis stayed unreachable or
            unanswering for ``wait_s``; the reason is logged first. SystemExit, not an ordinary exception, so that it
            also ends a Celery worker from inside a signal handler (Celery logs and swallows those).
    """
    started = time.monotonic()
    warned = False
    while True:
        try:
            return check_runtime(scheduler_for(), warn=warn)
        except RuntimeMismatch as exc:
            log.error("%s cannot start: %s", process, exc)
            raise SystemExit(1) from None
        except (redis.exceptions.RedisError, OSError) as exc:  # unreachable, not answering, BUSY, not Redis
            if time.monotonic() - started > wait_s:
                log.error("Redis could not be reached for %.0f s (%s): %s cannot start", wait_s, exc, process)
                raise SystemExit(1) from None
            if not warned:
                log.warning("waiting for Redis (%s), up to %.0f s", exc, wait_s)
                warned = True
            time.sleep(1)
