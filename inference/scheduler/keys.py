"""Redis key names of the scheduler (layout documented in ``lua/lib.lua``).

Every key name of the deployment is built here and nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass

LIVENESS_TTL_MS = 10000
"""A worker whose liveness key was not refreshed for this long is considered dead (R7.4)."""
LIVENESS_EVERY_S = 2.0
"""How often a worker refreshes its liveness key, in seconds (5 beats per TTL)."""


@dataclass(frozen=True)
class Keys:
    """Key builder for one deployment; ``prefix`` separates deployments sharing a Redis."""

    prefix: str = "as:"

    def model(self, model_id: str) -> str:
        """Base key of one model; ``{id}`` is a Redis Cluster hash tag."""
        return f"{self.prefix}m:{{{model_id}}}"

    def load(self, model_id: str) -> str:
        """HASH of one model's lifecycle: state, owner, boot, loader claim, error, capacity, last_used_ms,
        recent use (``use``, ``use_at_ms``), ``loaded_at_ms`` (layout: ``lua/lib.lua``)."""
        return self.model(model_id) + ":load"

    def load_end(self, model_id: str, token: str) -> str:
        """STRING: how the load that ``token`` waited for or claimed ended (``LoadEndRecord``'s text;
        kept for a minute after that end, see ``lua/lib.lua``)."""
        return self.model(model_id) + ":loadend:" + token

    def capacity(self, model_id: str) -> str:
        """STRING: the model's slot count (absent = 1)."""
        return self.model(model_id) + ":cap"

    def leases(self, model_id: str) -> str:
        """HASH request lease -> granted_at_ms."""
        return self.model(model_id) + ":leases"

    def manager_leases(self, model_id: str) -> str:
        """HASH manager lease -> granted_at_ms."""
        return self.model(model_id) + ":mleases"

    def queue(self, model_id: str) -> str:
        """ZSET ticket -> FIFO sequence number."""
        return self.model(model_id) + ":queue"

    def queued_managers(self, model_id: str) -> str:
        """HASH ticket -> 'manager' for queued manager tickets."""
        return self.model(model_id) + ":kind"

    def streams(self, model_id: str) -> str:
        """HASH stream lease -> granted_at_ms (the streams among the request leases, ``LeaseKind.STREAM``)."""
        return self.model(model_id) + ":streams"

    def queued_streams(self, model_id: str) -> str:
        """HASH queued stream ticket -> its stream cap."""
        return self.model(model_id) + ":squeue"

    def request_stats(self, model_id: str) -> str:
        """HASH ``requests`` (request leases released) and ``held_ms`` (their summed hold time, ms)."""
        return self.model(model_id) + ":stats"

    def hold_times(self, model_id: str) -> str:
        """LIST of the last request hold times in ms (grant → release), newest first (at most 200)."""
        return self.model(model_id) + ":held"

    @property
    def changes(self) -> str:
        """Pub/sub channel: every script that changes a model's snapshot publishes the model id here.

        ``lua/lib.lua`` (``changed``) derives it from a model's base key (the text before
        ``m:{``), so no script needs it as an argument. The UI's status stream listens.
        """
        return f"{self.prefix}changes"

    @property
    def audit_events(self) -> str:
        """Pub/sub channel: each new lifecycle audit row, as JSON, once its transaction commits (``ui``)."""
        return f"{self.prefix}audit"

    def metric_minute(self, minute: int) -> str:
        """HASH of one minute's queue-wait and run-time observations (``minute`` = Unix time // 60), kept an
        hour (``inference.runtime.metrics.MINUTES_KEPT``): the model page's chart of the last hour."""
        return f"{self.prefix}metric:minute:{minute}"

    @property
    def activity(self) -> str:
        """LIST of the last answered inference requests, newest first, as JSON (no body; capped by
        ``inference.runtime.metrics.ACTIVITY_KEEP``): the UI's activity view."""
        return f"{self.prefix}activity"

    @property
    def activity_events(self) -> str:
        """Pub/sub channel: each batch of newly answered requests (a JSON list) written to ``activity`` (``ui``)."""
        return f"{self.prefix}activity:new"

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
    def worker_backend(self) -> str:
        """HASH worker hostname -> the backend its sessions get ('cpu' or 'cuda',
        ``inference.backend.session_backend``), refreshed with each liveness beat (``/health``)."""
        return f"{self.prefix}wbackend"

    @property
    def worker_pid(self) -> str:
        """HASH worker hostname -> process id, so ``serve`` can tell a dead local worker from a live one."""
        return f"{self.prefix}wpid"

    def pool_pids(self, hostname: str) -> str:
        """HASH model id -> process id of each model's process on worker ``hostname``
        (``inference.worker.pool_process``); its TTL is refreshed with the worker's liveness beat."""
        return f"{self.prefix}wpools:{hostname}"

    @property
    def worker_starting(self) -> str:
        """STRING with a TTL, present while a supervisor (``manage.py serve``) is starting a worker.

        Set (and refreshed) while a worker process it spawned has not beaten yet,
        or while a restart of a dead worker is due within a short grace; absent
        otherwise. A cold load with no live worker waits for a worker only while
        this key exists and fails with ``no_worker`` at once when it does not (R7.4).
        """
        return f"{self.prefix}wstarting"

    @property
    def cold_guard(self) -> str:
        """Pseudo model id whose one slot serializes cold loads under residency limits (R6.6).

        Model ids must start with a letter or digit, so no registration can take it.
        """
        return "__coldload__"

    def process_channel(self, process_id: str) -> str:
        """Pub/sub channel on which one web process receives grants, load and result notices."""
        return f"{self.prefix}proc:{process_id}"

    @staticmethod
    def process_live(channel: str) -> str:
        """Liveness key of the process listening on ``channel`` (TTL ``LIVENESS_TTL_MS``, R7.5).

        Derived from the channel alone, so the grant pass (``lua/lib.lua``) finds it
        from a queued ticket's channel.
        """
        return channel + ":live"

    def input(self, request_id: str) -> str:
        """Key holding a request's decoded audio (with a TTL): raw little-endian samples, float32 or
        int16 as the run header's ``sample_format`` says (``inference.audio.to_bytes``)."""
        return f"{self.prefix}in:{request_id}"

    @property
    def run_queue_prefix(self) -> str:
        """Prefix of every :meth:`run_queue` key (``enqueue.lua`` appends ``<hostname>:<boot>``)."""
        return f"{self.prefix}runs:"

    def run_queue(self, hostname: str, boot: str) -> str:
        """LIST of run headers (JSON) for one worker process, ``hostname`` with boot id ``boot``.

        Web processes ``LPUSH``; the worker's run dispatcher ``BLMOVE``s each element (FIFO) onto
        :meth:`run_taken`. One list per boot, so a restarted worker never takes a run meant for
        its predecessor (the sender is told ``worker_lost`` instead, R7.4).
        """
        return f"{self.run_queue_prefix}{hostname}:{boot}"

    def run_taken(self, hostname: str, boot: str) -> str:
        """LIST of the run queue elements worker ``hostname`` (boot id ``boot``) has taken and not yet
        finished: its pop moves each element here in the same step (``BLMOVE``), and the run's end
        removes it (``LREM``). An element here that no run thread serves (its pop's connection broke
        before the reply) is served again by the worker's next sweep (``inference.worker.runs``)."""
        return f"{self.prefix}runtaken:{hostname}:{boot}"

    def chunks(self, request_id: str) -> str:
        """LIST of a streamed run's frames (with a TTL): the worker ``RPUSH``es, the web ``LPOP``s.

        A frame is one type byte then its body: ``a`` + 16-bit little-endian
        mono PCM of one sentence, or ``e`` + the run's final JSON reply (the last frame).
        """
        return f"{self.prefix}chunks:{request_id}"

    def stop(self, request_id: str) -> str:
        """Key set by the web when a streamed run's client left: the worker stops after its current sentence."""
        return f"{self.prefix}stop:{request_id}"

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

    def metric(self, name: str) -> str:
        """HASH of one deployment-wide counter or histogram of ``GET /metrics`` (``inference/runtime/metrics.py``).

        ``name`` is the metric's name without the ``audiosite_`` prefix; fields
        are the JSON list of its label values, with ``\tb<i>`` (bucket ``i``),
        ``\tsum`` and ``\tcount`` appended for a histogram.
        """
        return f"{self.prefix}metric:{name}"

    @property
    def runtime(self) -> str:
        """The runtime name this deployment runs ('legacy' or 'parallel', R1.4)."""
        return f"{self.prefix}runtime"

    # -- the controllable test family (inference/adapters/fixture_barrier.py) --
    def fixture_arrived(self, name: str) -> str:
        """Counter of steps that reached fixture barrier ``name``."""
        return f"{self.prefix}fixture:arrived:{name}"

    def fixture_release(self, name: str) -> str:
        """LIST a controller pushes 'go' / 'fail' onto, one item per waiter let through."""
        return f"{self.prefix}fixture:release:{name}"

    @property
    def fixture_events(self) -> str:
        """Channel on which barrier arrivals are announced."""
        return f"{self.prefix}fixture:events"
