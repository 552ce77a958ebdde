"""Start-up checks shared by every process: the runtime claim (R1.4) and the
parallel runtime's warning (R1.5)."""
from __future__ import annotations

import logging

from audiosite.serverconfig import get_config
from inference import specs
from inference.scheduler import Scheduler

log = logging.getLogger("audiosite")

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
