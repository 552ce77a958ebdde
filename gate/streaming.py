"""The streaming model checks of the validation gate (``validate_slots --mode streaming``; VALIDATION.md M6:
"streaming needs concurrent streams with disconnect/reset").

The offline procedure (``model_checks.py``) runs with three things changed (:data:`STREAMING`):

- every workload item is sent as a stream by a real client (:class:`StreamClient`): whisper's SSE items
  through the official ``openai`` SDK (``client.audio.transcriptions.create(stream=True)``), its realtime
  items as one manual-commit turn over ``/v1/realtime`` with the ``websockets`` package, piper's items
  through the SDK's ``audio.speech`` with ``stream_format="sse"``. A stream's result is its final text
  (whisper) or the SHA-256 and length of its PCM (piper); the stream's deltas joined in order must equal
  the final text, else the result carries ``stream_problem`` and differs from its reference;
- M1 (:func:`streamed_answers_match_offline`): on the legacy runtime and on one parallel slot, every item's
  *offline* answer (whisper: ``POST /v1/audio/transcriptions`` without ``stream``; piper: ``POST
  /v1/tasks/run``, the PCM of its WAV) and its streamed answer, each three times serially (the serial
  repeat variation measured first); the legacy offline answers are the references every later stream
  is compared with, byte for byte (no tolerance: the streamed results are exact);
- M4 gains :func:`disconnects_free_their_slot`: at each count, a stream whose client closes (FIN) or resets
  (RST) its connection after the first frame, beside ``n - 1`` healthy streams: its slot must be free within
  one step (:data:`STEP_SLACK_MS` over the slowest step seen), the healthy streams must equal their
  references, and the counters drain;
- M6 (:func:`streaming_admits_streaming_only`): streaming evidence admits streaming only.

M2, M3 and M5 are the offline procedure's, with streams: concurrent cold and warm waves of ``n`` streams
with different inputs, ``active_slots`` polled, mixed waves with the admission order reversed, and
20 memory cycles.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import socket
import struct
import time
from pathlib import Path
from typing import Any

import openai
import soundfile
import websockets

from inference import specs

from .evidence import FAIL, NOT_APPLICABLE, PASS, check
from .model_checks import (MODEL_ID, REQUEST_TIMEOUT_S, SERIAL_REPEATS, Client, ModeChecks, Outcome, Plan, Run,
                           _drained, _pick)
from .servers import Server
from .workloads import Item, Workload, digest, inputs

REALTIME_RATE_HZ = 16000
REALTIME_APPEND_BYTES = 16000  # 0.5 s of 16 kHz s16le per input_audio_buffer.append
#: "Within one step": STEP_FACTOR x the slowest step seen (time to a stream's first frame or between two
#: frames; the victim's own item streamed just before the wave, and the healthy streams of the wave), plus
#: STEP_SLACK_MS for the lease release and the status poll (every 10 ms). The factor allows for the load
#: changing between the measured step and the victim's (a shared 2-core machine: about +/- 30 %); a stream
#: that ran to its end instead would take all its steps left (``victim_steps_left_ms``, several steps).
STEP_FACTOR = 1.5
STEP_SLACK_MS = 500.0
FREE_WAIT_S = 60.0
#: The victims of the disconnect waves: whisper's SSE stream of 35 s (two 30 s windows: the second
#: window's decode is left when it drops after the first delta) and a realtime turn (dropped once
#: committed, its decode running), and for piper a text of six sentences (five steps left when it drops
#: after the first). A victim's own answer is never compared (it never finishes).
VICTIMS = {"whisper": (Item("sse_victim_35s", "speech_x10", {"language": "en"}, "sse"),
                       Item("rt_pad_prompt", "speech_pad", {"prompt": "Concorde, tents."}, "realtime")),
           "piper": (Item("victim_six_sentences", "One. The validation gate runs real servers. Every answer is "
                                                  "compared. Streams are held to their count. A client leaves. "
                                                  "Its slot comes back.", {"seed": 6}, "speech"),)}
SPEECH_VOICE = "joe"  # the voice of the packaged checkpoint (en_US-joe-medium)


def _pcm16(source: str) -> bytes:
    """The s16le PCM of an input WAV (16 kHz mono, ``workloads.inputs``)."""
    samples, rate = soundfile.read(io.BytesIO(inputs()[source]), dtype="int16")
    if rate != REALTIME_RATE_HZ:
        raise ValueError(f"input {source!r} is {rate} Hz; a realtime turn here sends {REALTIME_RATE_HZ} Hz")
    return samples.tobytes()


def _text_result(deltas: list[str], final: str | None) -> dict:
    """A transcription stream's comparable result; ``stream_problem`` when its deltas do not add up."""
    result: dict[str, Any] = {"text": final}
    if final is None:
        result["stream_problem"] = "the stream ended without its final text"
    elif "".join(deltas) != final:
        result["stream_problem"] = f"deltas joined {''.join(deltas)!r} differ from the final text"
    return result


def _pcm_result(pcm: bytes) -> dict:
    return {"pcm_sha256": hashlib.sha256(pcm).hexdigest(), "pcm_bytes": len(pcm)}


def _steps(started: float, times: list[float]) -> list[float]:
    """Milliseconds to the first frame, then between consecutive frames."""
    marks = [started, *times]
    return [round((b - a) * 1000, 1) for a, b in zip(marks, marks[1:], strict=False)]


class StreamFailed(Exception):
    """A stream refused or failed: ``status`` (the HTTP status, or the one its error type stands for) and
    ``error`` (the error object)."""

    def __init__(self, status: int, error: Any):
        super().__init__(f"HTTP {status}: {error}")
        self.status, self.error = status, error


_ERROR_STATUS = {"invalid_request_error": 400, "not_found_error": 404, "server_busy": 503,
                 "insufficient_memory": 503}


class StreamClient(Client):
    """:class:`model_checks.Client` whose ``ask`` sends an item as a stream on its ``route`` and whose
    ``offline`` gets the same input's offline answer (see the module docstring)."""

    def __init__(self, server: Server, workload: Workload):
        super().__init__(server, workload)
        self.sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="validation", max_retries=0,
                                      timeout=REQUEST_TIMEOUT_S)

    async def aclose(self) -> None:
        await self.sdk.close()
        await super().aclose()

    async def ask(self, model_id: str, item: Item) -> Outcome:
        """Stream ``item`` to ``model_id``: its comparable result hashed, and its steps (ms)."""
        started = time.perf_counter()
        times: list[float] = []
        try:
            if item.route == "sse":
                result = await self._sse(model_id, item, times)
            elif item.route == "realtime":
                result = await self._realtime(model_id, item, times)
            else:
                result = await self._speech(model_id, item, times)
        except StreamFailed as exc:
            return Outcome(item.name, exc.status, None, (time.perf_counter() - started) * 1000, {"error": exc.error})
        except openai.APIStatusError as exc:
            body = exc.body if isinstance(exc.body, dict) else {"_body": str(exc.body)[:2000]}
            return Outcome(item.name, exc.status_code, None, (time.perf_counter() - started) * 1000, body)
        ms = (time.perf_counter() - started) * 1000
        return Outcome(item.name, 200, digest(result), ms, result, steps_ms=_steps(started, times))

    async def _sse(self, model_id: str, item: Item, times: list[float]) -> dict:
        options = {k: v for k, v in item.options.items() if k in ("language", "prompt", "temperature")}
        stream = await self.sdk.audio.transcriptions.create(
            model=model_id, file=(f"{item.source}.wav", inputs()[item.source], "audio/wav"), stream=True, **options)
        deltas: list[str] = []
        final = None
        try:
            async for event in stream:
                times.append(time.perf_counter())
                if event.type == "transcript.text.delta":
                    deltas.append(event.delta)
                elif event.type == "transcript.text.done":
                    final = event.text
        except openai.APIError as exc:  # an error event after the headers
            raise StreamFailed(500, getattr(exc, "body", None) or str(exc)) from None
        return _text_result(deltas, final)

    def _realtime_url(self) -> str:
        return self.server.url.replace("http://", "ws://", 1) + "/v1/realtime?intent=transcription"

    async def _realtime_turn(self, ws, model_id: str, item: Item) -> None:
        """Configure a manual-commit session for ``item`` on ``ws``, send its audio and commit the turn."""
        transcription = {"model": model_id, **{k: item.options[k] for k in ("language", "prompt") if k in item.options}}
        await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": REALTIME_RATE_HZ}, "transcription": transcription,
            "turn_detection": None}}}}))
        pcm = _pcm16(item.source)
        for at in range(0, len(pcm), REALTIME_APPEND_BYTES):
            chunk = base64.b64encode(pcm[at:at + REALTIME_APPEND_BYTES]).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))

    async def _realtime(self, model_id: str, item: Item, times: list[float]) -> dict:
        deltas: list[str] = []
        async with websockets.connect(self._realtime_url(), max_size=None, open_timeout=60) as ws:
            await self._realtime_turn(ws, model_id, item)
            async for message in ws:
                event = json.loads(message)
                kind = event["type"]
                if kind == "conversation.item.input_audio_transcription.delta":
                    times.append(time.perf_counter())
                    deltas.append(event["delta"])
                elif kind == "conversation.item.input_audio_transcription.completed":
                    times.append(time.perf_counter())
                    return _text_result(deltas, event["transcript"])
                elif kind in ("conversation.item.input_audio_transcription.failed", "error"):
                    error = event.get("error") or {}
                    raise StreamFailed(_ERROR_STATUS.get(str(error.get("type")), 500), error)
        raise StreamFailed(500, "the realtime session closed before the turn's transcript")

    async def _speech(self, model_id: str, item: Item, times: list[float]) -> dict:
        chunks: list[bytes] = []
        done = None
        extra = {"seed": item.options["seed"]} if "seed" in item.options else {}
        async with self.sdk.audio.speech.with_streaming_response.create(
                model=model_id, voice=SPEECH_VOICE, input=item.source, response_format="pcm", stream_format="sse",
                speed=item.options.get("speed", 1.0), extra_body=extra) as resp:
            async for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                times.append(time.perf_counter())
                if event["type"] == "speech.audio.delta":
                    chunks.append(base64.b64decode(event["audio"]))
                elif event["type"] == "speech.audio.done":
                    done = event
                elif event["type"] == "error":
                    raise StreamFailed(500, event.get("error"))
        result = _pcm_result(b"".join(chunks))
        if done is None:
            result["stream_problem"] = "the stream ended without speech.audio.done"
        return result

    async def offline(self, model_id: str, item: Item) -> Outcome:
        """The offline answer of ``item``'s input and options, in the form of a stream's result."""
        started = time.perf_counter()
        if self.workload.text_input:
            options = {k: v for k, v in item.options.items() if k in ("seed", "speed")}
            resp = await self.http.post("/v1/tasks/run", json={"model": model_id,
                                                                "request": {"text": item.source, "options": options}})
        else:
            form = {"model": model_id, "response_format": "json",
                    **{k: str(v) for k, v in item.options.items() if k in ("language", "prompt", "temperature")}}
            resp = await self.http.post("/v1/audio/transcriptions", data=form,
                                        files={"file": (f"{item.source}.wav", inputs()[item.source], "audio/wav")})
        ms = (time.perf_counter() - started) * 1000
        if resp.status_code != 200:
            return Outcome(item.name, resp.status_code, None, ms, {"_body": resp.text[:2000]})
        if self.workload.text_input:
            samples, _rate = soundfile.read(io.BytesIO(base64.b64decode(resp.json()["audio"])), dtype="int16")
            result = _pcm_result(samples.tobytes())
        else:
            result = _text_result([resp.json()["text"]], resp.json()["text"])
        return Outcome(item.name, 200, digest(result), ms, result)

    async def send_invalid(self, model_id: str) -> tuple[int, Any]:
        """The invalid request as a stream: undecodable audio with ``stream=true``, or empty speech input."""
        if self.workload.text_input:
            resp = await self.http.post("/v1/audio/speech", json={"model": model_id, "input": "", "voice": SPEECH_VOICE,
                                                                   "response_format": "pcm", "stream_format": "sse"})
        else:
            resp = await self.http.post("/v1/audio/transcriptions", data={"model": model_id, "stream": "true"},
                                        files={"file": ("bad.wav", b"not audio at all" * 64, "audio/wav")})
        try:
            return resp.status_code, resp.json().get("error")
        except ValueError:
            return resp.status_code, resp.text[:300]


# -- M1 -------------------------------------------------------------------------------------------------

async def _serial_pairs(run: Run, client: StreamClient, phase: str) -> dict[str, dict[str, list[Outcome]]]:
    """Every item's offline answer, then its streamed answer, each ``SERIAL_REPEATS`` times, one at a time."""
    out: dict[str, dict[str, list[Outcome]]] = {}
    for item in run.workload.items:
        for kind in ("offline", "streamed"):
            for repeat in range(SERIAL_REPEATS):
                got = await (client.offline(MODEL_ID, item) if kind == "offline" else client.ask(MODEL_ID, item))
                out.setdefault(item.name, {}).setdefault(kind, []).append(got)
                run.log(phase=f"{phase}-{kind}", item=item.name, repeat=repeat, status=got.status, sha256=got.sha,
                        ms=round(got.ms, 1), steps_ms=got.steps_ms)
    return out


def streamed_answers_match_offline(run: Run, workdir: Path, admission_dir: Path) -> dict:
    """M1 for streams: on the legacy runtime (first) and one parallel slot, every item's offline and streamed
    answers repeat exactly over ``SERIAL_REPEATS`` serial sends, the streamed answer equals the offline one,
    and the two runtimes agree. Sets ``run.references`` to the legacy offline answers. Returns the check.

    Raises:
        CommandError (from :class:`Server`): a server did not start.
    """
    wl = run.workload
    ev: dict = {"repeats_per_item": SERIAL_REPEATS, "items": [{"name": i.name, "route": i.route} for i in wl.items]}
    problems: list[str] = []
    answers: dict[str, dict] = {}
    for runtime, parallel in (("legacy", False), ("parallel_one_slot", True)):
        folder = workdir / f"m1-{runtime}"
        folder.mkdir()
        server = Server(folder, [wl.registration(MODEL_ID, 1 if parallel else None)], parallel,
                        {"backend": run.backend}, {specs.ADMISSION_DIR_ENV: str(admission_dir)})
        try:
            async def go(server: Server = server, runtime: str = runtime) -> dict:
                client = StreamClient(server, wl)
                try:
                    return await _serial_pairs(run, client, f"M1-{runtime}")
                finally:
                    await client.aclose()
            answers[runtime] = asyncio.run(go())
            ev[f"{runtime}_start_s"] = round(server.start_s, 2)
        finally:
            server.stop()
        rows: dict[str, dict] = {}
        for name, by_kind in answers[runtime].items():
            rows[name] = {}
            for kind, outs in by_kind.items():
                statuses = sorted({o.status for o in outs})
                hashes = sorted({o.sha for o in outs if o.sha})
                rows[name][kind] = {"statuses": statuses, "distinct_answers": len(hashes),
                                    "ms": [round(o.ms, 1) for o in outs], "steps_ms": [o.steps_ms for o in outs]}
                if statuses != [200]:
                    problems.append(f"{runtime} {name} {kind}: HTTP {statuses}: {outs[0].payload}")
                elif len(hashes) != 1:
                    problems.append(f"{runtime} {name} {kind}: {len(hashes)} different answers in "
                                    f"{SERIAL_REPEATS} serial repeats")
            if runtime == "legacy" and by_kind["offline"][0].sha:
                run.references[name] = by_kind["offline"][0].sha
                run.keep("reference", name, by_kind["offline"][0].payload)
        ev[f"{runtime}_serial"] = rows
    for name in answers["legacy"]:
        for runtime in answers:
            streamed = answers[runtime][name]["streamed"]
            if any(o.sha != run.references.get(name) for o in streamed):
                problems.append(f"{runtime} {name}: the streamed answer differs from the offline answer")
                for i, o in enumerate(streamed):
                    run.keep("mismatch", f"M1-{runtime}-{name}-{i}", o.payload)
            if any(o.sha != run.references.get(name) for o in answers[runtime][name]["offline"]):
                problems.append(f"{runtime} {name}: the offline answer differs from the legacy runtime's")
    ev["reference_sha256"] = dict(run.references)
    ev["tolerance"] = "none: streamed results must equal the offline answers exactly"
    ev["serial_step_ms"] = {name: max((s for o in answers["legacy"][name]["streamed"] for s in o.steps_ms),
                                      default=0.0) for name in answers["legacy"]}
    return check(FAIL if problems else PASS, ev, "; ".join(problems))


# -- M4: disconnect and reset mid-stream ------------------------------------------------------------------

def _drop(writer_or_transport, how: str) -> None:
    """End a connection: ``close`` (FIN) or ``reset`` (RST: SO_LINGER 0, then abort)."""
    transport = getattr(writer_or_transport, "transport", writer_or_transport)
    if how == "reset":
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    else:
        transport.close()


async def _victim_http(client: StreamClient, item: Item, how: str, before_drop) -> dict:
    """Send ``item`` as a stream over a raw socket, read until its first frame, ``await before_drop()``, then
    drop the connection."""
    if item.route == "speech":
        request = client.http.build_request("POST", "/v1/audio/speech", json={
            "model": MODEL_ID, "input": item.source, "voice": SPEECH_VOICE, "response_format": "pcm",
            "stream_format": "sse", **{k: v for k, v in item.options.items() if k in ("seed", "speed")}})
        marker = b"speech.audio.delta"
    else:
        request = client.http.build_request(
            "POST", "/v1/audio/transcriptions",
            files={"file": (f"{item.source}.wav", inputs()[item.source], "audio/wav")},
            data={"model": MODEL_ID, "stream": "true",
                  **{k: str(v) for k, v in item.options.items() if k in ("language", "prompt", "temperature")}})
        marker = b"transcript.text.delta"
    body = request.read()
    head = (f"POST {request.url.raw_path.decode()} HTTP/1.1\r\nHost: 127.0.0.1:{client.server.port}\r\n"
            f"Content-Type: {request.headers['content-type']}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
    writer.write(head + body)
    await writer.drain()
    seen = b""
    async with asyncio.timeout(REQUEST_TIMEOUT_S):
        while marker not in seen:
            chunk = await reader.read(65536)
            if not chunk:
                break
            seen += chunk
    status = seen.split(b"\r\n", 1)[0].decode(errors="replace")
    held = await before_drop()
    dropped_at = time.perf_counter()
    _drop(writer, how)
    return {"status_line": status, "first_frame_seen": marker in seen, "victim_held_its_slot": held,
            "ended_before_drop": b".done" in seen, "dropped_at": dropped_at}


async def _victim_realtime(client: StreamClient, item: Item, how: str, before_drop) -> dict:
    """A realtime turn whose client drops the connection once the turn is committed and holds its slot
    (``await before_drop()``: its decode is running)."""
    ws = await websockets.connect(client._realtime_url(), max_size=None, open_timeout=60)
    try:
        await client._realtime_turn(ws, MODEL_ID, item)
        seen: list[str] = []
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            async for message in ws:
                seen.append(json.loads(message)["type"])
                if seen[-1] == "input_audio_buffer.committed":
                    break
        held = await before_drop()
        dropped_at = time.perf_counter()
        if how == "reset":
            _drop(ws.transport, "reset")
        else:
            await ws.close()
    except BaseException:
        ws.transport.abort()
        raise
    return {"events_seen": seen, "first_frame_seen": "input_audio_buffer.committed" in seen,
            "victim_held_its_slot": held, "ended_before_drop": any(s.endswith(".completed") for s in seen),
            "dropped_at": dropped_at}


async def _disconnect_wave(run: Run, client: StreamClient, n: int, victim: Item, how: str,
                           serial_step_ms: float) -> tuple[dict, list[str]]:
    """``n - 1`` healthy streams and one victim that drops its connection (``how``) after its first frame:
    the victim's slot must be free within one step and the healthy answers exact. The step is measured
    under the load of the moment: the healthy streams' steps, and the victim's item streamed once whole
    just before the wave (a loaded machine's step can be several times the serial one of M1)."""
    calibration = await client.ask(MODEL_ID, victim)
    healthy_items = _pick(run.workload.items, n - 1, 2)
    healthy: list[asyncio.Task] = [asyncio.create_task(client.ask(MODEL_ID, it)) for it in healthy_items]
    await asyncio.sleep(0.05)  # the healthy streams are admitted first

    async def victim_holds_a_slot() -> bool:
        """Whether the model's busy slots reach the victim's plus one per healthy stream still running
        (looked at every 10 ms for up to 30 s): the victim holds its slot when it drops."""
        deadline = time.perf_counter() + 30
        while time.perf_counter() < deadline:
            running = sum(not t.done() for t in healthy)
            if int((await client.entry(MODEL_ID)).get("active_slots") or 0) >= 1 + running:
                return True
            await asyncio.sleep(0.01)
        return False

    if victim.route == "realtime":
        got = await _victim_realtime(client, victim, how, victim_holds_a_slot)
    else:
        got = await _victim_http(client, victim, how, victim_holds_a_slot)
    dropped_at = got.pop("dropped_at")
    freed_ms = None
    while time.perf_counter() - dropped_at < FREE_WAIT_S:
        running = sum(not t.done() for t in healthy)
        entry = await client.entry(MODEL_ID)
        if int(entry.get("active_slots") or 0) < 1 + running:
            freed_ms = round((time.perf_counter() - dropped_at) * 1000, 1)
            break
        await asyncio.sleep(0.01)
    outs: list[Outcome] = list(await asyncio.gather(*healthy))
    problems = []
    for o in outs:
        o.match = o.status == 200 and o.sha == run.references.get(o.item)
        run.log(phase=f"M4-{how}-mid-stream", count=n, item=o.item, status=o.status, sha256=o.sha, match=o.match)
        if not o.match:
            problems.append(f"{how} of {victim.name}: the healthy stream {o.item} got HTTP {o.status}"
                            f"{' with a different answer' if o.status == 200 else ''}")
    slowest = max([serial_step_ms, *calibration.steps_ms, *[s for o in outs for s in o.steps_ms]])
    bound_ms = round(STEP_FACTOR * slowest + STEP_SLACK_MS, 1)
    drained = await _drained(client)
    if not got["first_frame_seen"] or not got["victim_held_its_slot"]:
        problems.append(f"{how} of {victim.name}: the victim saw no first frame or held no slot ({got})")
    if freed_ms is None or freed_ms > bound_ms:
        problems.append(f"{how} of {victim.name}: its slot was free after {freed_ms} ms, not within one step "
                        f"({bound_ms} ms)")
    if not drained["drained"]:
        problems.append(f"{how} of {victim.name}: counters not drained: {drained}")
    return {"victim": victim.name, "route": victim.route, "how": how, **got, "slot_free_after_ms": freed_ms,
            "one_step_bound_ms": bound_ms, "victim_item_steps_just_before_ms": calibration.steps_ms,
            "victim_steps_left_ms": round(sum(calibration.steps_ms[1:]), 1),
            "healthy": [{"item": o.item, "status": o.status, "exact": o.match} for o in outs],
            "drained_after": drained}, problems


def _serial_step_ms(run: Run, name: str) -> float:
    return float(run.notes.get("serial_step_ms", {}).get(name, 0.0))


async def disconnects_free_their_slot(run: Run, client: Client, n: int) -> tuple[dict, list[str]]:
    """M4's streaming part at ``n`` slots: for each victim item of the family (``VICTIMS``) a wave whose victim
    closes its connection after its first frame and one whose victim resets it (see :func:`_disconnect_wave`)."""
    assert isinstance(client, StreamClient)
    waves, problems = [], []
    for victim in VICTIMS.get(run.workload.family, ()):
        for how in ("close", "reset"):
            ev, more = await _disconnect_wave(run, client, n, victim, how, _serial_step_ms(run, victim.name))
            waves.append(ev)
            problems += more
    return {"disconnect_mid_stream": waves}, problems


def streaming_admits_streaming_only(plan: Plan, spec: dict, record: dict) -> dict:
    """M6 of a streaming run: streaming evidence admits streaming only; PASS when every count's M4 holds
    the disconnect/reset waves (concurrent streams are M2/M3's)."""
    served = spec.get("modes", [])
    modes = {m: ("validated by this run; admits streaming only" if m == "streaming" else
                 f"NOT_APPLICABLE: the family does not serve mode {m}" if m not in served else
                 f"not validated by this run (run --mode {m})") for m in ("offline", "streaming", "batch")}
    missing = [n for n, entry in record["counts"].items()
               if not (entry["model_checks"].get("M4", {}).get("evidence") or {}).get("disconnect_mid_stream")]
    if missing:
        return check(FAIL, modes, f"no disconnect/reset waves at count(s) {', '.join(missing)}")
    if "streaming" not in served:
        return check(NOT_APPLICABLE, modes, f"family {plan.family} does not serve streaming")
    return check(PASS, modes, "streaming evidence admits streaming only (concurrent streams: M2/M3; "
                              "disconnect and reset mid-stream: M4)")


def _m1_and_note(run: Run, workdir: Path, admission_dir: Path) -> dict:
    m1 = streamed_answers_match_offline(run, workdir, admission_dir)
    run.notes["serial_step_ms"] = m1["evidence"]["serial_step_ms"]
    return m1


STREAMING = ModeChecks(StreamClient, _m1_and_note, streaming_admits_streaming_only, disconnects_free_their_slot)
"""The streaming procedure (module docstring); ``validate_slots --mode streaming`` runs with it."""
