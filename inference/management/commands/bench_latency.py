"""``python manage.py bench_latency``: one request through HTTP vs the adapter called directly.

Runs against a server that is already up (``--url``), with warm models.
For each of a VAD model and an ASR model it times ``--repeats`` sequential
HTTP requests and the same input on an in-process session of the same
family, and prints p50/p90 and the HTTP overhead (p50 difference and ratio).
Input: the shipped LibriSpeech sample (3.5 s, 16 kHz).
"""
from __future__ import annotations

import base64
import statistics
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile
from django.conf import settings
from django.core.management.base import BaseCommand

from audiosite.serverconfig import get_config
from inference import specs
from inference.adapters import get_adapter
from inference.adapters.base import AudioRequest, LoadContext
from inference.backend import resolve_backend

SAMPLE = Path(settings.BASE_DIR) / "samples" / "librispeech_test_clean_6930-75918-0000.wav"


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class Command(BaseCommand):
    help = "Measure per-request latency through HTTP against a direct adapter call (warm models)."

    def add_arguments(self, parser):
        parser.add_argument("--url", default="http://127.0.0.1:8080")
        parser.add_argument("--vad-model", default="silero-vad")
        parser.add_argument("--asr-model", default="whisper-tiny.en")
        parser.add_argument("--repeats", type=int, default=20)

    def handle(self, *args, **opts):
        wav = SAMPLE.read_bytes()
        samples, rate = soundfile.read(SAMPLE, dtype="float32")
        assert rate == 16000
        repeats = opts["repeats"]
        with httpx.Client(base_url=opts["url"], timeout=120) as client:
            rows = []
            for family, model_id, send in (
                ("silero_vad", opts["vad_model"], lambda: client.post("/v1/tasks/run", json={
                    "model": opts["vad_model"], "request": {"audio_base64": base64.b64encode(wav).decode()}})),
                ("whisper", opts["asr_model"], lambda: client.post(
                    "/v1/audio/transcriptions", data={"model": opts["asr_model"]},
                    files={"file": (SAMPLE.name, wav)})),
            ):
                send().raise_for_status()  # warm: loads if lazy
                http_ms = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    send().raise_for_status()
                    http_ms.append((time.perf_counter() - started) * 1000)
                direct_ms = self._direct(family, samples, repeats)
                rows.append((family, model_id, http_ms, direct_ms))
        self.stdout.write(f"{'family':<11} {'model':<16} {'http p50':>9} {'http p90':>9} {'direct p50':>11} "
                          f"{'direct p90':>11} {'overhead p50':>13} {'ratio':>6}   (ms, {repeats} warm repeats)")
        for family, model_id, http_ms, direct_ms in rows:
            hp50, dp50 = statistics.median(http_ms), statistics.median(direct_ms)
            self.stdout.write(
                f"{family:<11} {model_id:<16} {hp50:9.1f} {_quantile(http_ms, 0.9):9.1f} {dp50:11.1f} "
                f"{_quantile(direct_ms, 0.9):11.1f} {hp50 - dp50:13.1f} {hp50 / dp50:6.2f}")

    def _direct(self, family: str, samples: np.ndarray, repeats: int) -> list[float]:
        config = get_config()
        ctx = LoadContext(specs.resolve_checkpoint(family, None), resolve_backend(config.backend), config.device,
                          config.threads, {}, {})
        adapter = get_adapter(family)
        session = adapter.new_session(adapter.load(specs.get_spec(family), ctx), 0)
        request = AudioRequest(samples, 16000, specs.request_defaults(family))
        session.run(request)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            session.run(request)
            times.append((time.perf_counter() - started) * 1000)
        return times
