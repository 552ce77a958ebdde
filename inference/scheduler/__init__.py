"""The slot scheduler: Redis Lua scripts and the async admission around them.

Imports nothing from Django: it takes a Redis client and plain values, so it
can be tested and reasoned about alone (DESIGN.md).
"""
from .keepalive import KeepAlive
from .keys import LIVENESS_EVERY_S, LIVENESS_TTL_MS, Keys
from .listener import Listener
from .slots import (
    AdmissionExpired,
    AdmissionOverdue,
    AdmissionTimeout,
    InvalidTransition,
    LeaseNotHeld,
    RuntimeMismatch,
    Scheduler,
    SchedulerError,
    effective_timeout_ms,
)
from .types import (
    AdmissionProbe,
    Census,
    ClaimStatus,
    Lease,
    LeaseKind,
    LoadAction,
    LoadClaim,
    LoadEnd,
    LoadEndRecord,
    LoadDecision,
    LoadLost,
    LoadOutcome,
    LoadWait,
    ModelState,
    ModelStatus,
    ProbeVerdict,
    ReapResult,
    RunOffer,
    RequestStats,
    TicketStatus,
)

__all__ = [
    "AdmissionProbe",
    "ProbeVerdict",
    "RunOffer",
    "ClaimStatus",
    "LIVENESS_EVERY_S",
    "LIVENESS_TTL_MS",
    "AdmissionExpired",
    "AdmissionOverdue",
    "AdmissionTimeout",
    "Census",
    "InvalidTransition",
    "KeepAlive",
    "Keys",
    "Lease",
    "LeaseKind",
    "LeaseNotHeld",
    "Listener",
    "LoadAction",
    "LoadClaim",
    "LoadEnd",
    "LoadEndRecord",
    "LoadDecision",
    "LoadLost",
    "LoadOutcome",
    "LoadWait",
    "ModelState",
    "ModelStatus",
    "ReapResult",
    "RequestStats",
    "RuntimeMismatch",
    "Scheduler",
    "SchedulerError",
    "TicketStatus",
    "effective_timeout_ms",
]
