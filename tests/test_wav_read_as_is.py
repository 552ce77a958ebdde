"""The WAV read on the event loop (``inference.audio.plain_pcm16_wav``,
``read_pcm16_as_is``; ``inference.runtime.decoding.read_as_is``/``samples_as_is``).

The promise: a WAV that takes the as-is path gets the same header, the same int16 samples and the same
refusals (class and words) as the libsndfile path it replaced, and every other failure is an ``AudioError``
(so the HTTP answer is the 4xx libsndfile's path gave, never a 500). Each file below passed the first version
of ``plain_pcm16_wav`` (at most 4 chunks, fmt 16 bytes tag 1 mono 16-bit 16 kHz, data last and ending at EOF)
and was answered otherwise than by libsndfile; the check now takes only ``fmt `` then ``data`` with exact
sizes, and these files go to libsndfile.
"""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import soundfile

from inference import audio

from .support.audio import FIXTURES, riff_wave, wav_bytes, wav_fmt
from .support.bounds import MODEL_S, run, within
from .support.clients import mclient, without_timing
from .support.stacks import run_stack

RATE = 16000
_PCM = (np.arange(1000) * 37 % 65536 - 32768).astype(np.int16)


def _wav(*chunks: tuple[bytes, bytes], pcm: bytes = _PCM.tobytes(), riff_size: int | None = None) -> bytes:
    """``chunks``, then the data chunk holding ``pcm`` at EOF (:func:`riff_wave`)."""
    return riff_wave(*chunks, (b"data", pcm), riff_size=riff_size)


# RIFF size field smaller than the chunks it holds (libsndfile ignores it: it reads the whole file).
RIFF_SIZE_LIES = {
    "fmt18_riff_ends_inside_fmt": _wav((b"fmt ", wav_fmt(extra=b"\0\0")), riff_size=4 + 8 + 16),
    "list_then_fmt_riff_ends_inside_list": _wav((b"LIST", b"INFO"), (b"fmt ", wav_fmt()), riff_size=4 + 8),
}

# Chunks libsndfile parses and refuses (or misreads), which the as-is path skips unread.
LIBSNDFILE_PARSES = {
    "peak_before_fmt": _wav((b"PEAK", b"\0" * 16), (b"fmt ", wav_fmt())),
    "short_fact": _wav((b"fmt ", wav_fmt()), (b"fact", b"\0\0")),
    "short_smpl": _wav((b"fmt ", wav_fmt()), (b"smpl", b"\0" * 8)),
    "non_printable_chunk_id": _wav((b"\x01\x02\x03\x04", b"\0" * 4), (b"fmt ", wav_fmt())),
    "short_acid_after_fmt": _wav((b"fmt ", wav_fmt()), (b"acid", b"\0" * 12)),
}


def _libsndfile(data: bytes):
    """What the libsndfile path answers: ("ok", header, int16 samples) or ("refused", class, message)."""
    try:
        header = audio.read_header(data, 1800.0)
        samples, _ = audio.decode(data, RATE, 1800.0, None, True)
    except audio.AudioError as exc:
        return "refused", type(exc).__name__, str(exc)
    return "ok", header, samples.tobytes()


def _as_is(data: bytes):
    """What the as-is path answers, in the same shape; None when it leaves the file to libsndfile."""
    try:
        found = audio.read_pcm16_as_is(data, RATE, 1800.0, 1 << 20, lambda header: True)
    except audio.AudioError as exc:
        return "refused", type(exc).__name__, str(exc)
    if found is None:
        return None
    header, samples = found
    return "ok", header, samples.tobytes()


@pytest.mark.parametrize("name", sorted(RIFF_SIZE_LIES))
def test_a_riff_size_field_too_small_is_not_an_internal_error(name):
    """A RIFF size field that ends inside a chunk: libsndfile reads the file anyway. Such a file is not in
    the as-is layout and goes to libsndfile (Python's wave module raises a bare RuntimeError here)."""
    data = RIFF_SIZE_LIES[name]
    assert _libsndfile(data)[0] == "ok"
    found = _as_is(data)
    assert found is None or found == _libsndfile(data)


@pytest.mark.parametrize("name", sorted(LIBSNDFILE_PARSES))
def test_a_file_read_as_is_gets_libsndfile_s_answer(name):
    """The as-is path must answer what libsndfile answers for the same bytes (header, samples, refusal and
    its words), or leave the file to libsndfile (None). It skips chunks libsndfile parses: a PEAK chunk
    before fmt, a fact or smpl chunk shorter than libsndfile reads, a chunk id of non-printable bytes are
    415 there and 200 here; a 12-byte acid chunk (libsndfile reads 24) gives libsndfile 992 frames, 1000 here."""
    data = LIBSNDFILE_PARSES[name]
    found = _as_is(data)
    assert found is None or found == _libsndfile(data), (found and found[:2], _libsndfile(data)[:2])


# -- the same over HTTP --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vstack(tmp_path_factory):
    yield from run_stack(tmp_path_factory.mktemp("as-is-wav"), [{"id": "vad", "family": "silero_vad", "slots": 1}],
                         redis_db=9, name="as_is_wav", parallel=True)


def _speech_pcm() -> np.ndarray:
    path = sorted(FIXTURES.glob("*.wav"))[0]
    samples, rate = soundfile.read(io.BytesIO(path.read_bytes()), dtype="int16")
    assert rate == RATE
    return samples[: RATE * 3]


async def _run(c, data: bytes):
    return await within(c.post("/v1/tasks/run", json={
        "model": "vad", "request": {"audio_base64": base64.b64encode(data).decode()}}), MODEL_S)


@pytest.mark.stack
def test_over_http_a_riff_size_lie_is_answered_like_the_same_samples_as_flac(vstack):
    """A WAV with a RIFF size too small (fmt 18 bytes) is read by libsndfile; /v1/tasks/run must answer it
    as it answers the same samples in FLAC (an as-is reader raising RuntimeError would give a 500)."""
    pcm = _speech_pcm()
    lying = _wav((b"fmt ", wav_fmt(extra=b"\0\0")), pcm=pcm.tobytes(), riff_size=4 + 8 + 16)
    flac = wav_bytes(pcm, RATE, "FLAC", "PCM_16")

    async def scenario():
        async with mclient(vstack, None, timeout=MODEL_S) as c:
            reference = await _run(c, flac)
            assert reference.status_code == 200, reference.text
            resp = await _run(c, lying)
            assert resp.status_code == 200, (resp.status_code, resp.text[:300])
            assert without_timing(resp) == without_timing(reference)
            again = await _run(c, flac)  # nothing left held
            assert again.status_code == 200, again.text

    run(scenario())


@pytest.mark.stack
def test_over_http_a_peak_chunk_before_fmt_is_refused_as_libsndfile_refuses_it(vstack):
    """libsndfile refuses a PEAK chunk before fmt (415); the as-is path serves it."""
    data = _wav((b"PEAK", b"\0" * 16), (b"fmt ", wav_fmt()), pcm=_speech_pcm().tobytes())
    expected = _libsndfile(data)
    assert expected[0] == "refused" and expected[1] == "UndecodableAudio"

    async def scenario():
        async with mclient(vstack, None, timeout=MODEL_S) as c:
            resp = await _run(c, data)
            assert resp.status_code == 415, (resp.status_code, resp.text[:300])
            error = resp.json()["error"]
            assert error["param"] == "request.audio_base64", error

    run(scenario())
