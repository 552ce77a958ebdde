"""``python manage.py bench_speech --url URL``: streamed speech synthesis against a running server.

Measures, with a five-sentence input:

- time to the first audio byte and to the whole body of ``POST /v1/audio/speech``
  (mp3, streamed), median of ``--repeat`` runs, and their ratio (target ≤ 35 %);
- the real-time factor: wall time of the whole body ÷ duration of the audio (pcm);
- four requests one after the other, then the same four at once: the speed-up
  (serial wall ÷ concurrent wall) shows what the model's slots buy (about 1 with
  one slot; at most the slot count, and at most the cores the worker may use).

Every request has a seed, so the concurrent bodies are also compared with the
serial ones byte for byte. The machine's other load adds noise: compare ratios
of one run.
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from django.core.management.base import BaseCommand, CommandError

FIVE_SENTENCES = ("The first sentence is short. The second one is a little longer than the first. "
                  "Here comes the third sentence of this test. The fourth sentence talks about the weather "
                  "today. And the fifth sentence ends the story.")
SAMPLE_WIDTH_BYTES = 2  # pcm is s16le mono


class Command(BaseCommand):
    help = "Time to first audio byte, real-time factor and slot speed-up of /v1/audio/speech."

    def add_arguments(self, parser):
        parser.add_argument("--url", required=True, help="a running server, e.g. http://127.0.0.1:8080")
        parser.add_argument("--model", default="piper-joe")
        parser.add_argument("--repeat", type=int, default=5)
        parser.add_argument("--concurrent", type=int, default=4)

    def _timed(self, client: httpx.Client, model: str, fmt: str, seed: int) -> tuple[float, float, bytes]:
        """``(seconds to the first body byte, seconds to the whole body, body)`` of one request."""
        started = time.perf_counter()
        first = None
        parts = []
        with client.stream("POST", "/v1/audio/speech", json={"model": model, "input": FIVE_SENTENCES,
                                                              "response_format": fmt, "seed": seed}) as response:
            if response.status_code != 200:
                raise CommandError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
            for chunk in response.iter_raw():
                if chunk and first is None:
                    first = time.perf_counter() - started
                parts.append(chunk)
        return first or 0.0, time.perf_counter() - started, b"".join(parts)

    def handle(self, *args, **opts):
        url, model, repeat, n = opts["url"], opts["model"], opts["repeat"], opts["concurrent"]
        with httpx.Client(base_url=url, timeout=300) as client:
            self._timed(client, model, "mp3", 0)  # warm: load, first espeak call
            runs = [self._timed(client, model, "mp3", 1) for _ in range(repeat)]
            first_s = statistics.median(r[0] for r in runs)
            whole_s = statistics.median(r[1] for r in runs)
            _f, pcm_s, pcm = self._timed(client, model, "pcm", 1)
            rate = int(client.get("/v1/audio/voices", params={"model": model}).json()["voices"][0]["sample_rate"])
            audio_s = len(pcm) / SAMPLE_WIDTH_BYTES / rate
            serial_started = time.perf_counter()
            serial = [self._timed(client, model, "pcm", 100 + i)[2] for i in range(n)]
            serial_s = time.perf_counter() - serial_started
        with ThreadPoolExecutor(n) as pool:
            def one(i: int) -> bytes:
                with httpx.Client(base_url=url, timeout=300) as own:
                    return self._timed(own, model, "pcm", 100 + i)[2]
            concurrent_started = time.perf_counter()
            together = list(pool.map(one, range(n)))
            concurrent_s = time.perf_counter() - concurrent_started
        ratio = first_s / whole_s
        self.stdout.write(f"model {model} at {url}; input {len(FIVE_SENTENCES)} characters, 5 sentences")
        self.stdout.write(f"first audio byte (mp3, median of {repeat}) {first_s * 1000:8.1f} ms")
        self.stdout.write(f"whole body       (mp3, median of {repeat}) {whole_s * 1000:8.1f} ms")
        self.stdout.write(f"first / whole                          {ratio * 100:8.1f} %  "
                          f"{'PASS' if ratio <= 0.35 else 'FAIL'} (target <= 35 %)")
        self.stdout.write(f"audio {audio_s:.2f} s in {pcm_s:.2f} s: real-time factor {pcm_s / audio_s:.3f}")
        self.stdout.write(f"{n} requests serial {serial_s:.2f} s, concurrent {concurrent_s:.2f} s: "
                          f"speed-up {serial_s / concurrent_s:.2f}x; concurrent bodies equal serial: "
                          f"{together == serial}")
