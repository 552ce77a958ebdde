"""Runtimes: the legacy runtime (one session per model, R1.1) and the parallel
runtime (``--parallel-jobs``: FIFO slot pools, R1.3). Both share the flow in
``dispatch``; they differ in each model's capacity and in what the
configuration accepts.
"""
from audiosite.serverconfig import parallel_jobs


def runtime_name() -> str:
    """'parallel' when ``AUDIOSITE_PARALLEL_JOBS`` selects it, else 'legacy' (fixed at start-up, R1.4)."""
    return "parallel" if parallel_jobs() else "legacy"
