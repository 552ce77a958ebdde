"""The install ends with exactly one onnxruntime distribution: the GPU wheel."""
from __future__ import annotations

import importlib.metadata as md
import os
from pathlib import Path

import onnxruntime
import pytest
from django.db import connection


def installed(dist: str) -> bool:
    try:
        md.distribution(dist)
        return True
    except md.PackageNotFoundError:
        return False


def test_onnxruntime_gpu_is_the_active_runtime():
    assert installed("onnxruntime-gpu")
    assert not installed("onnxruntime"), "the CPU wheel was pulled in (by faster-whisper?) and shadows the GPU one"
    files = {str(f) for f in md.distribution("onnxruntime-gpu").files}
    active = Path(onnxruntime.__file__).resolve()
    assert "onnxruntime/__init__.py" in files
    assert active == Path(md.distribution("onnxruntime-gpu").locate_file("onnxruntime/__init__.py")).resolve()
    assert onnxruntime.__version__ == md.version("onnxruntime-gpu")
    assert "CPUExecutionProvider" in onnxruntime.get_available_providers()


@pytest.mark.skipif(os.environ.get("AUDIOSITE_REQUIRE_SERVICES") != "1", reason="run through scripts/test.sh")
def test_suite_runs_on_postgresql():
    """The README's test command runs against real PostgreSQL, not the SQLite default."""
    assert connection.vendor == "postgresql"
