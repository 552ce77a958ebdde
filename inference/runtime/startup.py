"""Start-up checks shared by every process: the runtime claim (R1.4) and the
parallel runtime's warning (R1.5)."""
from __future__ import annotations

import json
import logging
import re

from inference import specs
from inference.runtime import runtime_name

log = logging.getLogger("audiosite")


def experimental_warning() -> str:
    """The one-line-per-topic warning printed when the parallel runtime starts (R1.5).

    Names the validated multi-slot scope (admission tables) and the contract
    rules still labelled U in ``docs/contract.md``.
    """
    scope = []
    for backend in ("cpu", "cuda"):
        path = specs.ADMISSION_DIR / f"{backend}.json"
        if not path.exists():
            continue
        for family, rows in sorted(json.loads(path.read_text()).items()):
            if family.startswith("_") or family not in specs.all_specs():
                continue
            for task_mode in sorted(rows):
                top = specs.admitted_counts(family, *task_mode.split("/"), backend)
                if top > 1:
                    scope.append(f"{family} {task_mode} on {backend} up to {top} slots")
    contract = specs.SPEC_DIR.parent / "docs" / "contract.md"
    gaps = []
    if contract.exists():
        for line in contract.read_text().splitlines():
            cells = [c.strip() for c in line.split("|")]
            if len(cells) > 3 and re.match(r"^R\d", cells[1]) and cells[3] == "U":
                gaps.append(cells[1])
    return ("EXPERIMENTAL: the parallel runtime (--parallel-jobs) is experimental. Multi-slot admission is "
            f"validated only for: {'; '.join(scope) or 'nothing'}; every other family/task/mode/backend serves "
            f"one slot. Lifecycle areas without test coverage (docs/contract.md, label U): {', '.join(gaps) or 'none'}.")


def check_runtime(redis_client, keys, warn: bool = True) -> str:
    """Claim or verify this deployment's runtime (R1.4) and warn on parallel (R1.5).

    Raises:
        registry.services.RuntimeMismatch: another runtime is recorded.
    """
    from registry.services import runtime_claim

    runtime = runtime_name()
    runtime_claim(redis_client, keys, runtime)
    if runtime == "parallel" and warn:
        log.warning(experimental_warning())
    return runtime
