"""``manage.py bench_slots --batch`` (docs/benchmarks.md, "Native batching") run as an operator runs it:
for a family that batches it prints the serial, N-slot and batch-N rows through HTTP and the model
alone at batch sizes 1/2/4/8, writes the same figures as ``performance.json`` beside the batch
evidence, and refuses a family that does not batch before starting anything."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from django.conf import settings

from .support.bounds import MODEL_S


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    return subprocess.run([sys.executable, "manage.py", "bench_slots", "--batch", *args], cwd=settings.BASE_DIR,
                          env=env, capture_output=True, text=True, timeout=6 * MODEL_S)


def test_the_whisper_batch_report_has_every_row_and_each_batched_request_went_through_the_batcher(tmp_path):
    done = _bench("--family", "whisper", "--requests", "4", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [path] = list(tmp_path.glob("cpu/whisper/asr-batch/performance-*/performance.json"))
    report = json.loads(path.read_text())
    assert f"report written to {path}" in done.stdout
    rows = {r["row"]: r for r in report["http"]}
    assert list(rows) == ["serial", "2 slots", "batch 2", "4 slots", "batch 4"]
    assert all(r["rps"] > 0 and 0 < r["p50_ms"] <= r["p95_ms"] for r in rows.values()), rows
    for name in ("batch 2", "batch 4"):  # every request of a batched row was served by a batch call
        calls = {int(size): n for size, n in rows[name]["calls_by_size"].items()}
        assert sum(size * n for size, n in calls.items()) == 4, (name, calls)
    for name in ("serial", "2 slots", "4 slots"):
        assert rows[name]["calls_by_size"] == {}, rows[name]
    assert [r["size"] for r in report["model_alone"]] == [1, 2, 4, 8]
    assert all(r["serial_ms"] > 0 and r["batched_ms"] > 0 for r in report["model_alone"])
    for line in ("row      clients", "batch 4        4", "model alone, one thread"):
        assert line in done.stdout, done.stdout[-2000:]


def test_a_family_that_does_not_batch_is_refused_before_any_server_starts(tmp_path):
    done = _bench("--family", "piper", "--out", str(tmp_path))
    assert done.returncode != 0
    assert "family 'piper' does not batch; families that do: silero_vad, whisper" in done.stderr
    assert not any(tmp_path.iterdir())
