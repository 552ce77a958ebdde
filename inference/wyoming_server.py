"""A Wyoming protocol server (Home Assistant's voice pipeline) on the same models and scheduler as HTTP.

``manage.py wyoming --uri tcp://0.0.0.0:10300`` runs it. Every request goes through the inference
services the HTTP views call (``inference.services``: ``request_probe``, ``run``, ``speech_open``),
so a Wyoming request queues in the model's FIFO, holds one slot, obeys the model's ``busy_timeout_ms``
ceiling and the server's ``busy_timeout_ms`` (Wyoming has no field for a per-request timeout), and gives
its lease back on every path, exactly as an HTTP request does.

Events served (wyoming 1.10):

- ``describe`` → ``info``: one ASR program whose models are the registered ``asr`` models (aliases not
  repeated) and one TTS program whose voices are the default speech model's voices and presets (as
  ``GET /v1/audio/voices``), then every other ``tts`` model's as ``<model id>:<voice id>``.
- ``transcribe`` (optional ``name``: a model id or alias, default the default ASR model; ``language``:
  ``en`` or ``en-US``, sent as ``en``) then ``audio-start``, ``audio-chunk``…, ``audio-stop`` →
  ``transcript`` (the text ``/v1/audio/transcriptions`` gives for the same audio). Audio without a
  ``transcribe`` first is transcribed by the default ASR model, as Home Assistant expects. The audio is
  s16le (``width`` 2), 1 or 2 channels, 8,000..48,000 Hz; it is buffered in this process (no slot held)
  and sent as a WAV upload once ``audio-stop`` arrives.
- ``synthesize`` (``text``, optional ``voice.name``) → ``audio-start`` (s16le mono at the voice's rate),
  ``audio-chunk``\\ s of at most :data:`AUDIO_CHUNK_BYTES`, ``audio-stop``; the slot is held until the
  last chunk was written or the client left (R8.3).
- ``ping`` → ``pong``. Other events are ignored.

Voice activity detection is not offered: the protocol's ``info`` has no VAD program a client could
discover, and Home Assistant runs its own VAD before it calls a Wyoming ASR service.

Bounds (every connection; a violation is an ``error`` event with ``code``, then the connection closes):
an event header line of at most :data:`MAX_HEADER_BYTES`, ``data`` of at most :data:`MAX_DATA_BYTES`, one
payload of at most :data:`MAX_PAYLOAD_BYTES`; one transcription's audio at most
``min(max_request_body_bytes, max_audio_seconds × rate × 2 × channels)`` bytes (``payload_too_large``);
synthesis text of 1..:data:`MAX_TEXT_CHARS` characters (``invalid_request_error``); at most
``wyoming_max_connections`` connections (``too_many_connections``); a connection silent for
:data:`IDLE_TIMEOUT_S` between events is closed. A client that disconnects while its request waits or
runs cancels it (its ticket or lease is given back; a run already on the worker finishes, R8.2). A
service refusal is the HTTP error's ``message`` with its ``code`` (or ``type``), e.g. ``queue_timeout``.
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import signal
import wave
from dataclasses import dataclass, field
from urllib.parse import urlparse

from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event, async_write_event
from wyoming.info import AsrModel, AsrProgram, Attribution, Describe, Info, TtsProgram, TtsVoice
from wyoming.ping import Ping, Pong
from wyoming.tts import Synthesize

from audiosite.errors import ApplicationError, InvalidRequest, NotFound
from audiosite.input_checks import TEXT_PROBLEMS, text_problem
from audiosite.serverconfig import get_config
from inference import services, voices
from inference.runtime import published
from inference.runtime.context import async_context

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
"""Longest event header line (JSON + newline); Home Assistant's are under 1 KiB."""
MAX_DATA_BYTES = 64 * 1024
"""Largest ``data_length`` block: a ``synthesize`` of :data:`MAX_TEXT_CHARS` characters of 4-byte UTF-8 fits."""
MAX_PAYLOAD_BYTES = 1024 * 1024
"""Largest payload of one event (an ``audio-chunk``: Home Assistant sends 2 KiB ones)."""
MAX_TEXT_CHARS = 4096
"""Longest ``synthesize`` text, as ``POST /v1/audio/speech``'s ``input`` (``SpeechInputSerializer``)."""
IDLE_TIMEOUT_S = 60.0
"""A connection that sends no event for this long is closed (it holds no slot while silent)."""
AUDIO_CHUNK_BYTES = 4096
"""Largest ``audio-chunk`` payload the server sends (1,024 s16le samples at 22,050 Hz: 46 ms)."""
MIN_RATE_HZ, MAX_RATE_HZ = 8000, 48000
"""Sample rates an ``audio-start`` may state (the decoder resamples to the model's rate)."""
LINGER_S = 2.0
"""How long a refused connection's remaining input is read and dropped before it closes (:meth:`Connection._linger`)."""
ATTRIBUTION = Attribution(name="audiosite", url="https://github.com/")
PROGRAM = "audiosite"


class Refusal(Exception):
    """A request this server refuses: sent as an ``error`` event (``text``, ``code``), then the connection closes."""

    def __init__(self, text: str, code: str):
        super().__init__(text)
        self.text, self.code = text, code


async def read_event(reader: asyncio.StreamReader) -> Event | None:
    """The next event from ``reader`` (None at end of stream), read within this module's bounds.

    Unlike ``wyoming.event.async_read_event`` (which reads any ``data_length`` and ``payload_length``
    a client states), a stated length over :data:`MAX_DATA_BYTES` / :data:`MAX_PAYLOAD_BYTES` is refused
    before anything is read; the reader's own limit bounds the header line (:data:`MAX_HEADER_BYTES`).

    Raises:
        Refusal: ``bad_event`` (a header line too long, not a JSON object with a string ``type``, bad
            lengths) or ``payload_too_large``.
    """
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            return None
        raise Refusal("the connection ended inside an event", "bad_event") from None
    except asyncio.LimitOverrunError:
        raise Refusal(f"an event header is longer than {MAX_HEADER_BYTES} bytes", "bad_event") from None
    try:
        header = json.loads(line)
    except (ValueError, RecursionError):
        raise Refusal("an event header is not JSON (or nested too deeply)", "bad_event") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise Refusal("an event header must be a JSON object with a string 'type'", "bad_event")
    data = header.get("data") or {}
    lengths = [header.get("data_length") or 0, header.get("payload_length") or 0]
    if not isinstance(data, dict) or any(type(n) is not int or n < 0 for n in lengths):
        raise Refusal("an event's data must be an object and its lengths whole numbers ≥ 0", "bad_event")
    data_length, payload_length = lengths
    if data_length > MAX_DATA_BYTES or payload_length > MAX_PAYLOAD_BYTES:
        raise Refusal(f"an event's data (at most {MAX_DATA_BYTES} bytes) or payload (at most {MAX_PAYLOAD_BYTES} "
                      "bytes) is too large", "payload_too_large")
    try:
        if data_length:
            extra = json.loads(await reader.readexactly(data_length))
            if not isinstance(extra, dict):
                raise Refusal("an event's data block must be a JSON object", "bad_event")
            data.update(extra)
        payload = await reader.readexactly(payload_length) if payload_length else None
    except asyncio.IncompleteReadError:
        raise Refusal("the connection ended inside an event", "bad_event") from None
    except (ValueError, RecursionError):
        raise Refusal("an event's data block is not JSON (or nested too deeply)", "bad_event") from None
    return Event(type=header["type"], data=data, payload=payload)


def _refusal_of(exc: ApplicationError) -> Refusal:
    error = exc.body()["error"]
    return Refusal(error["message"], error.get("code") or error["type"])


@dataclass
class _Audio:
    """One transcription being received: its model name and language (from ``transcribe``), format and bytes."""

    name: str | None = None
    language: str | None = None
    rate_hz: int = 0
    channels: int = 0
    limit_bytes: int = 0
    pcm: bytearray = field(default_factory=bytearray)
    started: bool = False


def _audio_limit_bytes(rate_hz: int, channels: int) -> int:
    """The most s16le bytes one transcription may send: ``max_audio_seconds`` at its format, and never
    more than ``max_request_body_bytes`` (an HTTP upload's bound)."""
    config = get_config()
    return min(config.max_request_body_bytes, int(config.max_audio_seconds * rate_hz * 2 * channels))


def _wav(audio: _Audio) -> bytes:
    """The received s16le PCM as a WAV file (what an HTTP client would upload)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(audio.channels)
        wav.setsampwidth(2)
        wav.setframerate(audio.rate_hz)
        wav.writeframes(bytes(audio.pcm))
    return out.getvalue()


def asr_languages(meta: dict) -> list[str]:
    """Languages an ASR registration transcribes, for ``info`` (Home Assistant offers a Wyoming ASR
    service only for a pipeline whose language is listed): ``["en"]`` for an English-only Whisper
    checkpoint (the packaged tiny.en, or a folder whose name ends ``.en``), else Whisper's language codes
    (``faster_whisper.tokenizer``); other families ``["en"]`` (the only language the packaged ones know)."""
    path = str(meta.get("path") or "")
    if meta.get("family") != "whisper" or not path or path.rstrip("/").endswith(".en"):
        return ["en"]
    from faster_whisper.tokenizer import _LANGUAGE_CODES
    return sorted(_LANGUAGE_CODES)


async def describe() -> Info:
    """The ``info`` event's content (module doc): the registered ASR models and the speech voices."""
    metas = await published.meta_all(await async_context())
    config = get_config()
    asr = [AsrModel(name=mid, languages=asr_languages(meta), attribution=ATTRIBUTION, installed=True,
                    description=f"{meta['family']} ({mid})", version=None)
           for mid, meta in metas.items() if meta.get("task") == "asr"]
    default_tts = config.default_model("tts")
    default_tts = config.aliases().get(default_tts or "", default_tts)
    tts_voices = []
    for mid, meta in sorted(metas.items(), key=lambda item: item[0] != default_tts):
        if meta.get("task") != "tts":
            continue
        for voice in voices.model_voices(meta):
            name = voice["id"] if mid == default_tts else f"{mid}:{voice['id']}"
            tts_voices.append(TtsVoice(name=name, languages=[voice["language"]] if voice.get("language") else [],
                                       attribution=ATTRIBUTION, installed=True, version=None,
                                       description=f"{mid} voice {voice.get('preset_of', voice['id'])}"))
    return Info(asr=[AsrProgram(name=PROGRAM, attribution=ATTRIBUTION, installed=True, version=None,
                                description="audiosite speech recognition", models=asr)] if asr else [],
                tts=[TtsProgram(name=PROGRAM, attribution=ATTRIBUTION, installed=True, version=None,
                                description="audiosite speech synthesis", voices=tts_voices)] if tts_voices else [])


class Connection:
    """One client connection: events are read by a task of their own (:meth:`_read`, one event queued at
    most, so a client cannot make the server buffer more), handled in order by :meth:`serve`; the
    client's leaving cancels the request in progress (its ticket or lease given back)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.events: asyncio.Queue[Event | Refusal | None] = asyncio.Queue(maxsize=1)
        self.gone = asyncio.Event()
        self.audio = _Audio()

    async def _read(self) -> None:
        try:
            while True:
                try:
                    event = await read_event(self.reader)
                except Refusal as refusal:
                    await self.events.put(refusal)
                    return
                if event is None:
                    return
                await self.events.put(event)
        except (ConnectionError, OSError):
            return
        finally:
            self.gone.set()
            with contextlib.suppress(asyncio.QueueFull):
                self.events.put_nowait(None)

    async def write(self, event: Event) -> None:
        """Send ``event``; a client that reads nothing of it for ``stream_write_timeout_ms`` is dropped
        (ConnectionResetError, so its request ends as for a client that left and its slot is given back),
        as over HTTP: a stalled reader held a speech slot for as long as it stayed connected."""
        timeout_s = get_config().stream_write_timeout_ms / 1000
        try:
            async with asyncio.timeout(timeout_s):
                await async_write_event(event, self.writer)
        except TimeoutError:
            self.writer.transport.abort()
            self.gone.set()
            raise ConnectionResetError(f"the client read nothing for {timeout_s:g} s") from None

    async def serve(self) -> None:
        """Handle events until the client leaves, is idle for :data:`IDLE_TIMEOUT_S`, or is refused."""
        reader_task = asyncio.ensure_future(self._read())
        try:
            while True:
                try:
                    item = await asyncio.wait_for(self.events.get(), IDLE_TIMEOUT_S)
                except TimeoutError:
                    return
                if item is None:
                    return
                if isinstance(item, Refusal):
                    raise item
                await self._while_present(self.handle(item))
        except Refusal as refusal:
            reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader_task  # _linger reads next: two readers of one stream is an error
            with contextlib.suppress(ConnectionError, OSError):
                await self.write(Error(text=refusal.text, code=refusal.code).event())
                await self._linger()
        except (ConnectionError, OSError):
            pass
        finally:
            reader_task.cancel()
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()

    async def _linger(self) -> None:
        """After a refusal: end our side (EOF), then read and drop what the client still sends for at most
        :data:`LINGER_S`, so that closing with its input unread does not reset the connection and
        discard the ``error`` event before the client reads it."""
        if self.writer.can_write_eof():
            self.writer.write_eof()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LINGER_S):
                while await self.reader.read(MAX_PAYLOAD_BYTES):
                    pass

    async def _while_present(self, coro) -> None:
        """Run ``coro``; cancel it if the client leaves first (services give back what they hold)."""
        task = asyncio.ensure_future(coro)
        gone = asyncio.ensure_future(self.gone.wait())
        try:
            await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            raise ConnectionResetError("the client left")
        task.result()

    async def handle(self, event: Event) -> None:
        """Dispatch one event (module doc).

        Raises:
            Refusal: a bad event or a refused request (sent to the client by :meth:`serve`).
        """
        try:
            if Describe.is_type(event.type):
                await self.write((await describe()).event())
            elif Ping.is_type(event.type):
                await self.write(Pong(text=Ping.from_event(event).text).event())
            elif Transcribe.is_type(event.type):
                transcribe = Transcribe.from_event(event)
                self.audio = _Audio(name=transcribe.name, language=transcribe.language)
            elif AudioStart.is_type(event.type):
                self._audio_start(AudioStart.from_event(event))
            elif AudioChunk.is_type(event.type):
                self._audio_chunk(event)
            elif AudioStop.is_type(event.type):
                await self._transcribe()
            elif Synthesize.is_type(event.type):
                await self._synthesize(Synthesize.from_event(event))
        except ApplicationError as exc:
            raise _refusal_of(exc) from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a field of the wrong type
            raise Refusal(f"a malformed {event.type!r} event: {type(exc).__name__}", "bad_event") from None

    def _audio_start(self, start: AudioStart) -> None:
        if start.width != 2 or not 1 <= start.channels <= 2 or not MIN_RATE_HZ <= start.rate <= MAX_RATE_HZ:
            raise Refusal(f"audio must be s16le (width 2), 1 or 2 channels, {MIN_RATE_HZ}..{MAX_RATE_HZ} Hz; got "
                          f"width {start.width}, {start.channels} channel(s), {start.rate} Hz", "unsupported_audio")
        self.audio.rate_hz, self.audio.channels = start.rate, start.channels
        self.audio.limit_bytes = _audio_limit_bytes(start.rate, start.channels)
        self.audio.pcm = bytearray()
        self.audio.started = True

    def _audio_chunk(self, event: Event) -> None:
        if not self.audio.started:
            raise Refusal("audio-chunk before audio-start", "bad_event")
        chunk = AudioChunk.from_event(event)
        if (chunk.rate, chunk.width, chunk.channels) != (self.audio.rate_hz, 2, self.audio.channels):
            raise Refusal("an audio-chunk's format differs from its audio-start's", "bad_event")
        if len(self.audio.pcm) + len(chunk.audio) > self.audio.limit_bytes:
            config = get_config()
            raise Refusal(f"audio over {self.audio.limit_bytes} bytes (max_audio_seconds={config.max_audio_seconds:g}"
                          f", max_request_body_bytes={config.max_request_body_bytes})", "payload_too_large")
        self.audio.pcm += chunk.audio

    async def _transcribe(self) -> None:
        audio, self.audio = self.audio, _Audio()
        if not audio.started or not audio.pcm:
            raise Refusal("audio-stop without audio", "bad_event")
        model_id = audio.name or get_config().default_model("asr")
        if not model_id:
            raise Refusal("no model named and no default speech recognition model configured", "model_not_found")
        ctx = await async_context()
        probe = await services.request_probe(ctx, model_id, None)
        meta = probe.entry
        assert meta is not None  # request_probe refuses a missing entry
        if meta["task"] != "asr":
            raise InvalidRequest(f"model {meta['id']!r} serves task {meta['task']!r}, not transcription", param="model")
        options = {"language": audio.language.split("-")[0].lower()} if audio.language else {}
        wav = _wav(audio)
        del audio
        outcome = await services.request_run(ctx, meta, services.AudioInput(wav, "audio"), options, None, probe)
        result = outcome.result
        await self.write(Transcript(text=result["text"], language=result.get("language")).event())

    async def _synthesize(self, synthesize: Synthesize) -> None:
        text = synthesize.text
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_TEXT_CHARS:
            raise InvalidRequest(f"text must have 1..{MAX_TEXT_CHARS} characters", param="text")
        problem = text_problem(text)
        if problem:  # the same refusal as the HTTP input's: the worker cannot take it
            raise InvalidRequest(f"text {TEXT_PROBLEMS[problem]}", param="text")
        name = synthesize.voice.name if synthesize.voice else None
        ctx = await async_context()
        model_id, voice = None, name
        if name and ":" in name:
            model_id, voice = name.split(":", 1)
        model_id = model_id or get_config().default_model("tts")
        if not model_id:
            raise NotFound("no default speech synthesis model is configured", param="voice")
        meta = await services.request_model_resolve(ctx, model_id, None)
        if meta["task"] != "tts":
            raise InvalidRequest(f"model {meta['id']!r} serves task {meta['task']!r}, not speech synthesis",
                                 param="voice")
        stream = await services.speech_open(ctx, meta, text, voices.voice_options(meta, voice), None)
        try:
            rate = stream.sample_rate_hz
            await self.write(AudioStart(rate=rate, width=2, channels=1).event())
            async for pcm in stream.pcm():
                for start in range(0, len(pcm), AUDIO_CHUNK_BYTES):
                    chunk = pcm[start:start + AUDIO_CHUNK_BYTES]
                    await self.write(AudioChunk(rate=rate, width=2, channels=1, audio=chunk).event())
            await self.write(AudioStop().event())
        finally:
            await stream.aclose()


async def serve_forever(uri: str, ready=None) -> None:
    """Listen on ``uri`` (``tcp://HOST:PORT``) until SIGINT/SIGTERM; ``ready(host, port)`` is called once listening.

    At most ``wyoming_max_connections`` connections are served at once; one more gets an ``error`` event
    (``too_many_connections``) and is closed. On a signal the listener closes and open connections are
    cancelled (each gives back what it holds).

    Raises:
        ValueError: ``uri`` is not ``tcp://HOST:PORT``.
    """
    parsed = urlparse(uri)
    if parsed.scheme != "tcp" or not parsed.hostname or parsed.port is None:
        raise ValueError(f"--uri must be tcp://HOST:PORT, not {uri!r}")
    limit = get_config().wyoming_max_connections
    tasks: set[asyncio.Task] = set()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(tasks) >= limit:
            with contextlib.suppress(ConnectionError, OSError):
                await async_write_event(Error(text=f"at most {limit} connections (wyoming_max_connections)",
                                              code="too_many_connections").event(), writer)
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await Connection(reader, writer).serve()
        except Exception:
            log.exception("wyoming connection failed")
        finally:
            tasks.discard(task)

    await async_context()  # fail at start-up, not on the first request, when Redis is unreachable
    server = await asyncio.start_server(accept, parsed.hostname, parsed.port, limit=MAX_HEADER_BYTES)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready(parsed.hostname, server.sockets[0].getsockname()[1])
    try:
        await stop.wait()
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
