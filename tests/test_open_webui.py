"""Open WebUI's audio settings (STT and TTS engine "OpenAI" pointed at audiosite), proven by replaying the
requests Open WebUI itself sends (``backend/open_webui/routers/audio.py``), byte for byte where it matters:

- STT (``transcription_handler``, engine ``openai``): ``requests.post(f"{STT_OPENAI_API_BASE_URL}/audio/
  transcriptions", headers={"Authorization": f"Bearer {STT_OPENAI_API_KEY}"}, files={"file": (filename,
  fh)}, data={"model": STT_MODEL[, "language": language]})``: a multipart body (form fields first, the file
  part without a Content-Type of its own), the upload saved as ``<uuid>.<ext>`` (a browser's webm
  recording converted to mp3 first). With a language it retries without one when the first answer is
  not 200.
- TTS (``speech``, engine ``openai``): ``aiohttp`` POST of ``{"input", "voice", "model": TTS_MODEL,
  **TTS_OPENAI_PARAMS}`` as JSON to ``/audio/speech`` with ``Content-Type: application/json`` and
  ``Authorization: Bearer``; no ``response_format`` (the reply is cached as ``.mp3``).
- Listing (``get_available_models`` / ``get_available_voices``, for a base URL that is not OpenAI's):
  ``requests.get(f"{base}/audio/models")`` → ``{"models": [{"id", ...}]}`` and
  ``requests.get(f"{base}/audio/voices")`` → ``{"voices": [{"id", "name"}]}``, without credentials.

Defaults of Open WebUI's settings page: STT model ``whisper-1``, TTS model ``tts-1``, voice ``alloy``.
"""
from __future__ import annotations

import binascii
import io
import json
import os
import uuid
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import soundfile

from .support.audio import decode_speech, words
from .support.bounds import MODEL_S
from .support.stacks import Stack, run_stack

pytestmark = pytest.mark.stack

KEY = "sk-open-webui-key"  # Open WebUI always sends its configured key; audiosite's inference routes are open
PRESETS = {name: {"voice": "joe"} for name in ("alloy", "echo", "fable", "onyx", "nova", "shimmer")}
MODELS: list[dict] = [
    {"id": "whisper", "family": "whisper", "task": "asr"},
    {"id": "piper-joe", "family": "piper", "task": "tts", "voice_presets": PRESETS},
]
REQUESTS_HEADERS = {"User-Agent": "python-requests/2.32.5", "Accept-Encoding": "gzip, deflate", "Accept": "*/*",
                    "Connection": "keep-alive"}
AIOHTTP_HEADERS = {"User-Agent": "Python/3.12 aiohttp/3.12.15", "Accept": "*/*", "Accept-Encoding": "gzip, deflate"}


@pytest.fixture(scope="module")
def webui_stack(tmp_path_factory) -> Iterator[Stack]:
    yield from run_stack(tmp_path_factory.mktemp("openwebui"), MODELS, redis_db=2, name="openwebui")


def requests_multipart(fields: dict[str, str], file_field: str, filename: str, data: bytes) -> tuple[bytes, str]:
    """The body and Content-Type ``requests`` builds for ``files={file_field: (filename, fh)}, data=fields``
    (urllib3's ``encode_multipart_formdata``: data fields first, then the file; a 2-tuple file gets no
    part Content-Type; a 32-hex-digit boundary)."""
    boundary = binascii.hexlify(os.urandom(16)).decode()
    parts = []
    for name, value in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
                     + value.encode() + b"\r\n")
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{file_field}"; filename="{filename}"'
                 "\r\n\r\n".encode() + data + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def open_webui_stt(client: httpx.Client, audio: bytes, ext: str, model: str = "whisper-1",
                   language: str | None = None) -> httpx.Response:
    """Open WebUI's ``transcription_handler`` (engine openai) against ``client``'s base URL + ``/v1``: the
    language loop ``[language, None]`` ends at the first 200."""
    filename = f"{uuid.uuid4()}.{ext}"
    resp = None
    for lang in ([language, None] if language else [None]):
        fields = {"model": model, **({"language": lang} if lang else {})}
        body, content_type = requests_multipart(fields, "file", filename, audio)
        resp = client.post("/v1/audio/transcriptions", content=body,
                           headers={**REQUESTS_HEADERS, "Authorization": f"Bearer {KEY}",
                                    "Content-Type": content_type})
        if resp.status_code == 200:
            break
    assert resp is not None
    return resp


def open_webui_tts(client: httpx.Client, text: str, voice: str = "alloy", model: str = "tts-1",
                   params: dict | None = None) -> httpx.Response:
    """Open WebUI's ``speech`` (engine openai): the browser's ``{input, voice, model}``, ``model`` set to
    TTS_MODEL, then TTS_OPENAI_PARAMS merged in; aiohttp's ``json=`` encoding (``json.dumps``)."""
    payload = {"input": text, "voice": voice, "model": "tts-1"}
    payload["model"] = model
    payload = {**payload, **(params or {})}
    return client.post("/v1/audio/speech", content=json.dumps(payload).encode(),
                       headers={**AIOHTTP_HEADERS, "Content-Type": "application/json",
                                "Authorization": f"Bearer {KEY}"})


def as_mp3(wav: bytes) -> bytes:
    """The fixture as Open WebUI forwards a browser recording: converted to mp3."""
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format="MP3")
    return out.getvalue()


def test_open_webui_speech_to_text_gets_the_same_text_as_the_transcription_route(webui_stack, speech):
    """Open WebUI's STT call (model ``whisper-1``, multipart as ``requests`` sends it, Bearer key) answers
    200 with ``text`` equal to ``/v1/audio/transcriptions`` on the default ASR model, for a wav upload, an
    mp3 (a browser recording after Open WebUI's conversion), and with a language (``en``)."""
    utt = speech[0]
    with webui_stack.client() as client:
        own = client.post("/v1/audio/transcriptions", data={"model": "whisper"},
                          files={"file": ("a.wav", utt.wav)})
        assert own.status_code == 200, own.text
        replay = open_webui_stt(client, utt.wav, "wav")
        assert replay.status_code == 200, replay.text
        assert replay.json()["text"] == own.json()["text"]
        assert words(replay.json()["text"]) and words(utt.text).split()[0] in words(replay.json()["text"])
        mp3 = as_mp3(utt.wav)
        own_mp3 = client.post("/v1/audio/transcriptions", data={"model": "whisper"}, files={"file": ("a.mp3", mp3)})
        replay_mp3 = open_webui_stt(client, mp3, "mp3", language="en")
        assert replay_mp3.status_code == 200, replay_mp3.text
        assert replay_mp3.json()["text"] == own_mp3.json()["text"]
    webui_stack.wait_idle("whisper")


def test_open_webui_text_to_speech_answers_mp3_speech_for_its_default_voice(webui_stack):
    """Open WebUI's TTS call (``tts-1``, voice ``alloy``, no ``response_format``) answers 200 with an mp3
    that decodes to about as long speech as the model's own voice gives, and Whisper hears the words."""
    text = "The quick brown fox jumps over the lazy dog."
    with webui_stack.client() as client:
        resp = open_webui_tts(client, text)
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"].startswith("audio/mpeg")
        decoded = decode_speech(resp.content, "mp3")
        assert decoded.channels == 1 and decoded.rate == 22050
        assert 1.0 < len(decoded.samples) / decoded.rate < 6.0
        assert float(np.sqrt(np.mean(decoded.samples ** 2))) > 0.01
        heard = client.post("/v1/audio/transcriptions", data={"model": "whisper", "language": "en"},
                            files={"file": ("s.mp3", resp.content)})
        assert {"quick", "brown", "fox"} <= set(words(heard.json()["text"]).split()), heard.text
        for voice in PRESETS:  # every voice Open WebUI offers when it cannot list ours
            assert open_webui_tts(client, "Hello.", voice=voice).status_code == 200, voice
        with_params = open_webui_tts(client, "Hello.", model="tts-1-hd", params={"speed": 1.2})
        assert with_params.status_code == 200, with_params.text
    webui_stack.wait_idle("piper-joe")


def test_open_webui_lists_our_speech_models_and_voices(webui_stack):
    """Open WebUI's settings page fills its TTS model and voice boxes from ``GET {base}/audio/models``
    (``{"models": [{"id"}]}``) and ``GET {base}/audio/voices`` (``{"voices": [{"id", "name"}]}``), sent
    without credentials: the speech model, its OpenAI names, and every voice and preset are offered."""
    with httpx.Client(base_url=webui_stack.url, timeout=MODEL_S, headers=REQUESTS_HEADERS) as client:
        models = client.get("/v1/audio/models")
        assert models.status_code == 200, models.text
        ids = [m["id"] for m in models.json()["models"]]
        assert {"piper-joe", "tts-1", "tts-1-hd", "gpt-4o-mini-tts"} <= set(ids)
        assert "whisper" not in ids and "whisper-1" not in ids  # speech synthesis models only
        voices = client.get("/v1/audio/voices")
        assert voices.status_code == 200, voices.text
        offered = {voice["id"]: voice["name"] for voice in voices.json()["voices"]}
        assert {"joe", *PRESETS} <= set(offered)
