"""``python manage.py bench_realtime --url URL``: live transcription over the realtime WebSocket.

Each session streams a speech file (default: the ``../shared/fixtures/speech`` files joined into
one utterance of about 5 s, see :func:`_speech`), between 0.75 s of silence, in 20 ms appends of
24 kHz PCM at real-time pace, with OpenAI's default server VAD,
``--turns`` times. Measured per turn (issue 11, item 6):

- end of turn → completed: from the moment the turn's last speech chunk was sent to its
  ``…input_audio_transcription.completed`` event. It includes the ``silence_duration_ms`` (500 ms)
  the server VAD waits before it ends the turn, and the final decode;
- time to first delta: from the moment the turn's first speech chunk was sent to its first
  ``…transcription.delta`` (the partial transcripts);
- sessions sustained: 1, 2, 3, … sessions at once, each at real-time pace; the count before the
  median end-of-turn latency exceeds twice the single session's is the number this machine
  sustains (every turn must also complete).

The machine's other load adds noise: compare numbers of one run.
"""
from __future__ import annotations

import asyncio
import base64
import json
import statistics
import time
from pathlib import Path

import numpy as np
import soundfile
import soxr
import websockets
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

CHUNK_MS = 20
RATE_HZ = 24000
FIXTURES = Path(settings.BASE_DIR).parent / "shared" / "fixtures" / "speech"


def _speech(path: str | None) -> np.ndarray:
    """float32 mono samples at 16 kHz of ``path``; default: the speech fixtures one after the other as
    one utterance (each but the first without its first 0.25 s, so that the pauses between them
    stay under the VAD's 500 ms and the turn is not split): about 5 s."""
    files = [Path(path)] if path else sorted(FIXTURES.glob("*.wav"))
    if not files or not all(f.exists() for f in files):
        raise CommandError(f"no speech file (looked for {path or FIXTURES})")
    parts = []
    for index, file in enumerate(files):
        samples, rate = soundfile.read(file, dtype="float32", always_2d=True)
        mono = soxr.resample(samples.mean(axis=1), rate, 16000).astype(np.float32)
        parts.append(mono if index == 0 else mono[4000:])
    return np.concatenate(parts)


def _chunks(samples: np.ndarray) -> list[str]:
    pcm = (np.clip(soxr.resample(samples, 16000, RATE_HZ), -1, 1) * 32767).astype("<i2").tobytes()
    step = RATE_HZ * CHUNK_MS // 1000 * 2
    return [json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[i:i + step]).decode()})
            for i in range(0, len(pcm), step)]


async def _session(url: str, model: str, speech: list[str], quiet: list[str], turns: int) -> list[dict]:
    """Stream ``turns`` turns (quiet, speech, quiet) at real-time pace; per turn ``{"end_to_done_s",
    "first_delta_s"}`` (None when no delta came before the completion)."""
    async with websockets.connect(url, max_size=None) as ws:
        done: list[float] = []
        first_delta: list[float | None] = []

        async def read() -> None:
            waiting_delta = True
            async for message in ws:
                event = json.loads(message)
                kind = event["type"]
                if kind == "conversation.item.input_audio_transcription.delta" and waiting_delta:
                    first_delta.append(time.monotonic())
                    waiting_delta = False
                elif kind == "conversation.item.input_audio_transcription.completed":
                    if waiting_delta:
                        first_delta.append(None)
                    done.append(time.monotonic())
                    waiting_delta = True
                elif kind in ("error", "conversation.item.input_audio_transcription.failed"):
                    raise CommandError(f"session failed: {event}")

        reader = asyncio.ensure_future(read())
        await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {
            "input": {"transcription": {"model": model, "language": "en"}}}}}))
        starts, ends = [], []
        clock = time.monotonic()
        sent = 0
        for _turn in range(turns):
            for part, frames in (("quiet", quiet), ("speech", speech), ("quiet", quiet)):
                if part == "speech":
                    starts.append(clock + sent * CHUNK_MS / 1000)
                for frame in frames:
                    await ws.send(frame)
                    sent += 1
                    await asyncio.sleep(max(0.0, clock + sent * CHUNK_MS / 1000 - time.monotonic()))
                if part == "speech":
                    ends.append(time.monotonic())
        deadline = time.monotonic() + 120
        while len(done) < turns and time.monotonic() < deadline:
            if reader.done():
                reader.result()
            await asyncio.sleep(0.01)
        reader.cancel()
        if len(done) < turns:
            raise CommandError(f"only {len(done)} of {turns} turns completed within 120 s")
        out = []
        for i in range(turns):
            delta_at = first_delta[i]
            out.append({"end_to_done_s": done[i] - ends[i],
                        "first_delta_s": None if delta_at is None else delta_at - starts[i],
                        "delta_before_end": delta_at is not None and delta_at < ends[i]})
        return out


class Command(BaseCommand):
    help = "End-of-turn latency, time to first partial and sustained sessions of /v1/realtime (transcription)."

    def add_arguments(self, parser):
        parser.add_argument("--url", required=True, help="a running server, e.g. http://127.0.0.1:8080")
        parser.add_argument("--model", default="whisper-tiny.en")
        parser.add_argument("--file", default=None, help="a speech file (default: the fixtures as one utterance)")
        parser.add_argument("--turns", type=int, default=3, help="turns per session")
        parser.add_argument("--max-sessions", type=int, default=6)

    def handle(self, *args, **opts):
        url = opts["url"].replace("http://", "ws://").replace("https://", "wss://").rstrip("/")
        url += "/v1/realtime?intent=transcription"
        speech = _chunks(_speech(opts["file"]))
        quiet = _chunks(np.zeros(16000 * 3 // 4, dtype=np.float32))
        model, turns = opts["model"], opts["turns"]
        asyncio.run(_session(url, model, speech, quiet, 1))  # warm: load, first decodes
        self.stdout.write(f"model {model} at {opts['url']}; turn of {len(speech) * CHUNK_MS / 1000:.2f} s of speech "
                          f"between 0.75 s of silence, 24 kHz PCM in {CHUNK_MS} ms appends at real-time pace")
        baseline = None
        sustained = 0
        for sessions in range(1, opts["max_sessions"] + 1):
            async def many(n: int = sessions) -> list[list[dict]]:
                return await asyncio.gather(*[_session(url, model, speech, quiet, turns) for _ in range(n)])
            try:
                results = [turn for session in asyncio.run(many()) for turn in session]
            except CommandError as exc:
                self.stdout.write(f"{sessions} session(s): {exc}")
                break
            end_s = statistics.median(r["end_to_done_s"] for r in results)
            deltas = [r["first_delta_s"] for r in results if r["first_delta_s"] is not None]
            early = sum(r["delta_before_end"] for r in results)
            first_s = statistics.median(deltas) if deltas else float("nan")
            self.stdout.write(f"{sessions} session(s), {len(results)} turns: end of turn -> completed median "
                              f"{end_s * 1000:7.0f} ms (max {max(r['end_to_done_s'] for r in results) * 1000:6.0f}); "
                              f"first delta median {first_s * 1000:6.0f} ms after speech start; "
                              f"{early}/{len(results)} turns had a delta before their audio ended")
            if baseline is None:
                baseline = end_s
            if end_s > 2 * baseline:
                break
            sustained = sessions
        self.stdout.write(f"sessions sustained at real-time pace before the end-of-turn latency doubles: {sustained}"
                          + (" (the limit tried)" if sustained == opts["max_sessions"] else ""))
