"""``python manage.py bench_realtime --url URL``: live transcription over the realtime WebSocket.

Accuracy and latency (first, through the official ``openai`` SDK's realtime client, ``--rounds``
times): every speech fixture in ``samples/`` and the fixtures joined as one utterance
(:func:`_speech`) are streamed as 16 kHz PCM in 20 ms appends at real-time pace between 0.6 s
and 1.2 s of silence, with OpenAI's default server VAD. Printed, of the same run:

- completed WER: the WER against the reference of each utterance's ``completed`` transcripts
  joined, beside the file WER: the same utterance sent whole to ``POST /v1/audio/transcriptions``
  (the official SDK's ``audio.transcriptions.create``); and how many turns' ``completed``
  transcript equals, character for character, the file route's text for the turn's own samples
  (``audio_start_ms``..``audio_end_ms`` of the PCM sent);
- first delta: the time of each turn's first ``…transcription.delta`` relative to the end of the
  utterance's audio (the moment its last chunk was sent; negative = before the end);
- end of speech → completed (p50, p95): from that moment to the turn's ``completed`` event (it
  includes the 500 ms of silence the server VAD waits for, and the final decode).

WER: lower-cased words without punctuation, common contractions spelt out (the LibriSpeech
references spell them out), :mod:`jiwer`.

Sessions at once (then, for each count of ``--sessions``, default 1 2 4 8; ``--sessions 0`` skips):
each session streams a speech file (default: the ``samples/`` speech files joined into one
utterance of about 5 s, see :func:`_speech`), between 0.75 s of silence, in 20 ms appends of
24 kHz PCM at real-time pace, with OpenAI's default server VAD, ``--turns`` times, all sessions
starting together. Measured per turn:

- end of turn → completed (p50, p95): from the moment the turn's last speech chunk was sent to its
  ``…input_audio_transcription.completed`` event. It includes the ``silence_duration_ms`` (500 ms)
  the server VAD waits before it ends the turn, any wait for a slot, and the final decode;
- time to first delta: from the moment the turn's first speech chunk was sent to its first
  ``…transcription.delta`` (the partial transcripts);
- the reference: the same speech posted as a file to ``POST /v1/audio/transcriptions``, one after
  the other (``REFERENCE_REPEATS`` times, median wall time), before the sessions;
- the goal: end of turn → completed p50 ≤ the file route's time + ``GOAL_MARGIN_MS`` (the VAD's
  500 ms of silence included), judged for every count up to the model's slots (``/v1/models``: a
  turn holds one lease of the model while it is spoken and decoded, so the slots are the sessions
  served at once; a turn of a session beyond them waits in the model's FIFO for a slot, and its
  latency grows by that wait instead of every session slowing down);
- the session count at which the p50 first exceeds twice the single session's.

The machine's other load adds noise: compare numbers of one run.
"""
from __future__ import annotations

import asyncio
import base64
import json
import statistics
import time
from pathlib import Path
from typing import Any

import io
import logging
import re

import httpx
import jiwer
import numpy as np
import openai
import soundfile
import soxr
import websockets
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

CHUNK_MS = 20
RATE_HZ = 24000
SAMPLES = Path(settings.BASE_DIR) / "samples"
"""The speech files shipped with the checkout (LibriSpeech utterances with their reference transcripts)."""
MODEL_RATE_HZ = 16000
LEAD_SILENCE_S = 0.6
TAIL_SILENCE_S = 1.2
"""Silence around each utterance of the accuracy run: the tail lets the server VAD (500 ms) end the turn."""
REFERENCE_REPEATS = 5
"""Times the speech is posted as a file for the reference decode time."""
GOAL_MARGIN_MS = 600
"""End of turn -> completed may exceed the file route's time by this much (ms): the server VAD's 500 ms
of silence before it ends a turn, and 100 ms for the stream's own steps."""
CONTRACTIONS = {"i'm": "i am", "it's": "it is", "don't": "do not", "can't": "cannot", "we're": "we are",
                "you're": "you are", "that's": "that is", "he's": "he is", "she's": "she is"}


def _speech(path: str | None) -> np.ndarray:
    """float32 mono samples at 16 kHz of ``path``; default: the speech fixtures one after the other as
    one utterance (each but the first without its first 0.25 s, so that the pauses between them
    stay under the VAD's 500 ms and the turn is not split): about 5 s."""
    files = [Path(path)] if path else sorted(SAMPLES.glob("*.wav"))
    if not files or not all(f.exists() for f in files):
        raise CommandError(f"no speech file (looked for {path or SAMPLES})")
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


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate of ``hypothesis`` against ``reference`` (lower case, no punctuation, contractions
    spelt out), a fraction (0.0 = every word right)."""
    def norm(text: str) -> str:
        text = re.sub(r"[^\w\s']", " ", text.replace("\u2019", "'").lower())
        return " ".join(CONTRACTIONS.get(w, w) for w in text.split())
    return jiwer.wer(norm(reference), norm(hypothesis))


def _utterances() -> list[tuple[str, np.ndarray, str]]:
    """``(name, float32 samples at 16 kHz, reference text)`` of every speech file with a ``.txt``
    reference in ``SAMPLES``, then all of them joined as
    one utterance (:func:`_speech`)."""
    found: dict[str, Path] = {}
    for folder in (SAMPLES,):
        for wav in sorted(folder.glob("*.wav")):
            if wav.with_suffix(".txt").exists():
                found.setdefault(wav.stem, wav)
    if not found:
        raise CommandError(f"no speech file with a reference .txt in {SAMPLES}")
    out = []
    for name, wav in found.items():
        samples, rate = soundfile.read(wav, dtype="float32", always_2d=True)
        mono = samples.mean(axis=1)
        if rate != MODEL_RATE_HZ:
            mono = soxr.resample(mono, rate, MODEL_RATE_HZ)
        out.append((name, mono.astype(np.float32), wav.with_suffix(".txt").read_text().strip()))
    joined = np.concatenate([s if i == 0 else s[MODEL_RATE_HZ // 4:] for i, (_n, s, _t) in enumerate(out)])
    out.append(("joined", joined, " ".join(text for _n, _s, text in out)))
    return out


def _wav(pcm: np.ndarray) -> bytes:
    """16 kHz s16le ``pcm`` (int16) as a WAV file."""
    buf = io.BytesIO()
    soundfile.write(buf, pcm, MODEL_RATE_HZ, format="WAV", subtype="PCM_16")
    return buf.getvalue()


async def _sdk_turns(client: openai.AsyncOpenAI, model: str, samples: np.ndarray) -> dict:
    """Stream ``samples`` (16 kHz float32), between silences, through the official SDK's realtime client at
    real-time pace. Returns ``{"pcm": int16 array sent, "speech_end": monotonic s of the utterance's last
    chunk, "turns": [{"item_id", "lo", "hi" (samples of the PCM sent), "transcript", "first_delta",
    "committed", "completed" (monotonic s)}]}``.

    Raises:
        CommandError: an ``error`` or ``failed`` event, or a turn not completed within 120 s.
    """
    quiet = lambda s: np.zeros(int(s * MODEL_RATE_HZ), dtype=np.float32)  # noqa: E731
    lead = quiet(LEAD_SILENCE_S)
    pcm = (np.clip(np.concatenate([lead, samples, quiet(TAIL_SILENCE_S)]), -1, 1) * 32767).astype("<i2")
    step = MODEL_RATE_HZ * CHUNK_MS // 1000
    speech_chunks = (lead.size + samples.size + step - 1) // step
    turns: dict[str, dict] = {}
    order: list[str] = []
    async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
        session: Any = {"type": "transcription", "audio": {"input": {  # the SDK's TypedDicts, as JSON
            "format": {"type": "audio/pcm", "rate": MODEL_RATE_HZ},
            "transcription": {"model": model, "language": "en"}}}}
        await conn.session.update(session=session)
        speech_end = [0.0]

        async def send() -> None:
            clock = time.monotonic()
            for index, lo in enumerate(range(0, pcm.size, step)):
                await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[lo:lo + step].tobytes()).decode())
                if index + 1 == speech_chunks:
                    speech_end[0] = time.monotonic()
                await asyncio.sleep(max(0.0, clock + (index + 1) * CHUNK_MS / 1000 - time.monotonic()))

        received: asyncio.Queue = asyncio.Queue()

        async def receive() -> None:
            async for event in conn:
                await received.put((time.monotonic(), event))

        sender = asyncio.ensure_future(send())
        reader = asyncio.ensure_future(receive())
        try:
            async with asyncio.timeout(pcm.size / MODEL_RATE_HZ + 120):
                while True:
                    # A turn may end before the last (silent) chunk is sent: poll both.
                    if sender.done() and turns and all("completed" in t for t in turns.values()):
                        break
                    if reader.done():
                        reader.result()
                        raise CommandError("the server closed the session")
                    try:
                        now, event = await asyncio.wait_for(received.get(), 0.2)
                    except TimeoutError:
                        continue
                    if event.type == "input_audio_buffer.speech_started":
                        turns[event.item_id] = {"item_id": event.item_id, "lo": event.audio_start_ms * 16,
                                                "first_delta": None}
                        order.append(event.item_id)
                    elif event.type == "input_audio_buffer.speech_stopped":
                        turns[event.item_id]["hi"] = event.audio_end_ms * 16
                    elif event.type == "input_audio_buffer.committed":
                        turns[event.item_id]["committed"] = now
                    elif event.type == "conversation.item.input_audio_transcription.delta":
                        turn = turns[event.item_id]
                        turn["first_delta"] = turn["first_delta"] or now
                    elif event.type == "conversation.item.input_audio_transcription.completed":
                        turns[event.item_id].update(transcript=event.transcript, completed=now)
                    elif event.type in ("error", "conversation.item.input_audio_transcription.failed"):
                        raise CommandError(f"session failed: {event}")
        except TimeoutError:
            raise CommandError("a turn was not completed within 120 s of the end of its audio") from None
        finally:
            sender.cancel()
            reader.cancel()
    return {"pcm": pcm, "speech_end": speech_end[0], "turns": [turns[i] for i in order]}


async def _accuracy(base_url: str, model: str, rounds: int, write) -> None:
    """The accuracy and latency run (module docstring), printed through ``write``."""
    client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="unused", max_retries=0,
                                timeout=120)
    utterances = _utterances()
    first_delta_s: list[float] = []
    latency_s: list[float] = []
    equal = turns_seen = no_delta = partial_first = 0
    write(f"accuracy: {len(utterances)} utterances x {rounds} round(s), 16 kHz PCM in {CHUNK_MS} ms appends at "
          "real-time pace, server VAD, official openai SDK")
    for name, samples, reference in utterances:
        whole = _wav((np.clip(samples, -1, 1) * 32767).astype("<i2"))
        as_file = (await client.audio.transcriptions.create(model=model, file=("u.wav", whole), language="en")).text
        for _round in range(rounds):
            run = await _sdk_turns(client, model, samples)
            texts = []
            for turn in run["turns"]:
                turns_seen += 1
                texts.append(turn["transcript"])
                turn_wav = _wav(run["pcm"][turn["lo"]:turn["hi"]])
                turn_file = (await client.audio.transcriptions.create(model=model, file=("t.wav", turn_wav),
                                                                      language="en")).text
                equal += turn_file == turn["transcript"]
                latency_s.append(turn["completed"] - run["speech_end"])
            first = run["turns"][0]["first_delta"] if run["turns"] else None
            if first is None:
                no_delta += 1
            else:
                first_delta_s.append(first - run["speech_end"])
                partial_first += first < run["turns"][0]["committed"]  # a partial, not the final decode's
            completed = " ".join(texts)
            write(f"  {name:45s} completed WER {wer(reference, completed):6.1%}  file WER "
                  f"{wer(reference, as_file):6.1%}  turns {len(run['turns'])}  first delta "
                  + (f"{(first - run['speech_end']) * 1000:+6.0f} ms" if first else "  none  ")
                  + f"  end of speech -> completed {(latency_s[-1]) * 1000:5.0f} ms")
    p50, p95 = np.percentile(latency_s, [50, 95]) if latency_s else (float("nan"), float("nan"))
    write(f"completed == file route text of the turn's samples: {equal}/{turns_seen} turns")
    if first_delta_s:
        write(f"first delta relative to the end of the utterance's audio: median "
              f"{statistics.median(first_delta_s) * 1000:+.0f} ms, {sum(d < 0 for d in first_delta_s)}/"
              f"{len(first_delta_s) + no_delta} utterances before the end; {partial_first} had a partial delta "
              "before their turn was committed (the others' first delta came with the final decode)")
    else:
        write(f"first delta: none before completed in {no_delta} utterances")
    write(f"end of speech -> completed: p50 {p50 * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms ({len(latency_s)} turns)")


class Command(BaseCommand):
    help = "End-of-turn latency, time to first partial and sustained sessions of /v1/realtime (transcription)."

    def add_arguments(self, parser):
        parser.add_argument("--url", required=True, help="a running server, e.g. http://127.0.0.1:8080")
        parser.add_argument("--model", default="whisper-tiny.en")
        parser.add_argument("--file", default=None, help="a speech file (default: the fixtures as one utterance)")
        parser.add_argument("--turns", type=int, default=3, help="turns per session")
        parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8],
                            help="session counts to run at once, in order (0: skip)")
        parser.add_argument("--rounds", type=int, default=3,
                            help="accuracy: times each utterance is streamed (0: skip)")

    def handle(self, *args, **opts):
        for name in ("httpx", "httpx2", "openai"):  # the SDK's per-request INFO lines
            logging.getLogger(name).setLevel(logging.WARNING)
        url = opts["url"].replace("http://", "ws://").replace("https://", "wss://").rstrip("/")
        url += "/v1/realtime?intent=transcription"
        speech = _chunks(_speech(opts["file"]))
        quiet = _chunks(np.zeros(16000 * 3 // 4, dtype=np.float32))
        model, turns = opts["model"], opts["turns"]
        asyncio.run(_session(url, model, speech, quiet, 1))  # warm: load, first decodes
        if opts["rounds"] > 0:
            asyncio.run(_accuracy(opts["url"], model, opts["rounds"], self.stdout.write))
        counts = [n for n in opts["sessions"] if n > 0]
        if counts:
            _sessions_at_once(opts["url"], url, model, opts["file"], speech, quiet, turns, counts, self.stdout.write)


def _file_reference_s(base_url: str, model: str, samples: np.ndarray) -> float:
    """Median wall time (s) of ``REFERENCE_REPEATS`` posts of ``samples`` (16 kHz float32) as a WAV file to
    ``POST /v1/audio/transcriptions``, one after the other (the official SDK)."""
    client = openai.OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=300)
    wav = _wav((np.clip(samples, -1, 1) * 32767).astype("<i2"))
    times = []
    for _ in range(REFERENCE_REPEATS):
        started = time.monotonic()
        client.audio.transcriptions.create(model=model, file=("speech.wav", wav), language="en")
        times.append(time.monotonic() - started)
    return statistics.median(times)


def _slots_of(base_url: str, model: str) -> int:
    """The model's ``slots`` as ``GET /v1/models`` reports them."""
    with httpx.Client(base_url=base_url, timeout=30) as client:
        for entry in client.get("/v1/models").json()["data"]:
            if entry["id"] == model:
                return int(entry["slots"])
    raise CommandError(f"{model} is not registered at {base_url}")


def _sessions_at_once(base_url: str, ws_url: str, model: str, file: str | None, speech: list[str],
                      quiet: list[str], turns: int, counts: list[int], write) -> None:
    """The sessions-at-once run of the module doc, printed through ``write``."""
    slots = _slots_of(base_url, model)
    reference_s = _file_reference_s(base_url, model, _speech(file))
    goal_s = reference_s + GOAL_MARGIN_MS / 1000
    write(f"model {model} ({slots} slot(s)) at {base_url}; turn of {len(speech) * CHUNK_MS / 1000:.2f} s of speech "
          f"between 0.75 s of silence, 24 kHz PCM in {CHUNK_MS} ms appends at real-time pace, {turns} turn(s) "
          f"per session")
    write(f"the same speech as a file (POST /v1/audio/transcriptions, median of {REFERENCE_REPEATS}): "
          f"{reference_s * 1000:.0f} ms; goal up to {slots} session(s): end of turn -> completed p50 <= "
          f"{goal_s * 1000:.0f} ms (+{GOAL_MARGIN_MS} ms)")
    write("| sessions | turns | end of turn -> completed p50 / p95 | first delta p50 (from speech start) "
          "| delta before audio end | goal |")
    write("|---|---|---|---|---|---|")
    single = None
    doubled_at = None
    verdicts = []
    for sessions in counts:
        async def many(n: int = sessions) -> list[list[dict]]:
            return await asyncio.gather(*[_session(ws_url, model, speech, quiet, turns) for _ in range(n)])
        try:
            results = [turn for session in asyncio.run(many()) for turn in session]
        except CommandError as exc:
            write(f"| {sessions} | - | {exc} | | | |")
            verdicts.append(sessions > slots)
            continue
        ends = [r["end_to_done_s"] for r in results]
        p50, p95 = np.percentile(ends, [50, 95])
        deltas = [r["first_delta_s"] for r in results if r["first_delta_s"] is not None]
        first = f"{statistics.median(deltas) * 1000:.0f} ms" if deltas else "none"
        early = sum(r["delta_before_end"] for r in results)
        if sessions <= slots:
            ok = p50 <= goal_s
            verdicts.append(ok)
            goal = "PASS" if ok else "FAIL"
        else:
            goal = f"beyond the {slots} slot(s): queued"
        write(f"| {sessions} | {len(results)} | {p50 * 1000:.0f} / {p95 * 1000:.0f} ms | {first} | "
              f"{early}/{len(results)} | {goal} |")
        single = p50 if single is None else single
        if doubled_at is None and p50 > 2 * single:
            doubled_at = sessions
    write("end of turn -> completed p50 doubles at: "
          + (f"{doubled_at} session(s)" if doubled_at else f"not within {counts[-1]} session(s)"))
    write("goal up to the slots: " + ("PASS" if verdicts and all(verdicts) else "FAIL"))
