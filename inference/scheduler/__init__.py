"""The slot scheduler: Redis Lua scripts and the async admission around them.

Imports nothing from Django: it takes a Redis client and plain values, so it
can be tested and reasoned about alone (DESIGN.md).
"""
from .keys import Keys
from .slots import (
    AdmissionExpired,
    AdmissionOverdue,
    AdmissionTimeout,
    Lease,
    LoadDecision,
    Scheduler,
    SchedulerError,
    effective_timeout_ms,
)
from .listener import Listener

__all__ = [
    "AdmissionExpired",
    "AdmissionOverdue",
    "AdmissionTimeout",
    "Keys",
    "Lease",
    "Listener",
    "LoadDecision",
    "Scheduler",
    "SchedulerError",
    "effective_timeout_ms",
]
