"""Worker-side session pools: the loaded models of this worker process.

A pool holds a model's shared weights and its sessions (one on the legacy
runtime). The worker's identity is its Celery hostname plus a boot id (fresh
per process start); a liveness key ``as:worker:<hostname>`` = boot id, with
a TTL, tells every process that this worker still holds its pools (R7.4).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from audiosite.serverconfig import get_config
from inference import specs
from inference.adapters import get_adapter
from inference.adapters.base import LoadContext

log = logging.getLogger(__name__)

LIVENESS_TTL_MS = 10000  # a worker silent for 10 s is considered dead
LIVENESS_EVERY_S = 2.0


@dataclass
class Pool:
    """A published pool: shared weights plus per-slot sessions, with a lock per slot."""

    model_id: str
    meta_json: str
    adapter: Any
    shared: Any
    sessions: list
    locks: list = field(default_factory=list)
    loaded_at: float = field(default_factory=time.time)

    def close(self) -> None:
        """Destroy the sessions, then the shared weights (R4.5 order)."""
        for session in self.sessions:
            try:
                session.close()
            except Exception:
                log.exception("closing a session of %s failed", self.model_id)
        self.sessions.clear()
        self.adapter.unload(self.shared)


class WorkerState:
    """The process-wide registry of pools and this worker's identity."""

    def __init__(self):
        self.hostname: str | None = None
        self.boot = uuid.uuid4().hex
        self.pools: dict[str, Pool] = {}
        self.lock = threading.Lock()
        self.backend: str | None = None
        self._stop = threading.Event()

    # -- identity / liveness ---------------------------------------------------
    def start_liveness(self, hostname: str, redis_client, keys) -> None:
        """Start the thread that keeps ``as:worker:<hostname>`` = boot id alive."""
        self.hostname = hostname
        key = keys.worker_live(hostname)
        redis_client.set(key, self.boot, px=LIVENESS_TTL_MS)

        def beat():
            while not self._stop.wait(LIVENESS_EVERY_S):
                try:
                    redis_client.set(key, self.boot, px=LIVENESS_TTL_MS)
                except Exception:
                    log.exception("liveness beat failed")

        threading.Thread(target=beat, name="liveness", daemon=True).start()

    def stop_liveness(self, redis_client, keys) -> None:
        """Stop beating and delete the key if it is still ours."""
        self._stop.set()
        if self.hostname:
            key = keys.worker_live(self.hostname)
            if redis_client.get(key) == self.boot:
                redis_client.delete(key)

    # -- pools ---------------------------------------------------------------------
    def build(self, model_id: str, meta: dict, meta_json: str) -> Pool:
        """Load weights and one session privately, then publish the pool locally.

        Raises whatever the adapter raises; nothing is published then, and
        sessions created so far are closed before the weights (R7.2).
        """
        config = get_config()
        spec = specs.get_spec(meta["family"])
        ctx = LoadContext(
            checkpoint=specs.resolve_checkpoint(meta["family"], meta.get("path")),
            backend=resolve_backend(config.backend),
            device=config.device,
            threads=config.threads,
            load_options=meta.get("load_options") or {},
            session_options=meta.get("session_options") or {},
        )
        adapter = get_adapter(meta["family"])
        shared = adapter.load(spec, ctx)
        sessions = []
        try:
            sessions.append(adapter.new_session(shared, 0))
        except BaseException:
            for session in sessions:
                session.close()
            adapter.unload(shared)
            raise
        pool = Pool(model_id, meta_json, adapter, shared, sessions, [threading.Lock() for _ in sessions])
        with self.lock:
            old = self.pools.pop(model_id, None)
            self.pools[model_id] = pool
        if old is not None:
            old.close()
        return pool

    def get(self, model_id: str) -> Pool | None:
        with self.lock:
            return self.pools.get(model_id)

    def close_all(self) -> list[str]:
        """Destroy every pool (worker shutdown). Returns the model ids."""
        with self.lock:
            pools, self.pools = self.pools, {}
        for pool in pools.values():
            pool.close()
        return list(pools)


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


WORKER = WorkerState()
