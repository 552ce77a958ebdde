"""``manage.py validate_slots`` run as an operator runs it (a real child process); each
of these is held by a test:
- SIGTERM (``kill PID``, a CI job timeout, systemd stop) ends validate_slots at once; the
  ``finally: server.stop()`` blocks never run, so the ``manage.py serve`` it started (with its embedded
  Redis, web and worker) keeps running, orphaned, with its temporary folder left in /tmp.
- a run with ``--starts 1 --memory-cycles 10`` (below VALIDATION.md's 3 starts and 20 cycles)
  records M2 and M5 PASS and admission admits its count.
- ``--mode`` is not checked: "../" in it writes the run folder outside ``--out``.
- ``--backend cuda`` on a machine without a usable CUDA provider is not refused up front (as
  ``validate_framework --backend cuda`` is, docs/validation.md "On a GPU"): it starts servers, every
  load fails, it writes a record of FAILs into the cuda evidence tree and exits 0.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from django.conf import settings

import onnxruntime

from gate.servers import kill_process_tree

from .support.processes import leftovers_stopped
from .support.records import admission, framework_record, rows


MARK = "VALIDATE_SLOTS_TEST_MARK"
"""An environment variable the tests give validate_slots; every process it starts inherits it (not an
``AUDIOSITE_`` name: the validation servers do not pass those on)."""


def _validate_slots(out: Path, *args: str, mark: str = "") -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    if mark:
        env[MARK] = mark
    return subprocess.Popen([sys.executable, "manage.py", "validate_slots", "--family", "silero_vad", "--counts", "2",
                             "--starts", "1", "--memory-cycles", "10", "--out", str(out), *args],
                            cwd=settings.BASE_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _serve_children(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return [c for c in psutil.Process(proc.pid).children(recursive=True)
                if "serve" in " ".join(c.cmdline())]
    except psutil.Error:
        return []


def test_killing_a_server_that_did_not_stop_also_kills_what_it_started_in_sessions_of_their_own():
    """``Server.stop``'s last resort (``kill_process_tree``): ``serve`` starts its children each in a
    session of its own, so SIGKILL to ``serve`` alone would leave them running; a parent that starts
    a grandchild the same way stands in for it here."""
    script = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
              "start_new_session=True); print('started', flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert parent.stdout is not None and parent.stdout.readline().strip() == b"started"
    child = psutil.Process(parent.pid).children()[0]
    kill_process_tree(parent)
    assert parent.returncode is not None
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("after_s", [0.3, 3.0], ids=["while-a-server-starts", "while-it-runs"])
def test_sigterm_during_a_run_leaves_no_server_behind(tmp_path, after_s):
    """SIGTERM soon after the first server process appears (it is still starting: CI caught that
    window, which left the starting server behind) and a few seconds later."""
    mark = uuid.uuid4().hex
    proc = _validate_slots(tmp_path / "out", mark=mark)
    deadline = time.monotonic() + 120
    servers: list[psutil.Process] = []
    while not servers and time.monotonic() < deadline and proc.poll() is None:
        servers = _serve_children(proc)
        time.sleep(0.5)
    assert servers, "validate_slots started no server within 120 s"
    time.sleep(after_s)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=90)
    # Every process of the run (a snapshot of the tree would miss the children a starting serve adds
    # later, which a loaded machine's run once left behind while this test passed).
    left = leftovers_stopped(MARK, mark)
    assert not left, f"left running 60 s after SIGTERM (now stopped by the test): {left}"


@pytest.mark.skipif("CUDAExecutionProvider" in onnxruntime.get_available_providers()
                    and os.path.exists("/dev/nvidia0"), reason="a GPU machine: cuda is a valid backend here")
def test_backend_cuda_without_a_gpu_is_refused_before_any_server_starts(tmp_path):
    started = time.monotonic()
    proc = _validate_slots(tmp_path / "out", "--backend", "cuda")
    output, _ = proc.communicate(timeout=600)
    text = output.decode(errors="replace")
    assert proc.returncode != 0, text[-2000:]
    assert "Traceback" not in text
    assert not list((tmp_path / "out").rglob("record.json")), "a record of a backend this machine cannot run"
    assert time.monotonic() - started < 30, "it ran the checks instead of refusing"


def test_a_run_below_the_spec_minimums_does_not_admit_a_count(tmp_path):
    """VALIDATION.md: M2 needs three fresh server starts per count, M5 at least 20 memory cycles.
    A real run with --starts 1 --memory-cycles 10 records M2 PASS and M5 PASS, and admission admits
    its count (with a passing framework record beside it)."""
    out = tmp_path / "out"
    proc = _validate_slots(out)  # --starts 1 --memory-cycles 10
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and list(out.rglob("record.json")), output.decode(errors="replace")[-2000:]
    framework_record(out, "2026-12-01T00:00:00Z")  # F1-F6 PASS, older than the model run
    admission(out, tmp_path / "cpu.json", "--write")
    assert rows(tmp_path / "cpu.json")["silero_vad"] == {"vad/offline": [1], "vad/batch": [1]}


def test_a_mode_with_a_path_in_it_writes_nothing_outside_out(tmp_path):
    """--mode is not checked against the family's modes (only a warning); it is joined into the record
    folder ``<out>/<backend>/<family>/<task>-<mode>/``, so '../' in it writes files outside --out
    (manifest.json, requests.jsonl, outputs/) before the first server even fails to start."""
    out, outside = tmp_path / "out", tmp_path / "escaped"
    proc = _validate_slots(out, "--mode", f"../../../../../{'../' * 10}{outside}/x")
    output, _ = proc.communicate(timeout=600)
    text = output.decode(errors="replace")
    assert not outside.exists(), f"files written outside --out: {sorted(p.name for p in outside.rglob('*'))[:5]}"
    assert proc.returncode != 0 and "Traceback" not in text, text[-1500:]


@pytest.mark.parametrize("bad", ["record_is_a_list", "framework_record_without_revision"])
def test_a_bad_record_under_out_is_a_clear_error_before_any_server(tmp_path, bad):
    """validate_slots reads --out's newest framework record first (framework_root); a record that
    evidence.validate lets through without manifest.revision, or a JSON list, is a bare traceback."""
    out = tmp_path / "out"
    path = framework_record(out, "2026-12-01T00:00:00Z")
    rec = json.loads(path.read_text())
    if bad == "record_is_a_list":
        path.write_text("[1]")
    else:
        del rec["manifest"]["revision"]
        path.write_text(json.dumps(rec))
    proc = _validate_slots(out)
    output, _ = proc.communicate(timeout=300)
    text = output.decode(errors="replace")
    assert proc.returncode != 0
    assert "Traceback" not in text and "record.json" in text, text[-1500:]
