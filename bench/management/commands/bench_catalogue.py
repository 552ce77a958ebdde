"""``python manage.py bench_catalogue``: throughput and memory of the speaker and music families.

Families: ``speaker_embedding``, ``basic_pitch`` and the ``diarization``
pipeline (over ``silero_vad`` and ``speaker_embedding``). Prints, and writes as
JSON (``--out``, default ``var/bench_catalogue.json``):

- in-process speed of each adapter (median of 5 warm runs, one thread):
  milliseconds per request and real-time factor (``time / audio duration``);
- through HTTP on the parallel runtime (``manage.py serve --parallel-jobs``,
  embedded Redis, temporary SQLite): one warm request (median of 3), and N
  concurrent requests on 1 slot vs on N slots (N = 4; 2 for diarization), as
  completion time and requests per second;
- the worker's resident-set growth when each family's pool is loaded with 1
  and with 4 slots (``psutil`` RSS before and after the first request).

Inputs: the two LibriSpeech samples (``samples/``), a 9 s conversation built
from them (A, B, A, B with 0.8 s pauses), and a 9 s melody of plucked tones
synthesised here at 22,050 Hz.
"""
from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile
from django.conf import settings
from django.core.management.base import BaseCommand

from inference import specs
from inference.adapters import get_adapter
from inference.adapters.base import AudioRequest, LoadContext

from gate.servers import Server

from bench.common import task_body

SAMPLES = Path(settings.BASE_DIR) / "samples"
READERS = ("librispeech_test_clean_6930-75918-0000.wav", "librispeech_test_other_7902-96591-0000.wav")
MUSIC_RATE_HZ = 22050
REPEATS = 3
DIRECT_REPEATS = 5
PARTS = {"vad_model": "vad", "embedding_model": "emb4"}


def _wav(samples: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def melody(seconds: float = 9.0) -> np.ndarray:
    """Plucked tones (3 harmonics, 5 ms attack, exponential decay) every 0.6 s, cycling a C major
    scale from MIDI 60; float32 at 22,050 Hz."""
    out = np.zeros(int(seconds * MUSIC_RATE_HZ), np.float32)
    t = np.arange(int(0.55 * MUSIC_RATE_HZ)) / MUSIC_RATE_HZ
    for i, pitch in enumerate([60, 62, 64, 65, 67, 69, 71, 72] * 2):
        at = int(i * 0.6 * MUSIC_RATE_HZ)
        if at + len(t) > len(out):
            break
        hz = 440.0 * 2 ** ((pitch - 69) / 12)
        tone = sum(np.sin(2 * np.pi * hz * k * t) / k for k in (1, 2, 3)) * np.exp(-3 * t) * 0.25
        out[at: at + len(t)] += tone.astype(np.float32)
    return out


class Command(BaseCommand):
    help = "Throughput and memory of speaker_embedding, basic_pitch and the diarization pipeline."

    def add_arguments(self, parser):
        parser.add_argument("--out", default=str(Path(settings.VAR_DIR) / "bench_catalogue.json"))

    def handle(self, *args, **opts):
        logging.getLogger("httpx").setLevel(logging.WARNING)
        a, rate = soundfile.read(SAMPLES / READERS[0], dtype="float32")
        b, _ = soundfile.read(SAMPLES / READERS[1], dtype="float32")
        gap = np.zeros(int(0.8 * rate), np.float32)
        talk = np.concatenate([a, gap, b, gap, a, gap, b])
        music = melody()
        self.inputs: dict[str, tuple[np.ndarray, int, dict]] = {
            "speaker_embedding": (a, rate, {}),
            "basic_pitch": (music, MUSIC_RATE_HZ, {}),
            "diarization": (talk, rate, {}),
        }
        report: dict = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                                    "load_average": [round(x, 2) for x in os.getloadavg()]},
                        "inputs_s": {name: round(len(x) / r, 3) for name, (x, r, _) in self.inputs.items()}}
        report["direct"] = self._direct()
        models: list[dict] = [{"id": "vad", "family": "silero_vad", "slots": 4},
                  *[{"id": f"emb{n}", "family": "speaker_embedding", "slots": n} for n in (1, 4)],
                  *[{"id": f"bp{n}", "family": "basic_pitch", "slots": n} for n in (1, 4)],
                  *[{"id": f"diar{n}", "family": "diarization", "slots": n, "load_options": PARTS} for n in (1, 2)]]
        with tempfile.TemporaryDirectory() as tmp:
            server = Server(Path(tmp), models, True)
            try:
                report["rss_mb"] = asyncio.run(self._memory(server))
                report["http"] = asyncio.run(self._http(server))
            finally:
                server.stop()
        Path(opts["out"]).parent.mkdir(parents=True, exist_ok=True)
        Path(opts["out"]).write_text(json.dumps(report, indent=2))
        self._print(report)
        self.stdout.write(f"report written to {opts['out']}")

    def _direct(self) -> dict:
        out = {}
        for family in ("speaker_embedding", "basic_pitch"):
            samples, rate, options = self.inputs[family]
            ctx = LoadContext(specs.resolve_checkpoint(family, None), "cpu", 0, 1, {}, {})
            adapter = get_adapter(family)
            session = adapter.new_session(adapter.load(specs.require_spec(family), ctx), 0)
            request = AudioRequest(samples, rate, {**specs.request_defaults(family), **options})
            session.run(request)
            times = []
            for _ in range(DIRECT_REPEATS):
                started = time.perf_counter()
                session.run(request)
                times.append((time.perf_counter() - started) * 1000)
            ms = statistics.median(times)
            out[family] = {"ms": round(ms, 1), "rtf": round(ms / 1000 / (len(samples) / rate), 4)}
        return out

    def _body(self, family: str, model: str) -> dict:
        samples, rate, options = self.inputs[family]
        return task_body(model, _wav(samples, rate), **options)

    async def _memory(self, server: Server) -> dict:
        worker = server.worker()
        out = {"worker_idle": round(worker.memory_info().rss / 2**20, 1)}
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            for family, prefix in (("speaker_embedding", "emb"), ("basic_pitch", "bp")):
                for n in (1, 4):
                    before = worker.memory_info().rss
                    (await c.post("/v1/tasks/run", json=self._body(family, f"{prefix}{n}"))).raise_for_status()
                    out[f"{family}_{n}_slot_load_delta"] = round((worker.memory_info().rss - before) / 2**20, 1)
        return out

    async def _http(self, server: Server) -> dict:
        out = {}
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as c:
            for family, prefix, n in (("speaker_embedding", "emb", 4), ("basic_pitch", "bp", 4),
                                      ("diarization", "diar", 2)):
                body = self._body(family, f"{prefix}1")
                (await c.post("/v1/tasks/run", json=body)).raise_for_status()
                one = []
                for _ in range(REPEATS):
                    started = time.perf_counter()
                    (await c.post("/v1/tasks/run", json=body)).raise_for_status()
                    one.append((time.perf_counter() - started) * 1000)
                row: dict = {"one_request_ms": round(statistics.median(one), 1), "n": n}
                for model, key in ((f"{prefix}1", "serial_ms"), (f"{prefix}{n}", "parallel_ms")):
                    body = self._body(family, model)
                    await asyncio.gather(*[c.post("/v1/tasks/run", json=body) for _ in range(n)])  # warm
                    times = []
                    for _ in range(REPEATS):
                        started = time.perf_counter()
                        resps = await asyncio.gather(*[c.post("/v1/tasks/run", json=body) for _ in range(n)])
                        times.append((time.perf_counter() - started) * 1000)
                        for resp in resps:
                            resp.raise_for_status()
                    row[key] = round(statistics.median(times), 1)
                row["serial_rps"] = round(n / (row["serial_ms"] / 1000), 2)
                row["parallel_rps"] = round(n / (row["parallel_ms"] / 1000), 2)
                row["speedup"] = round(row["serial_ms"] / row["parallel_ms"], 2)
                out[family] = row
        return out

    def _print(self, report: dict) -> None:
        w = self.stdout.write
        m = report["machine"]
        w(f"machine: {m['cpus']} CPUs, Python {m['python']}, load average {m['load_average']}")
        w(f"inputs (s): {report['inputs_s']}")
        for family, row in report["direct"].items():
            w(f"direct {family}: {row['ms']} ms per request, RTF {row['rtf']}")
        r = report["rss_mb"]
        w(f"worker RSS idle {r['worker_idle']} MB; load deltas: " + ", ".join(
            f"{k.replace('_slot_load_delta', ' slot(s)')} +{v} MB" for k, v in r.items() if k != "worker_idle"))
        w(f"{'family':<18} {'1 req ms':>9} {'N':>2} {'1 slot ms':>10} {'N slots ms':>11} {'rps 1':>6} "
          f"{'rps N':>6} {'speedup':>8}")
        for family, row in report["http"].items():
            w(f"{family:<18} {row['one_request_ms']:>9} {row['n']:>2} {row['serial_ms']:>10} {row['parallel_ms']:>11} "
              f"{row['serial_rps']:>6} {row['parallel_rps']:>6} {row['speedup']:>8}")
