"""``manage.py bench_growth`` (docs/benchmarks.md, "How cost grows with work") run as an operator runs it,
a real child process with tiny counts: it prints its one table with a number in every row, and every
process it started is gone afterwards, also when it is interrupted with Ctrl-C."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import psutil
from django.conf import settings

from .support.processes import leftovers_stopped, marked_processes

MARK = "BENCH_GROWTH_TEST_MARK"
"""An environment variable the tests give bench_growth; every process it starts inherits it."""
TINY = ["--models", "20", "--requests", "5", "--queued", "0", "3", "10", "--admission-requests", "3",
        "--wait-seconds", "1", "--sessions", "3", "--idle-seconds", "2"]
FIGURE = re.compile(r"^-?\d+(\.\d+)? (ms|KB|s)$")


def _bench_growth(mark: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env[MARK] = mark
    return subprocess.Popen([sys.executable, "manage.py", "bench_growth", *TINY], cwd=settings.BASE_DIR, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_bench_growth_prints_one_table_with_a_figure_in_every_row_and_stops_its_servers():
    mark = uuid.uuid4().hex
    proc = _bench_growth(mark)
    try:
        output, _ = proc.communicate(timeout=170)
    finally:
        left = leftovers_stopped(MARK, mark, timeout_s=10 if proc.poll() is None else 60)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert not left, f"left running after the command ended (now stopped by the test): {left}"
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in output.splitlines()
            if line.startswith("| ") and not line.startswith("| what ")]
    assert len(rows) == 16 and all(len(row) == 5 for row in rows), output
    assert all(FIGURE.match(row[2]) for row in rows), [row[2] for row in rows]
    assert all(row[3] == "" or re.fullmatch(r"\d+\.\d\d", row[3]) for row in rows), [row[3] for row in rows]
    labels = [row[0] for row in rows if row[0]]
    assert labels == ["silero_vad request p50 (wall time)", "silero_vad request p50 on another model",
                      "admission p50 on the model with the queue (503 at once)",
                      "web process RSS per open realtime session", "web process RSS per queued request",
                      "idle CPU of a whole stack, per minute",
                      "CPU of the stack per minute while requests wait"], labels
    withs = [row[1] for row in rows]
    assert withs[:2] == ["1 registered model", "20 registered models"], withs
    assert withs[2:8] == ["0 queued", "3 queued", "10 queued"] * 2, withs
    assert withs[8:11] == ["3 sessions", "3 queued (+3)", "10 queued (+7)"], withs
    assert withs[11:] == ["1 registered model", "20 registered models", "0 queued", "3 queued", "10 queued"], withs
    assert re.search(r"^\(\d+ s, \d+ CPUs, load average at the start, .*: [\d. ;]+\)$", output, re.M), output[-500:]


def _serving(mark: str) -> bool:
    """Whether a ``manage.py serve`` of the marked run is running."""
    for process in marked_processes(MARK, mark):
        try:
            if "manage.py serve" in " ".join(process.cmdline()):
                return True
        except psutil.Error:
            continue
    return False


def test_ctrl_c_while_the_stacks_run_stops_every_process_bench_growth_started():
    mark = uuid.uuid4().hex
    proc = _bench_growth(mark)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not _serving(mark):
            time.sleep(0.3)
        time.sleep(8)  # the stacks start (or listen) and the requests begin
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        left = leftovers_stopped(MARK, mark)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "interrupted: every server this command started was stopped" in output, \
        output[-2000:]
    assert not left, f"left running after Ctrl-C (now stopped by the test): {left}"
