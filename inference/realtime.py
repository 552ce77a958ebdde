"""Live transcription sessions: OpenAI's realtime transcription protocol, minus the socket.

A :class:`LiveSession` is one WebSocket connection of ``/v1/realtime?intent=transcription``
(the socket itself is ``inference.consumers.RealtimeConsumer``; this module decides).
Client events come in as parsed JSON objects (:meth:`LiveSession.handle`); server events go out
through the ``send`` callback, as dicts.

Audio: ``input_audio_buffer.append`` carries base64 of PCM s16le mono at 24 kHz (OpenAI's
``audio/pcm``, beta ``pcm16``) or 16 kHz (``audio/pcm`` with ``rate: 16000``); it is resampled to
Whisper's 16 kHz with a streaming soxr resampler per session.

Turns: with ``turn_detection`` ``server_vad`` (the default, OpenAI's defaults: threshold 0.5,
prefix_padding_ms 300, silence_duration_ms 500) Silero VAD runs on every 32 ms window in this
process (our ``silero_vad`` checkpoint, about 0.1 ms a window; a scheduler lease per window would
cost more than the inference). Speech opens a turn (``input_audio_buffer.speech_started``, its
audio starting ``prefix_padding_ms`` earlier); ``silence_duration_ms`` of silence (probability
below ``threshold - 0.15``, Silero's hysteresis) closes it (``speech_stopped`` then
``committed``). With ``turn_detection: null`` only ``input_audio_buffer.commit`` makes a turn.

Ownership (CONTRACT R8.3): each turn holds one request lease of the session's ASR model, taken
through the same FIFO as HTTP requests when the turn opens (speech started, or the commit) and
released once its ``completed`` (or ``failed``) event is out. A session therefore holds no slot
between turns: an unload or reconfiguration queued meanwhile is a barrier like for any request
(it waits for the running turn; the next turn reloads the model). This supersedes API.md's "one
lease for the session's life": an idle connection must not pin a slot for up to 10 minutes.
A turn that cannot get its slot within the model's busy timeout ends with
``conversation.item.input_audio_transcription.failed`` (``server_busy``) and the session goes on.
A server-VAD turn holds its slot while it is spoken, so it is bounded (``live_ingest``): it is
committed after ``turn_audio_timeout_ms`` without an append (a client that stopped sending) and at
``max_turn_ms`` of audio. A session opens no turn while ``max_pending_turns`` of its turns are not
transcribed, nor past ``max_turns_per_session`` (an ``error`` event, nothing queued).

Event loop: an append's conversion, resampling and VAD run in a thread (:func:`_prepare`); the
loop keeps only the JSON and base64 decoding (under 1 ms a 1 MiB frame) and the turn decisions.

Transcripts: a turn's ``…input_audio_transcription.completed`` ``transcript`` is one
decode of the whole turn's audio with the file route's options (the session's ``language`` and
``prompt``, the model's default beam): exactly the ``text`` ``POST /v1/audio/transcriptions``
answers for the same 16 kHz samples. While a server-VAD turn is still being spoken, the growing turn
is decoded again every :data:`PARTIAL_STEP_MS` of new audio (greedy, beam 1), except while the VAD
hears silence (the turn may be ending: the final decode should not wait behind a partial); the
words on which two consecutive decodes agree (case and punctuation aside) and that were not sent
yet go out as a ``…input_audio_transcription.delta``. Deltas are early and provisional: after the
final decode the words that follow the ones already sent (aligned, :func:`words_after`) form the
last delta, so the deltas concatenate to the ``completed`` transcript unless the final decode
revised a word a partial had sent; then the ``completed`` transcript is the one to keep.

Drain (R8.4): when the web process drains (or ``serve`` sends ``live.close`` with 1001),
:meth:`LiveSession.drain` commits the turn being spoken, refuses new turns, and waits until the
drain deadline for its turns: each ends with its ``completed`` transcript, or, at the deadline,
``…transcription.failed`` (``server_busy``, code ``shutting_down``). Then the final ``error``
event (``session_closed``) and close code 1001.

Disconnects: :meth:`LiveSession.close` cancels the turns; a decode running on the worker
finishes (it is not pre-empted, R8.2) and then the lease is released: at most one decode step.
"""
from __future__ import annotations

import asyncio
import binascii
import difflib
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import numpy as np
import redis.exceptions
import soxr

from audiosite.drain import refusal as drain_refusal
from audiosite.errors import ApplicationError, InvalidRequest, NotFound, RedisUnavailable
from audiosite.serverconfig import LiveIngest
from audiosite.input_checks import b64decode_strict
from inference import services, specs
from inference.adapters import silero_vad
from inference.runtime import leases, metrics, published
from inference.runtime.context import AsyncContext
from inference.scheduler import effective_timeout_ms

log = logging.getLogger(__name__)

MODEL_RATE_HZ = 16000
"""Whisper's input rate: every session's audio is resampled to it."""
INPUT_RATES_HZ = (24000, 16000)
"""PCM rates a client may send: OpenAI's 24 kHz, and 16 kHz (no resampling)."""
PARTIAL_STEP_MS = 500
"""A speaking turn is decoded again once it has grown by this much audio since its last decode."""
PARTIAL_MIN_MS = 700
"""No partial decode of a turn shorter than this (Whisper guesses on a fraction of a word)."""
MIN_COMMIT_MS = 100
"""The shortest buffer a commit accepts (OpenAI's: ``input_audio_buffer_commit_empty`` below 100 ms)."""
NEG_THRESHOLD_GAP = silero_vad.NEG_THRESHOLD_GAP
"""Speech ends below ``threshold - 0.15`` (Silero's hysteresis), starts at ``threshold``."""
ECHO_MAX_CHARS = 200
"""The most characters of a client's input (a ``repr``, an ``event_id``) an ``error`` event echoes back."""
MESSAGE_MAX_CHARS = 1000
"""The longest ``message`` of an ``error`` event (a safety net behind :func:`shown`)."""


def shown(value: object, limit: int = ECHO_MAX_CHARS) -> str:
    """``repr(value)`` for an error message, clipped to ``limit`` characters (ending ``…``), so that an
    error event never echoes a large input back. A large container is not formatted whole."""
    if isinstance(value, (dict, list)) and len(value) > limit:
        return f"<{type(value).__name__} of {len(value)} items>"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters (ending ``…`` when cut)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _event_id() -> str:
    return "event_" + uuid.uuid4().hex[:20]


def _new_item_id() -> str:
    return "item_" + uuid.uuid4().hex[:20]


class ClientError(Exception):
    """A client event that cannot be honoured: answered with an ``error`` event (``type``
    ``invalid_request_error``, ``code``, ``message``, ``param``, the client's ``event_id``); the
    session goes on unless ``close_code`` is set (then the socket closes with it after the event)."""

    def __init__(self, message: str, code: str, param: str | None = None, close_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.close_code = close_code


@dataclass(frozen=True)
class TurnDetection:
    """Server VAD settings (OpenAI's names and defaults): ``threshold`` in [0, 1] (speech
    probability), ``prefix_padding_ms`` of audio kept before the speech start, ``silence_duration_ms``
    of silence that ends a turn."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500

    def as_event(self) -> dict:
        return {"type": "server_vad", "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms}


@dataclass(frozen=True)
class Settings:
    """A session's configuration: the ASR ``model`` id, ``language`` (None = detect) and ``prompt``
    for Whisper, the client's PCM ``rate_hz``, and ``turn_detection`` (None = manual commits)."""

    model: str | None
    language: str | None = None
    prompt: str = ""
    rate_hz: int = 24000
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)


def _norm(word: str) -> str:
    return re.sub(r"[^\w']", "", word.lower())


def stable_prefix(previous: list[str], current: list[str]) -> int:
    """How many leading words two consecutive decodes agree on (compared without case and punctuation)."""
    n = 0
    for a, b in zip(previous, current, strict=False):
        if _norm(a) != _norm(b):
            break
        n += 1
    return n


def words_after(sent: list[str], final: list[str]) -> list[str]:
    """The words of the ``final`` decode that follow the words already ``sent`` as partials.

    When ``final`` starts with ``sent`` (case and punctuation aside) that is the rest of it; else
    ``final`` is aligned on ``sent`` (``difflib``) and the words after the last matched one are
    returned (a partial that the final decode revised cannot be taken back; the transcript keeps
    what was sent, so the deltas still concatenate to it).
    """
    if not sent:
        return final
    a, b = [_norm(w) for w in sent], [_norm(w) for w in final]
    if b[:len(a)] == a:
        return final[len(a):]
    blocks = [m for m in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks() if m.size]
    if not blocks:
        return final[len(sent):]
    last = blocks[-1]
    return final[last.b + last.size:]


class _Buffer:
    """The input audio buffer at 16 kHz: chunks since absolute sample ``start`` (samples counted
    from the session's first audio), appended without copying the whole."""

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []
        self.start = 0
        self.length = 0

    @property
    def end(self) -> int:
        return self.start + self.length

    def append(self, samples: np.ndarray) -> None:
        if samples.size:
            self.chunks.append(samples)
            self.length += samples.size

    def slice(self, lo: int, hi: int) -> np.ndarray:
        """Samples ``[lo, hi)`` (absolute, clipped to the buffer) as one float32 array."""
        lo, hi = max(lo, self.start), min(hi, self.end)
        if hi <= lo:
            return np.zeros(0, dtype=np.float32)
        whole = np.concatenate(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        self.chunks = [whole]
        return whole[lo - self.start: hi - self.start].copy()

    def drop_before(self, position: int) -> None:
        """Forget the samples before absolute ``position``."""
        cut = min(max(0, position - self.start), self.length)
        if not cut:
            return
        whole = np.concatenate(self.chunks) if self.chunks else np.zeros(0, dtype=np.float32)
        rest = whole[cut:]
        self.chunks = [rest] if rest.size else []
        self.start += cut
        self.length -= cut

    def keep_last(self, samples: int) -> None:
        """Forget all but the last ``samples`` (cheaply: whole chunks only, so a little more may stay)."""
        while len(self.chunks) > 1 and self.length - self.chunks[0].size >= samples:
            first = self.chunks.pop(0)
            self.start += first.size
            self.length -= first.size


class Turn:
    """One user turn (a conversation item): its audio from absolute sample ``start`` until ``end``
    (None while it is still being spoken), then ``audio`` (the committed samples)."""

    def __init__(self, item_id: str, start: int):
        self.item_id = item_id
        self.start = start
        self.end: int | None = None
        self.audio: np.ndarray | None = None
        self.grew = asyncio.Event()
        self.committed = asyncio.Event()
        self.pausing = False  # server VAD hears silence now: the turn may be about to end
        self.task: asyncio.Task | None = None
        self.ended = False  # its completed (or failed) event is out: nothing more is sent for it
        self.model = ""  # the registered model transcribing it, once known (its /metrics label)


_VAD_SHARED: list[silero_vad.Shared] = []


def _vad_shared() -> silero_vad.Shared:
    """This process's Silero graph for server VAD (opened on first use, from the ``silero_vad``
    family's packaged checkpoint)."""
    if not _VAD_SHARED:
        checkpoint = specs.resolve_checkpoint("silero_vad", None)
        _VAD_SHARED.append(silero_vad.open_shared(str(checkpoint), MODEL_RATE_HZ))
    return _VAD_SHARED[0]


def _prepare(pcm: bytes, resampler: soxr.ResampleStream | None,
             vad: silero_vad.VadStream | None) -> tuple[np.ndarray, np.ndarray | None]:
    """An append's PCM s16le ``pcm`` as float32 samples at 16 kHz (through the session's streaming
    ``resampler``, None when it is sent at 16 kHz) and the speech probabilities of the VAD windows
    they complete (None without server VAD). Run in a thread (CPU-bound: soxr and onnxruntime
    release the GIL while they compute)."""
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    if resampler is not None:
        samples = resampler.resample_chunk(samples)
    samples = np.ascontiguousarray(samples, dtype=np.float32)
    return samples, (vad.feed(samples) if vad is not None else None)


Send = Callable[[dict], Awaitable[None]]
Close = Callable[[int], Awaitable[None]]


class LiveSession:
    """One realtime transcription session (see the module docstring).

    Args:
        ctx: the web process's runtime context.
        send: awaited with each server event (a JSON-serialisable dict).
        close: awaited with a WebSocket close code when the session ends itself (limits).
        limits: the server's ``live_ingest``.
        default_model: the ASR model used until a ``session.update`` names one (None: none registered).
    """

    def __init__(self, ctx: AsyncContext, send: Send, close: Close, limits: LiveIngest, default_model: str | None):
        self.ctx = ctx
        self._send = send
        self._close = close
        self.limits = limits
        self.settings = Settings(model=default_model)
        self.session_id = "sess_" + uuid.uuid4().hex[:20]
        self._buffer = _Buffer()
        self._resampler: soxr.ResampleStream | None = None
        self._resampler_rate = 0
        self._vad: silero_vad.VadStream | None = None
        self._vad_pos = 0  # absolute sample where the next VAD window starts
        self._speaking: Turn | None = None
        self._silence_from: int | None = None
        self._turns: set[Turn] = set()
        self._turn_count = 0
        self._refusing = False  # server VAD heard speech it could not open a turn for (told the client once)
        self._last_item: str | None = None
        self._closed = False
        self._draining = False  # the server is going away: no new turn opens
        self._closing: asyncio.Future | None = None  # close(): its turns being ended
        self._started = time.monotonic()
        self._last_event = self._started
        self._last_audio = self._started
        self._watchdog: asyncio.Task | None = None

    # -- life -----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Send ``session.created`` and start watching the idle and total limits."""
        await self.emit({"type": "session.created", "session": self.session_object()})
        self._watchdog = asyncio.ensure_future(self._watch_limits())

    async def close(self) -> None:
        """End the session (the client left, or a limit closed it): cancel its turns; each running
        decode finishes on the worker and then its lease is released (at most one decode step).
        Idempotent: every call returns once the turns are over (a disconnect arriving while a drain
        closes the session waits for them too, so the drain waits for the leases to go back)."""
        if self._closing is None:
            self._closed = True
            if self._watchdog is not None:
                self._watchdog.cancel()
            tasks = [turn.task for turn in self._turns if turn.task is not None]
            for task in tasks:
                task.cancel()
            self._closing = asyncio.ensure_future(asyncio.gather(*tasks, return_exceptions=True))
        await asyncio.shield(self._closing)

    async def emit(self, event: dict) -> None:
        """Send one server event (an ``event_id`` is added), unless the session is closed."""
        if self._closed:
            return
        await self._send({"event_id": _event_id(), **event})

    async def error(self, exc: ClientError, client_event_id: str | None) -> None:
        """Send the ``error`` event of ``exc``, echoing the client's ``event_id``."""
        if client_event_id is not None:
            client_event_id = clip(client_event_id, ECHO_MAX_CHARS)
        await self.emit({"type": "error", "error": {"type": "invalid_request_error", "code": exc.code,
                                                    "message": clip(exc.message, MESSAGE_MAX_CHARS),
                                                    "param": exc.param, "event_id": client_event_id}})

    async def end(self, exc: ClientError, close_code: int) -> None:
        """Send a final ``error`` event, then close the socket with ``close_code``. The session's turns
        end (and their leases go back) even when the socket is already gone and sending fails."""
        try:
            await self.error(exc, None)
            await self._close(close_code)
        except Exception as send_exc:  # the client left first: nothing to tell it
            log.info("ending a live session: could not reach its client (%s)", send_exc)
        finally:
            await self.close()

    async def drain(self, deadline_s: float, close_code: int, reason: str = "the server is shutting down") -> None:
        """End the session because the server is going away (CONTRACT R8.4), without losing a turn.

        The turn being spoken is committed (``speech_stopped``, ``committed``) and no new turn opens
        (a commit or speech gets an ``error`` event, code ``shutting_down``). Each turn not transcribed
        yet ends with its ``completed`` transcript when its decode finishes by ``deadline_s``
        (``time.monotonic()`` seconds; the web process's drain deadline, ``shutdown_timeout_ms`` after the
        signal); one still queued or decoding then gets ``…transcription.failed`` (``server_busy``, code
        ``shutting_down``) instead. Then the final ``error`` event (``session_closed``, ``reason``) and close
        ``close_code``; a decode still running finishes on the worker before its lease goes back (at most
        one decode step, R8.2). Idempotent: a second call (the drain watch and ``serve``'s ``live.close``
        both ask) returns at once.
        """
        if self._draining or self._closed:
            return
        self._draining = True
        try:
            if self._speaking is not None:
                await self._commit_turn(self._speaking, self._buffer.end, stopped=True)
            pending = [turn for turn in self._turns if turn.task is not None and not turn.task.done()]
            if pending:
                left_s = max(0.0, deadline_s - time.monotonic())
                await asyncio.wait([turn.task for turn in pending if turn.task is not None], timeout=left_s)
                late = [turn for turn in pending if not turn.ended]
                if late:
                    log.info("live session %s: %d turn(s) not transcribed by the drain deadline", self.session_id,
                             len(late))
                for turn in late:
                    await self._failed(turn, drain_refusal("this turn (queued or decoding at the drain deadline)"))
        except Exception as exc:  # the client left meanwhile: end() below still frees the turns
            log.info("draining a live session: could not reach its client (%s)", exc)
        await self.end(ClientError(reason, "session_closed"), close_code)

    async def _watch_limits(self) -> None:
        """Close the session after ``idle_timeout_ms`` without a client event while no turn is being
        transcribed (the server still owes the client events then; the idle clock restarts when the
        last turn ends), or after ``total_timeout_ms`` in all."""
        while not self._closed:
            now = time.monotonic()
            idle_at = self._last_event + self.limits.idle_timeout_ms / 1000
            total_at = self._started + self.limits.total_timeout_ms / 1000
            if now >= total_at:
                await self.end(ClientError(f"the session reached its maximum duration "
                                           f"({self.limits.total_timeout_ms} ms, live_ingest.total_timeout_ms)",
                                           "session_expired"), 1000)
                return
            if now >= idle_at and self._turns:
                await asyncio.sleep(min(0.5, max(0.0, total_at - now)) + 0.01)
                continue
            if now >= idle_at:
                await self.end(ClientError(f"no client event for {self.limits.idle_timeout_ms} ms "
                                           "(live_ingest.idle_timeout_ms)", "idle_timeout"), 1000)
                return
            await asyncio.sleep(min(idle_at, total_at) - now + 0.01)

    # -- client events --------------------------------------------------------------------------
    async def handle(self, event: object) -> None:
        """Act on one client event (a parsed JSON value); a bad one gets an ``error`` event."""
        self._last_event = time.monotonic()
        event_id = event.get("event_id") if isinstance(event, dict) else None
        if not isinstance(event_id, str):
            event_id = None
        try:
            if not isinstance(event, dict):
                raise ClientError("a client event must be a JSON object", "invalid_event")
            kind = event.get("type")
            if kind == "input_audio_buffer.append":
                await self._append(event)
            elif kind == "input_audio_buffer.commit":
                await self._commit()
            elif kind == "input_audio_buffer.clear":
                await self._clear()
            elif kind in ("session.update", "transcription_session.update"):
                await self._update(event, beta=kind == "transcription_session.update")
            else:
                raise ClientError(f"unknown client event type {shown(kind)}; this server takes session.update, "
                                  "transcription_session.update and input_audio_buffer.append/commit/clear",
                                  "unknown_event_type", param="type")
        except ClientError as exc:
            await self.error(exc, event_id)
            if exc.close_code is not None:
                await self._close(exc.close_code)
                await self.close()

    async def _append(self, event: dict) -> None:
        """Add an append's audio to the buffer (and run server VAD over it).

        The base64 decoding (SIMD, about 0.05 ms per MiB) and the checks run here; the conversion,
        resampling and VAD of the chunk (about 0.1 s for a ``max_chunk_bytes`` frame of 1 MiB) run in
        a thread, so the web process's event loop is not held by them. A session's appends are
        handled one at a time (Channels dispatches a consumer's messages in order), so the
        resampler and VAD states are never used by two threads at once.
        """
        data = event.get("audio")
        if not isinstance(data, str):
            raise ClientError("input_audio_buffer.append needs 'audio': base64 of PCM s16le", "invalid_audio",
                              param="audio")
        try:
            pcm = b64decode_strict(data)
        except (binascii.Error, ValueError):
            raise ClientError("'audio' is not valid base64", "invalid_audio", param="audio") from None
        if len(pcm) % 2:
            raise ClientError(f"'audio' holds {len(pcm)} bytes: PCM s16le needs an even count", "invalid_audio",
                              param="audio")
        rate = self.settings.rate_hz
        buffered_bytes = (self._buffer.length + len(pcm) // 2 * MODEL_RATE_HZ // rate) * 2 * rate // MODEL_RATE_HZ
        if buffered_bytes > self.limits.max_body_bytes:
            raise ClientError(f"the input audio buffer would exceed {self.limits.max_body_bytes} bytes "
                              "(live_ingest.max_body_bytes); commit or clear it sooner", "buffer_too_large",
                              close_code=1009)
        if rate != MODEL_RATE_HZ and (self._resampler is None or self._resampler_rate != rate):
            self._resampler = soxr.ResampleStream(rate, MODEL_RATE_HZ, 1, dtype="float32", quality="HQ")
            self._resampler_rate = rate
        resampler = self._resampler if rate != MODEL_RATE_HZ else None
        vad = None
        if self.settings.turn_detection is not None:
            if self._vad is None:
                self._vad = silero_vad.VadStream(await asyncio.to_thread(_vad_shared))
                self._vad_pos = self._buffer.end
            vad = self._vad
        samples, probabilities = await asyncio.to_thread(_prepare, pcm, resampler, vad)
        self._last_audio = time.monotonic()
        self._buffer.append(samples)
        if probabilities is not None:
            await self._detect(probabilities)
        elif self._speaking is not None:
            self._speaking.grew.set()

    async def _detect(self, probabilities: np.ndarray) -> None:
        """Open and close turns after the server VAD's speech ``probabilities`` of the new windows.

        Raises:
            ClientError: speech began while the session may not open a turn (``max_pending_turns``,
                ``max_turns_per_session``); told once until a turn opens again.
        """
        vad = self.settings.turn_detection
        assert vad is not None
        per_ms = MODEL_RATE_HZ // 1000
        window = silero_vad.WINDOW_SAMPLES
        max_turn = self.limits.max_turn_ms * per_ms
        refused: ClientError | None = None
        for p in probabilities:
            lo, hi = self._vad_pos, self._vad_pos + window
            self._vad_pos = hi
            if self._speaking is None:
                if p >= vad.threshold:
                    refusal = self._turn_refusal()
                    if refusal is not None:
                        if not self._refusing:
                            refused = refusal
                        self._refusing = True
                        continue
                    self._refusing = False
                    start = max(self._buffer.start, lo - vad.prefix_padding_ms * per_ms)
                    turn = self._open_turn(start)
                    self._silence_from = None
                    await self.emit({"type": "input_audio_buffer.speech_started", "item_id": turn.item_id,
                                     "audio_start_ms": start // per_ms})
            else:
                if p >= max(vad.threshold - NEG_THRESHOLD_GAP, 0.01):
                    self._silence_from = None
                elif self._silence_from is None:
                    self._silence_from = lo
                if ((self._silence_from is not None and hi - self._silence_from >= vad.silence_duration_ms * per_ms)
                        or hi - self._speaking.start >= max_turn):
                    await self._commit_turn(self._speaking, hi, stopped=True)
        if self._speaking is not None:
            self._speaking.pausing = self._silence_from is not None
            self._speaking.grew.set()
        else:
            self._buffer.keep_last(vad.prefix_padding_ms * per_ms + window)
        if refused is not None:
            raise refused

    def _turn_refusal(self) -> ClientError | None:
        """Why a new turn may not open now (None: it may): ``max_turns_per_session`` turns were had, or
        ``max_pending_turns`` turns are not transcribed yet."""
        if self._draining:
            return ClientError("the server is shutting down: no new turn is opened; reconnect (another instance, "
                               "or after the restart)", "shutting_down")
        if self._turn_count >= self.limits.max_turns_per_session:
            return ClientError(f"this session has had its {self.limits.max_turns_per_session} turns "
                               "(live_ingest.max_turns_per_session); open a new session", "session_turn_limit")
        if len(self._turns) >= self.limits.max_pending_turns:
            return ClientError(f"{len(self._turns)} turns of this session are not transcribed yet "
                               f"(live_ingest.max_pending_turns is {self.limits.max_pending_turns}); the audio stays "
                               "in the buffer: commit it once a transcript has come", "too_many_pending_turns")
        return None

    async def _commit(self) -> None:
        turn = self._speaking
        if turn is not None:
            await self._commit_turn(turn, self._buffer.end)
            return
        if self._buffer.length < MIN_COMMIT_MS * MODEL_RATE_HZ // 1000:
            raise ClientError(f"buffer too small: {self._buffer.length * 1000 // MODEL_RATE_HZ} ms of audio, "
                              f"at least {MIN_COMMIT_MS} ms are needed", "input_audio_buffer_commit_empty")
        refusal = self._turn_refusal()
        if refusal is not None:
            raise refusal
        turn = self._open_turn(self._buffer.start)
        await self._commit_turn(turn, self._buffer.end)

    async def _clear(self) -> None:
        turn = self._speaking
        if turn is not None:  # the turn being spoken is dropped with its audio
            self._speaking = None
            if turn.task is not None:
                turn.task.cancel()
        self._buffer.drop_before(self._buffer.end)
        await self.emit({"type": "input_audio_buffer.cleared"})

    def _open_turn(self, start: int) -> Turn:
        turn = Turn(_new_item_id(), start)
        self._speaking = turn
        self._turns.add(turn)
        self._turn_count += 1
        turn.task = asyncio.ensure_future(self._transcribe(turn, self.settings))
        turn.task.add_done_callback(lambda _t: self._turn_done(turn))
        return turn

    def _turn_done(self, turn: Turn) -> None:
        self._turns.discard(turn)
        self._last_event = max(self._last_event, time.monotonic())  # the idle clock starts again now

    async def _commit_turn(self, turn: Turn, end: int, stopped: bool = False) -> None:
        """Commit ``turn`` with the buffer's audio up to absolute sample ``end``; ``stopped``: the server
        ended it (server VAD, a limit), so ``speech_stopped`` goes out first."""
        turn.end = end
        turn.audio = self._buffer.slice(turn.start, end)
        self._buffer.drop_before(end)
        self._speaking = None
        self._silence_from = None
        previous, self._last_item = self._last_item, turn.item_id
        if stopped:
            await self.emit({"type": "input_audio_buffer.speech_stopped", "item_id": turn.item_id,
                             "audio_end_ms": end * 1000 // MODEL_RATE_HZ})
        await self.emit({"type": "input_audio_buffer.committed", "item_id": turn.item_id,
                         "previous_item_id": previous})
        turn.committed.set()
        turn.grew.set()

    # -- session.update ---------------------------------------------------------------------------
    async def _update(self, event: dict, beta: bool) -> None:
        session = event.get("session")
        if not isinstance(session, dict):
            raise ClientError("session.update needs a 'session' object", "invalid_value", param="session")
        settings = await self._parse_settings(session, beta)
        if self._speaking is not None and (settings.turn_detection != self.settings.turn_detection
                                           or settings.rate_hz != self.settings.rate_hz):
            await self._commit_turn(self._speaking, self._buffer.end)
        if settings.turn_detection != self.settings.turn_detection:
            self._vad = None
        self.settings = settings
        if beta:
            await self.emit({"type": "transcription_session.updated", "session": self.beta_session_object()})
        else:
            await self.emit({"type": "session.updated", "session": self.session_object()})

    async def _parse_settings(self, session: dict, beta: bool) -> Settings:
        """The settings after ``session`` (GA ``session.update`` or beta ``transcription_session.update``
        shape); keys not given keep their values.

        Raises:
            ClientError: an unknown or non-ASR model, an unsupported format or turn detection, a bad value.
        """
        settings = self.settings
        if beta:
            fmt = session.get("input_audio_format")
            transcription = session.get("input_audio_transcription")
            has_vad, vad = "turn_detection" in session, session.get("turn_detection")
            prefix = "session."
            if fmt is not None:
                if fmt != "pcm16":
                    raise ClientError(f"input_audio_format {shown(fmt)} is not supported; use 'pcm16' (24 kHz)",
                                      "invalid_value", param="session.input_audio_format")
                settings = replace(settings, rate_hz=24000)
            transcription_param = "session.input_audio_transcription"
        else:
            kind = session.get("type", "transcription")
            if kind != "transcription":
                raise ClientError(f"session type {shown(kind)} is not supported; this server offers transcription "
                                  "sessions (session.type 'transcription')", "invalid_value", param="session.type")
            audio_in = (session.get("audio") or {}).get("input") if isinstance(session.get("audio"), dict) else None
            audio_in = audio_in if isinstance(audio_in, dict) else {}
            fmt = audio_in.get("format")
            transcription = audio_in.get("transcription")
            has_vad, vad = "turn_detection" in audio_in, audio_in.get("turn_detection")
            prefix = "session.audio.input."
            if fmt is not None:
                if not isinstance(fmt, dict) or fmt.get("type") != "audio/pcm":
                    raise ClientError(f"audio format {shown(fmt)} is not supported; use {{'type': 'audio/pcm', "
                                      "'rate': 24000}} (or rate 16000)", "invalid_value", param=prefix + "format")
                rate = fmt.get("rate", 24000)
                if rate not in INPUT_RATES_HZ or isinstance(rate, bool):
                    raise ClientError(f"audio rate {shown(rate)} is not supported; use 24000 or 16000", "invalid_value",
                                      param=prefix + "format.rate")
                settings = replace(settings, rate_hz=int(rate))
            transcription_param = prefix + "transcription"
        if transcription is not None:
            if not isinstance(transcription, dict):
                raise ClientError("transcription settings must be an object", "invalid_value",
                                  param=transcription_param)
            settings = await self._transcription(settings, transcription, transcription_param)
        if has_vad:
            vad_param = "session.turn_detection" if beta else prefix + "turn_detection"
            settings = replace(settings, turn_detection=self._turn_detection(vad, vad_param))
        return settings

    async def _transcription(self, settings: Settings, transcription: dict, param: str) -> Settings:
        model = transcription.get("model", settings.model)
        if not isinstance(model, str) or not model:
            raise ClientError("transcription model must be a model id", "invalid_value", param=param + ".model")
        meta = await published.meta_get(self.ctx, model)
        if meta is None:
            raise ClientError(f"model {shown(model)} is not registered", "model_not_found", param=param + ".model")
        if meta["task"] != "asr":
            raise ClientError(f"model {shown(model)} serves task {meta['task']!r}, not transcription", "invalid_value",
                              param=param + ".model")
        language = transcription.get("language", settings.language)
        prompt = transcription.get("prompt", settings.prompt)
        if language is not None and not isinstance(language, str):
            raise ClientError("language must be a string", "invalid_value", param=param + ".language")
        if not isinstance(prompt, str):
            raise ClientError("prompt must be a string", "invalid_value", param=param + ".prompt")
        options = {k: v for k, v in (("language", language or None), ("prompt", prompt or None)) if v is not None}
        errors = specs.request_option_errors(meta["family"], options)
        if errors:
            keys, text = errors[0]
            raise ClientError(f"{'.'.join(keys) or 'transcription'}: {text}", "invalid_value",
                              param=param + ("." + keys[0] if keys else ""))
        return replace(settings, model=model, language=language or None, prompt=prompt)

    @staticmethod
    def _turn_detection(value: object, param: str) -> TurnDetection | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ClientError("turn_detection must be an object or null", "invalid_value", param=param)
        if value.get("type", "server_vad") != "server_vad":
            raise ClientError(f"turn_detection type {shown(value.get('type'))} is not supported; use 'server_vad' "
                              "or null (manual commits)", "invalid_value", param=param + ".type")
        defaults = TurnDetection()
        threshold = value.get("threshold", defaults.threshold)
        padding = value.get("prefix_padding_ms", defaults.prefix_padding_ms)
        silence = value.get("silence_duration_ms", defaults.silence_duration_ms)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
            raise ClientError("threshold must be a number in [0, 1]", "invalid_value", param=param + ".threshold")
        for name, ms in (("prefix_padding_ms", padding), ("silence_duration_ms", silence)):
            if isinstance(ms, bool) or not isinstance(ms, int) or not 0 <= ms <= 10000:
                raise ClientError(f"{name} must be an integer in [0, 10000]", "invalid_value", param=f"{param}.{name}")
        return TurnDetection(float(threshold), int(padding), int(silence))

    def session_object(self) -> dict:
        """The session as GA events show it (``session.created`` / ``session.updated``)."""
        s = self.settings
        return {"type": "transcription", "object": "realtime.transcription_session", "id": self.session_id,
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": s.rate_hz},
                                    "transcription": {"model": s.model, "language": s.language, "prompt": s.prompt},
                                    "turn_detection": s.turn_detection.as_event() if s.turn_detection else None,
                                    "noise_reduction": None}},
                "include": []}

    def beta_session_object(self) -> dict:
        """The session as the beta ``transcription_session.updated`` shows it."""
        s = self.settings
        return {"id": self.session_id, "object": "realtime.transcription_session",
                "input_audio_format": "pcm16" if s.rate_hz == 24000 else f"pcm16/{s.rate_hz}",
                "input_audio_transcription": {"model": s.model, "language": s.language, "prompt": s.prompt},
                "turn_detection": s.turn_detection.as_event() if s.turn_detection else None,
                "input_audio_noise_reduction": None, "include": []}

    # -- one turn --------------------------------------------------------------------------------
    async def _final(self, turn: Turn, event: dict, error: ApplicationError | None = None) -> None:
        """Send the turn's last event (``completed``, or ``failed`` with ``error``), once: a turn a drain
        failed at its deadline sends nothing after that. The turn counts as one request in /metrics."""
        if turn.ended:
            return
        turn.ended = True
        seconds = turn.audio.size / MODEL_RATE_HZ if error is None and turn.audio is not None else 0.0
        metrics.record_soon(*metrics.realtime_turn(turn.model, error.status if error else 200,
                                                   error.code if error else None, seconds))
        await self.emit(event)

    async def _failed(self, turn: Turn, exc: ApplicationError) -> None:
        body = exc.body()["error"]
        await self._final(turn, {"type": "conversation.item.input_audio_transcription.failed",
                                 "item_id": turn.item_id, "content_index": 0,
                                 "error": {"type": body["type"], "code": body["code"], "message": body["message"],
                                           "param": body["param"]}}, exc)

    async def _delta(self, turn: Turn, text: str) -> None:
        if turn.ended:
            return
        await self.emit({"type": "conversation.item.input_audio_transcription.delta", "item_id": turn.item_id,
                         "content_index": 0, "delta": text})

    async def _transcribe(self, turn: Turn, settings: Settings) -> None:
        """The turn's task: :meth:`_transcribe_turn`, and a ``failed`` event for the turn whatever else
        ends it: a Redis failure (``redis_unavailable``) or a bug (``server_error``, logged). Without
        this the task's exception went unread and the client never heard of its turn again."""
        try:
            await self._transcribe_turn(turn, settings)
        except asyncio.CancelledError:
            raise
        except redis.exceptions.RedisError as exc:
            log.warning("live session %s: a turn lost Redis (%s)", self.session_id, exc)
            await self._fail_unexpectedly(turn, RedisUnavailable(
                f"the coordination store (Redis) is unavailable or overloaded: {type(exc).__name__}"))
        except Exception:
            log.exception("live session %s: a turn failed", self.session_id)
            await self._fail_unexpectedly(turn, ApplicationError("internal server error"))

    async def _fail_unexpectedly(self, turn: Turn, error: ApplicationError) -> None:
        """Send ``failed`` for ``turn`` once it is committed (as every turn's last event comes after its
        ``committed``); nothing if its last event went out already."""
        try:
            await self._until_committed(turn)
            await self._failed(turn, error)
        except Exception as exc:  # the client left meanwhile: nobody to tell
            log.info("live session %s: could not report a failed turn (%s)", self.session_id, exc)

    async def _transcribe_turn(self, turn: Turn, settings: Settings) -> None:
        """Take the turn's lease, send partial deltas while it is spoken, then its final transcript."""
        if settings.model is None:
            await self._until_committed(turn)
            await self._failed(turn, NotFound("no transcription model: name one in session.update "
                                              "(audio.input.transcription.model)", param="model"))
            return
        try:
            meta = await services.request_model_resolve(self.ctx, settings.model, None)
            turn.model = meta["id"]
            if meta["task"] != "asr":
                raise InvalidRequest(f"model {settings.model!r} no longer serves transcription", param="model")
            timeout_ms = effective_timeout_ms(None, published.ceiling_ms(meta))
            lease = await services.stream_lease_acquire(self.ctx, meta, timeout_ms)
        except ApplicationError as exc:
            await self._until_committed(turn)
            await self._failed(turn, exc)
            return
        try:
            async with self.ctx.scheduler.keep_alive(settings.model, lease.lease_id):
                await self._decode_turn(turn, settings, lease, timeout_ms)
        except ApplicationError as exc:
            await self._failed(turn, exc)
        finally:
            await leases.run_to_completion(self.ctx.scheduler.release(settings.model, lease.lease_id))

    async def _await_audio(self, turn: Turn) -> None:
        """Wait until ``turn`` grows or is committed. When no append came for ``turn_audio_timeout_ms``
        while it is open, commit it (``speech_stopped``, ``committed``): a turn holds a slot of the model,
        and a client that stopped sending mid-speech must not keep it (nor the session, whose idle
        timeout waits for its turns)."""
        timeout_s = self.limits.turn_audio_timeout_ms / 1000
        while not (turn.grew.is_set() or turn.committed.is_set()):
            left_s = self._last_audio + timeout_s - time.monotonic()
            if left_s <= 0:
                if self._speaking is turn:
                    log.info("live session %s: no audio for %d ms; committing its open turn", self.session_id,
                             self.limits.turn_audio_timeout_ms)
                    await self._commit_turn(turn, self._buffer.end, stopped=True)
                return
            try:
                await asyncio.wait_for(turn.grew.wait(), left_s)
            except TimeoutError:
                pass

    async def _until_committed(self, turn: Turn) -> None:
        """Wait until ``turn`` is committed (by the client, the VAD or :meth:`_await_audio`'s timeout)."""
        while not turn.committed.is_set():
            turn.grew.clear()
            await self._await_audio(turn)

    async def _decode_turn(self, turn: Turn, settings: Settings, lease, timeout_ms: int) -> None:
        options: dict = {}
        if settings.language:
            options["language"] = settings.language
        if settings.prompt:
            options["prompt"] = settings.prompt
        sent: list[str] = []
        text = ""
        previous: list[str] | None = None
        decoded_len = 0
        step = PARTIAL_STEP_MS * MODEL_RATE_HZ // 1000
        while not turn.committed.is_set():
            length = self._buffer.end - turn.start
            if (length >= PARTIAL_MIN_MS * MODEL_RATE_HZ // 1000 and length - decoded_len >= step
                    and not turn.pausing):
                audio = self._buffer.slice(turn.start, self._buffer.end)
                decoded_len = length
                t0 = time.monotonic()
                result = await services.live_turn_decode(self.ctx, settings.model or "", lease, audio, MODEL_RATE_HZ,
                                                    {**options, "beam_size": 1}, timeout_ms)
                metrics.record_soon(metrics.realtime_partial(turn.model))
                log.debug("partial decode of %d ms of audio took %.0f ms: %r", length * 1000 // MODEL_RATE_HZ,
                          (time.monotonic() - t0) * 1000, result["text"])
                current = result["text"].split()
                if previous is not None:
                    agreed = stable_prefix(previous, current)
                    if agreed > len(sent):
                        new = current[len(sent):agreed]
                        delta = (" " if text else "") + " ".join(new)
                        sent.extend(new)
                        text += delta
                        await self._delta(turn, delta)
                previous = current
                continue
            turn.grew.clear()
            if not turn.committed.is_set():
                await self._await_audio(turn)
        assert turn.audio is not None
        # The transcript: one decode of the whole turn with the file route's options (no beam_size: the
        # model's default), so it is the text POST /v1/audio/transcriptions gives for these samples.
        result = await services.live_turn_decode(self.ctx, settings.model or "", lease, turn.audio, MODEL_RATE_HZ,
                                            options, timeout_ms)
        transcript = result["text"]
        rest = words_after(sent, transcript.split())
        if rest:
            await self._delta(turn, (" " if text else "") + " ".join(rest))
        await self._final(turn, {"type": "conversation.item.input_audio_transcription.completed",
                                 "item_id": turn.item_id, "content_index": 0, "transcript": transcript,
                                 "usage": {"type": "duration", "seconds": round(turn.audio.size / MODEL_RATE_HZ, 3)}})


async def default_model(ctx: AsyncContext, asked: str | None = None) -> str | None:
    """The ASR model a session uses until ``session.update`` names one: ``asked`` (the connection
    URL's ``model``) when it is a registered ASR model, else the first registered model of task
    ``asr`` by id, or None when there is none."""
    metas = await published.meta_all(ctx)
    if asked is not None and metas.get(asked, {}).get("task") == "asr":
        return asked
    asr = sorted(model_id for model_id, meta in metas.items() if meta.get("task") == "asr")
    return asr[0] if asr else None
