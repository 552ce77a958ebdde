"""``manage.py bench_compare OTHER_CHECKOUT`` (docs/benchmarks.md) run as a developer runs it: two stacks
served side by side, the web, worker and Redis CPU per request of each with its blocks, the latency,
and the ratio of the other checkout to this one; a folder that is not a checkout is refused before
anything starts."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from django.conf import settings

from .support.bounds import MODEL_S


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    return subprocess.run([sys.executable, "manage.py", "bench_compare", *args], cwd=settings.BASE_DIR,
                          env=env, capture_output=True, text=True, timeout=4 * MODEL_S)


def test_the_checkout_against_itself_prints_both_stacks_cpu_per_request_and_their_ratio():
    # 10 requests per block: /proc counts CPU in 10 ms ticks, so a block of fewer could read 0
    done = _bench(str(settings.BASE_DIR), "--requests", "40", "--gap-ms", "5")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figure = r"([\d.]+) \[[\d. ]+\]"  # mean [blocks]
    row = rf"^\| (this|other): \S+ \| ([\d.]+) \[([\d. ]+)\] \| {figure} \| {figure} \| ([\d.]+) \|$"
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(row, done.stdout, re.MULTILINE)}
    assert set(rows) == {"this", "other"}, done.stdout
    for web, blocks, worker, redis_ms, p50 in rows.values():
        assert len(blocks.split()) == 4  # one figure per block
        assert float(web) > 0 and float(p50) > 0, done.stdout  # a served request costs its web process CPU
        assert float(worker) >= 0 and float(redis_ms) >= 0
    ratio = re.search(r"^\| other / this \| ([\d.]+) \| ([\d.na]+) \| ([\d.na]+) \| ([\d.]+) \|$", done.stdout,
                      re.MULTILINE)
    assert ratio is not None, done.stdout
    # the web ratio is the other stack's figure over this one's (printed rounded to 0.01 ms)
    assert abs(float(ratio.group(1)) - float(rows["other"][0]) / float(rows["this"][0])) < 0.01, done.stdout


def test_a_folder_that_is_not_a_checkout_is_refused_before_any_server_starts(tmp_path):
    done = _bench(str(tmp_path))
    assert done.returncode != 0
    assert f"{tmp_path} is not a checkout of audiosite (no manage.py)" in done.stderr
    assert not any(tmp_path.iterdir())
