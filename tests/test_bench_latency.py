"""``manage.py bench_latency`` (docs/benchmarks.md) run as a developer runs it, with small counts: it starts
the references, the floor and a ``serve`` stack, and prints the floor ratios of issue "close to the floor"
(silero_vad overhead and web CPU per request, each as audiosite / floor with a verdict) and the CPU per
request of each process, audiosite's model process on a row of its own."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from django.conf import settings

from .support.bounds import MODEL_S


def test_the_report_prints_both_floor_ratios_and_the_cpu_of_every_process_per_request():
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    done = subprocess.run([sys.executable, "manage.py", "bench_latency", "--repeats", "30", "--vad-repeats", "20",
                           "--bursts", "1", "--seconds", "0.5"], cwd=settings.BASE_DIR, env=env,
                          capture_output=True, text=True, timeout=6 * MODEL_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    targets = ("silero_vad overhead p50 ≤ 1.2 × the floor's", "web CPU per silero_vad request ≤ 1.5 × the floor web's")
    for target in targets:
        # an overhead can come out negative on a loaded machine (the direct call then took longer)
        found = re.search(rf"^\| {re.escape(target)} \| (-?[\d.]+) / (-?[\d.]+) = (-?[\d.]+) \| (PASS|FAIL) \|$",
                          out, re.MULTILINE)
        assert found is not None, out[-3000:]
        ours, floor, ratio = (float(x) for x in found.groups()[:3])
        assert floor != 0 and abs(ratio - ours / floor) < 0.01
    cpu = dict(re.findall(r"^\| (web|worker|model|redis) \| (\S+ \| \S+) \|$", out, re.MULTILINE))
    assert set(cpu) == {"web", "worker", "model", "redis"}, out[-3000:]
    floor_model, audiosite_model = cpu["model"].split(" | ")
    assert floor_model == "nan"  # the floor's worker runs its session itself
    assert float(audiosite_model) > 0  # audiosite's session runs in the model's own process
    assert float(cpu["web"].split(" | ")[1]) > 0
