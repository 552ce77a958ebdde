"""Pipeline families (``diarization``): registrations without weights of their own.

A pipeline is served by the web process (``inference.services.diarization_run``),
which calls its component models through their own slots. On a worker the
pipeline's pool is empty: loading it makes the registration ``ready`` like any
other model (so it appears loaded in ``/v1/models`` and counts toward the
residency limit), and a run sent to it is refused.
"""
from __future__ import annotations

from .base import AudioRequest, InvalidInput, LoadContext, spec_capacity


class PipelineSession:
    """A slot of a pipeline: holds nothing; runs are served by the web process."""

    def __init__(self, family: str):
        self.family = family

    def run(self, request: AudioRequest) -> dict:
        """Always refuses: a pipeline's work is done by its component models.

        Raises:
            InvalidInput: always.
        """
        raise InvalidInput(f"family {self.family!r} is a pipeline served by the web process; its pool runs nothing")

    def close(self) -> None:
        """Nothing to free."""


class PipelineAdapter:
    """A family without weights (the spec's ``pipeline`` block names its components)."""

    family = "diarization"

    def capacity(self, spec: dict, ctx: LoadContext) -> int:
        return spec_capacity(spec, ctx.backend)

    def load(self, spec: dict, ctx: LoadContext) -> str:
        """Nothing to load; returns the family name."""
        return str(spec["family"])

    def new_session(self, shared: str, slot: int) -> PipelineSession:
        return PipelineSession(shared)

    def unload(self, shared: str) -> None:
        """Nothing to free."""
