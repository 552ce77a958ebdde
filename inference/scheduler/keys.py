"""Redis key names of the scheduler (layout documented in ``lua/lib.lua``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    """Key builder for one deployment; ``prefix`` separates deployments sharing a Redis."""

    prefix: str = "as:"

    def model(self, model_id: str) -> str:
        """Base key of one model; ``{id}`` is a Redis Cluster hash tag."""
        return f"{self.prefix}m:{{{model_id}}}"

    @property
    def seq(self) -> str:
        """Global FIFO sequence counter (INCR)."""
        return f"{self.prefix}seq"

    @property
    def worker_live_prefix(self) -> str:
        """Prefix of worker liveness keys: ``<prefix>worker:<hostname>`` = boot id, with a TTL."""
        return f"{self.prefix}worker:"

    def worker_live(self, hostname: str) -> str:
        """Liveness key of one worker."""
        return self.worker_live_prefix + hostname

    @property
    def worker_memory(self) -> str:
        """HASH worker hostname -> available host memory in MB, refreshed with each liveness beat (R6.5)."""
        return f"{self.prefix}wmem"

    @property
    def worker_pid(self) -> str:
        """HASH worker hostname -> process id, so ``serve`` can tell a dead local worker from a live one."""
        return f"{self.prefix}wpid"

    @property
    def cold_guard(self) -> str:
        """Pseudo model id whose one slot serializes cold loads under residency limits (R6.6).

        Model ids must start with a letter or digit, so no registration can take it.
        """
        return "__coldload__"

    def process_channel(self, process_id: str) -> str:
        """Pub/sub channel on which one web process receives grants, load and result notices."""
        return f"{self.prefix}proc:{process_id}"

    def input(self, request_id: str) -> str:
        """Key holding a request's decoded audio and options (with a TTL)."""
        return f"{self.prefix}in:{request_id}"

    def result(self, request_id: str) -> str:
        """Key holding a request's result (with a TTL)."""
        return f"{self.prefix}out:{request_id}"

    def load_result(self, token: str) -> str:
        """Key holding the outcome of one load task (with a TTL)."""
        return f"{self.prefix}loadout:{token}"

    @property
    def models_meta(self) -> str:
        """HASH model id -> JSON registration published for every process."""
        return f"{self.prefix}models"

    @property
    def runtime(self) -> str:
        """The runtime name this deployment runs ('legacy')."""
        return f"{self.prefix}runtime"
