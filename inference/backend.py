"""Which compute backend this machine really offers ('cpu' or 'cuda')."""
from __future__ import annotations

from inference import specs

_backend_cache: dict[str, str] = {}


def resolve_backend(requested: str) -> str:
    """'cpu' or 'cuda' for the configured ``backend`` ('auto' probes onnxruntime).

    'auto' is CUDA only when a session really gets the CUDA provider (the
    GPU wheel lists it even on machines without a GPU). 'cuda' on a machine
    without one fails the loads that need it, with the runtime's error.
    """
    if requested != "auto":
        return requested
    if "auto" not in _backend_cache:
        _backend_cache["auto"] = _probe_cuda()
    return _backend_cache["auto"]


def session_backend(requested: str) -> str:
    """The backend a model session of this process really gets for the configured ``backend``: 'cuda'
    only when onnxruntime opens a session with the CUDA provider first (the probe of 'auto'), else
    'cpu'. Unlike :func:`resolve_backend`, an explicit 'cuda' on a machine without a usable GPU gives
    'cpu' (its loads fail), so what a worker reports is what its sessions can get (``/health``)."""
    return "cpu" if requested == "cpu" else resolve_backend("auto")


def _probe_cuda() -> str:
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "cpu"
    ort.set_default_logger_severity(4)  # the probe's expected failure is not news
    try:
        checkpoint = specs.resolve_checkpoint("silero_vad", None)
        session = ort.InferenceSession(str(checkpoint), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        return "cuda" if session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
    except Exception:
        return "cpu"
    finally:
        ort.set_default_logger_severity(2)
