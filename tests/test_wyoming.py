"""The Wyoming protocol server (Home Assistant), driven by the ``wyoming`` package's own client
(``wyoming.client.AsyncTcpClient``) against ``manage.py wyoming`` beside a real ``serve`` stack: the same
models, FIFO, slots, busy timeouts and leases as HTTP (R1.1, R3.2, R8.2, R8.3).
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import socket
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeVoice

from .support.audio import long_speech, words
from .support.bounds import MODEL_S, QUICK_S, run, until, within
from .support.processes import ROOT, free_port, kill_process_tree
from .support.stacks import Stack, run_stack

pytestmark = pytest.mark.stack

MAX_AUDIO_S = 60
STREAM_WRITE_TIMEOUT_MS = 3000
MODELS: list[dict] = [
    {"id": "whisper", "family": "whisper", "task": "asr", "slots": 1, "busy_timeout_ms": 1500},
    {"id": "whisper-wait", "family": "whisper", "task": "asr", "slots": 1, "busy_timeout_ms": 0},
    {"id": "piper", "family": "piper", "task": "tts", "slots": 1, "voice_presets": {"alloy": {"voice": "joe"}}},
]


@dataclass
class WyomingStack:
    stack: Stack
    host: str
    port: int

    def client(self) -> AsyncTcpClient:
        return AsyncTcpClient(self.host, self.port)


@pytest.fixture(scope="module")
def wy(tmp_path_factory) -> Iterator[WyomingStack]:
    tmp = tmp_path_factory.mktemp("wyoming")
    for stack in run_stack(tmp, MODELS, redis_db=3, name="wyoming", parallel=True,
                           extra_config={"max_audio_seconds": MAX_AUDIO_S,
                                         "stream_write_timeout_ms": STREAM_WRITE_TIMEOUT_MS}):
        port = free_port()
        env = {**stack.env, "AUDIOSITE_CONFIG": str(tmp / "server.json"), "AUDIOSITE_PARALLEL_JOBS": "1"}
        proc = subprocess.Popen([sys.executable, "manage.py", "wyoming", "--uri", f"tcp://127.0.0.1:{port}"],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "wyoming listening on" in line, line + proc.stdout.read()
        yield WyomingStack(stack, "127.0.0.1", port)
        proc.terminate()
        try:
            proc.wait(timeout=QUICK_S)
        except subprocess.TimeoutExpired:
            kill_process_tree(proc)


def pcm_of(wav_data: bytes) -> tuple[bytes, int]:
    with wave.open(io.BytesIO(wav_data)) as wav:
        assert wav.getsampwidth() == 2 and wav.getnchannels() == 1
        return wav.readframes(wav.getnframes()), wav.getframerate()


async def send_audio(client: AsyncTcpClient, pcm: bytes, rate: int, chunk_bytes: int = 2048) -> None:
    """What Home Assistant sends after ``transcribe``: audio-start, 2 KiB chunks, audio-stop."""
    await client.write_event(AudioStart(rate=rate, width=2, channels=1).event())
    for start in range(0, len(pcm), chunk_bytes):
        chunk = pcm[start:start + chunk_bytes]
        await client.write_event(AudioChunk(rate=rate, width=2, channels=1, audio=chunk).event())
    await client.write_event(AudioStop().event())


async def next_event(client: AsyncTcpClient, seconds: float = MODEL_S) -> Event | None:
    return await within(client.read_event(), seconds)


async def transcribe(wy: WyomingStack, pcm: bytes, rate: int, **fields) -> Event | None:
    async with wy.client() as client:
        await client.write_event(Transcribe(**fields).event())
        await send_audio(client, pcm, rate)
        return await next_event(client)


def http_text(stack: Stack, wav: bytes, model: str = "whisper") -> str:
    with stack.client() as c:
        resp = c.post("/v1/audio/transcriptions", data={"model": model}, files={"file": ("a.wav", wav)})
        assert resp.status_code == 200, resp.text
        return resp.json()["text"]


def test_describe_lists_the_asr_models_and_the_speech_voices(wy):
    async def scenario():
        async with wy.client() as client:
            await client.write_event(Describe().event())
            event = await next_event(client, QUICK_S)
        assert event is not None and Info.is_type(event.type)
        info = Info.from_event(event)
        assert [m.name for m in info.asr[0].models] == ["whisper", "whisper-wait"]
        assert info.asr[0].models[0].languages == ["en"]
        assert {v.name for v in info.tts[0].voices} == {"joe", "alloy"}
        assert info.tts[0].voices[0].languages == ["en_US"]
    run(scenario())


def test_a_wyoming_transcript_equals_the_http_transcription_of_the_same_audio(wy, speech):
    """Home Assistant's event sequence (transcribe with a language, then 16 kHz s16le chunks) gives the text
    ``/v1/audio/transcriptions`` gives for the same audio, on the default ASR model and on a named one."""
    for utt in speech:
        pcm, rate = pcm_of(utt.wav)
        expected = http_text(wy.stack, utt.wav)
        event = run(transcribe(wy, pcm, rate, language="en-US"))
        assert event is not None and Transcript.is_type(event.type), event
        assert Transcript.from_event(event).text == expected
    event = run(transcribe(wy, pcm, rate, name="whisper-wait"))
    assert event is not None
    assert Transcript.from_event(event).text == http_text(wy.stack, speech[-1].wav, "whisper-wait")
    assert wy.stack.counters("whisper") == {"leases": 0, "queued": 0}


def test_synthesize_streams_audio_chunks_that_decode_to_the_spoken_text(wy):
    text = "The quick brown fox jumps over the lazy dog."

    async def scenario() -> tuple[AudioStart, bytes]:
        async with wy.client() as client:
            await client.write_event(Synthesize(text=text, voice=SynthesizeVoice(name="alloy")).event())
            first = await next_event(client)
            assert first is not None and AudioStart.is_type(first.type), first
            pcm = bytearray()
            while True:
                event = await next_event(client)
                assert event is not None
                if AudioStop.is_type(event.type):
                    return AudioStart.from_event(first), bytes(pcm)
                chunk = AudioChunk.from_event(event)
                assert len(chunk.audio) <= 4096 and chunk.rate == 22050
                pcm += chunk.audio
    start, pcm = run(scenario())
    assert (start.rate, start.width, start.channels) == (22050, 2, 1)
    samples = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768
    assert 1.0 < len(samples) / 22050 < 6.0 and float(np.sqrt(np.mean(samples ** 2))) > 0.01
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(22050)
        wav.writeframes(pcm)
    assert {"quick", "brown", "fox"} <= set(words(http_text(wy.stack, out.getvalue())).split())
    assert wy.stack.counters("piper") == {"leases": 0, "queued": 0}


def test_a_wyoming_request_behind_a_held_slot_gets_a_busy_error_and_leaves_no_lease(wy, speech):
    """R3.2: with whisper's one slot held by an HTTP request, a Wyoming transcription waits at most the
    model's busy_timeout_ms (1,500 ms) and gets an ``error`` event (``queue_timeout`` or ``overdue``); its
    ticket is gone at once, and once the holder ends no lease or ticket is left."""
    slow = long_speech(speech, 40)
    pcm, rate = pcm_of(speech[0].wav)

    async def scenario():
        async with httpx.AsyncClient(base_url=wy.stack.url, timeout=MODEL_S) as c:
            holder = asyncio.create_task(c.post("/v1/audio/transcriptions", data={"model": "whisper"},
                                                files={"file": ("slow.wav", slow)}))
            await until(lambda: wy.stack.counters("whisper")["leases"] == 1)
            started = time.monotonic()
            event = await transcribe(wy, pcm, rate)
            elapsed_s = time.monotonic() - started
            assert event is not None and Error.is_type(event.type), event
            error = Error.from_event(event)
            assert error.code in ("queue_timeout", "overdue"), error
            assert elapsed_s < 1.5 + 1.0, elapsed_s
            assert wy.stack.counters("whisper") == {"leases": 1, "queued": 0}
            assert not holder.done()
            assert (await holder).status_code == 200
    run(scenario())
    wy.stack.wait_idle("whisper")


def test_a_client_that_leaves_frees_its_ticket_and_its_slot(wy, speech):
    """R8.2/R8.3: a Wyoming client that disconnects while its transcription waits in the FIFO gives its ticket
    back at once (the holder still runs), and one that disconnects while its speech streams frees the slot."""
    slow = long_speech(speech, 40)
    pcm, rate = pcm_of(speech[0].wav)

    async def scenario():
        async with httpx.AsyncClient(base_url=wy.stack.url, timeout=MODEL_S) as c:
            holder = asyncio.create_task(c.post("/v1/audio/transcriptions", data={"model": "whisper-wait"},
                                                files={"file": ("slow.wav", slow)}))
            await until(lambda: wy.stack.counters("whisper-wait")["leases"] == 1)
            client = wy.client()
            await client.connect()
            await client.write_event(Transcribe(name="whisper-wait").event())
            await send_audio(client, pcm, rate)
            await until(lambda: wy.stack.counters("whisper-wait")["queued"] == 1)
            await client.disconnect()
            await until(lambda: wy.stack.counters("whisper-wait")["queued"] == 0, timeout_s=5)
            assert not holder.done()
            assert (await holder).status_code == 200
        long_text = " ".join(["We walked along the river until the sun went down behind the hills."] * 40)
        client = wy.client()
        await client.connect()
        await client.write_event(Synthesize(text=long_text).event())
        first = await next_event(client)
        assert first is not None and AudioStart.is_type(first.type)
        assert wy.stack.counters("piper")["leases"] == 1
        await client.disconnect()
        await until(lambda: wy.stack.counters("piper") == {"leases": 0, "queued": 0}, timeout_s=10)
    run(scenario())
    wy.stack.wait_idle("whisper-wait")


def test_inputs_over_the_bounds_get_an_error_event_and_hold_nothing(wy):
    """Transcription audio over max_audio_seconds (60 s here: 1,920,000 bytes at 16 kHz mono) is refused as it
    arrives (``payload_too_large``), before anything queues; so are a stated payload over 1 MiB, speech text
    over 4,096 characters, an unknown voice, and audio that is not s16le."""
    limit_bytes = MAX_AUDIO_S * 16000 * 2

    async def refused(*events: Event) -> Error:
        """Send ``events`` (a write the server no longer reads may fail), read the answer: an error event,
        then the end of the connection (the server may reset it: it closes with input unread)."""
        client = wy.client()
        await client.connect()
        try:
            with contextlib.suppress(ConnectionError):
                for event in events:
                    await client.write_event(event)
            answer = await next_event(client, QUICK_S)
            assert answer is not None and Error.is_type(answer.type), answer
            with contextlib.suppress(ConnectionError):
                assert await next_event(client, QUICK_S) is None  # the server closed the connection
            return Error.from_event(answer)
        finally:
            with contextlib.suppress(ConnectionError):
                await client.disconnect()

    async def scenario():
        over = bytes(limit_bytes + 2)
        chunks = [AudioChunk(rate=16000, width=2, channels=1, audio=over[start:start + (1 << 20)]).event()
                  for start in range(0, len(over), 1 << 20)]
        too_long = await refused(Transcribe().event(), AudioStart(rate=16000, width=2, channels=1).event(), *chunks)
        assert too_long.code == "payload_too_large" and "max_audio_seconds=60" in too_long.text
        big = Event(type="audio-chunk", data={"rate": 16000, "width": 2, "channels": 1}, payload=bytes((1 << 20) + 1))
        assert (await refused(Transcribe().event(), AudioStart(rate=16000, width=2, channels=1).event(), big)).code \
            == "payload_too_large"
        assert (await refused(Synthesize(text="a" * 4097).event())).code == "invalid_request_error"
        unknown = await refused(Synthesize(text="Hello.", voice=SynthesizeVoice(name="nobody")).event())
        assert unknown.code == "invalid_request_error" and "joe" in unknown.text
        assert (await refused(AudioStart(rate=16000, width=4, channels=1).event())).code == "unsupported_audio"
        # Text the worker cannot take is refused as over HTTP, not answered server_error.
        assert (await refused(Synthesize(text="Hello\x00there.").event())).code == "invalid_request_error"
        # A field of the wrong type and a header nested too deeply are bad events, not a dropped connection.
        pcm = bytes(3200)
        assert (await refused(Event(type="transcribe", data={"language": 5}),
                              AudioStart(rate=16000, width=2, channels=1).event(),
                              AudioChunk(rate=16000, width=2, channels=1, audio=pcm).event(),
                              AudioStop().event())).code == "bad_event"
        reader, writer = await asyncio.open_connection(wy.host, wy.port)
        writer.write(b'{"type": "describe", "data": ' + b"[" * 20000 + b"]" * 20000 + b"}\n")
        await writer.drain()
        header = await asyncio.wait_for(reader.readline(), QUICK_S)
        assert b'"bad_event"' in header or b"bad_event" in await reader.read(4096), header
        writer.close()
    run(scenario())
    for model_id in ("whisper", "piper"):
        assert wy.stack.counters(model_id) == {"leases": 0, "queued": 0}


def test_a_client_that_stops_reading_a_synthesis_is_dropped_and_its_slot_given_back(wy):
    """A client that asks for a long synthesis, never reads and stays connected is dropped after
    ``stream_write_timeout_ms`` of writes going nowhere, as over HTTP: the speech slot comes back while
    its socket is still open, and HTTP speech is served (it held the slot for as long as it stayed)."""
    with socket.create_connection((wy.host, wy.port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        text = " ".join(f"This is sentence {i} of a long text that nobody reads." for i in range(60))
        sock.sendall((json.dumps({"type": "synthesize", "data": {"text": text}}) + "\n").encode())
        deadline = time.monotonic() + QUICK_S
        while wy.stack.counters("piper")["leases"] != 1:
            assert time.monotonic() < deadline, "the synthesis never took its slot"
            time.sleep(0.05)
        taken = time.monotonic()
        while wy.stack.counters("piper")["leases"] != 0:
            assert time.monotonic() - taken < QUICK_S, "the stalled reader still holds the slot"
            time.sleep(0.1)
        with wy.stack.client() as client:
            spoken = client.post("/v1/audio/speech", json={"model": "piper", "input": "Still here.", "voice": "joe",
                                                           "response_format": "pcm"})
        assert spoken.status_code == 200 and spoken.content
