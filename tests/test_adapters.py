"""The real model families called directly (no server): quality and segment placement."""
from __future__ import annotations

import re

import jiwer
import numpy as np
import pytest

from inference import specs
from inference.adapters import get_adapter
from inference.adapters.base import AudioRequest, InvalidInput, LoadContext

from .support.audio import adapter_session, padded


def normalise(text: str) -> str:
    """Lower-case and strip punctuation (apostrophes too: "I'm" → "im")."""
    return " ".join(re.sub(r"[^a-z0-9 ]+", "", text.lower()).split())


@pytest.fixture(scope="module")
def whisper():
    return adapter_session("whisper")


@pytest.fixture(scope="module")
def vad():
    return adapter_session("silero_vad")


def test_whisper_pooled_wer_is_at_most_20_percent(whisper, speech):
    refs, hyps = [], []
    for utt in speech:
        result = whisper.run(AudioRequest(utt.samples, 16000, specs.request_defaults("whisper")))
        refs.append(normalise(utt.text))
        hyps.append(normalise(result["text"]))
        assert result["segments"] and result["language"] == "en"
    wer = jiwer.wer(refs, hyps)
    assert wer <= 0.20, (wer, hyps)


def test_whisper_digital_silence_gives_empty_text(whisper):
    result = whisper.run(AudioRequest(np.zeros(32000, dtype=np.float32), 16000, specs.request_defaults("whisper")))
    assert result["text"] == "" and result["segments"] == []


def test_english_only_checkpoint_refuses_other_languages(whisper, speech):
    options = {**specs.request_defaults("whisper"), "language": "de"}
    with pytest.raises(InvalidInput):
        whisper.run(AudioRequest(speech[0].samples, 16000, options))


def test_vad_segments_cover_speech_and_not_the_padding(vad, speech):
    pad_s = 1.5
    for utt in speech:
        samples = padded(utt, pad_s)
        result = vad.run(AudioRequest(samples, 16000, specs.request_defaults("silero_vad")))
        segments = result["segments"]
        assert segments, utt.name
        # Where the fixture's own speech lies: first/last sample above -40 dBFS.
        loud = np.flatnonzero(np.abs(utt.samples) > 0.01)
        speech_start = int(pad_s * 16000) + loud[0]
        speech_end = int(pad_s * 16000) + loud[-1]
        assert segments[0]["start"] >= int(pad_s * 16000) - 0.1 * 16000  # no segment deep in the leading silence
        assert segments[-1]["end"] <= int(pad_s * 16000) + len(utt.samples) + 0.1 * 16000
        covered = sum(min(s["end"], speech_end) - max(s["start"], speech_start)
                      for s in segments if s["end"] > speech_start and s["start"] < speech_end)
        assert covered >= 0.8 * (speech_end - speech_start), (utt.name, segments)
        for s in segments:
            assert s["start_s"] == round(s["start"] / 16000, 3) and 0.5 <= s["probability"] <= 1


def test_vad_silence_gives_no_segments(vad):
    result = vad.run(AudioRequest(np.zeros(48000, dtype=np.float32), 16000, specs.request_defaults("silero_vad")))
    assert result["segments"] == [] and result["duration"] == 3.0


# -- piper (speech synthesis) ---------------------------------------------------------------------
PIPER_TEXT = "The quick brown fox jumps over the lazy dog. It was a sunny day."


@pytest.fixture(scope="module")
def piper_pair():
    """One shared voice (one InferenceSession) and two slots over it."""
    family = "piper"
    ctx = LoadContext(specs.resolve_checkpoint(family, None), "cpu", 0, 1, {}, {})
    adapter = get_adapter(family)
    shared = adapter.load(specs.get_spec(family), ctx)
    return shared, adapter.new_session(shared, 0), adapter.new_session(shared, 1)


def piper_options(**extra) -> dict:
    return {**specs.request_defaults("piper"), **extra}


def test_piper_graph_has_no_random_nodes_left_and_takes_a_seed(piper_pair):
    shared, _a, _b = piper_pair
    assert "seed" in {i.name for i in shared.session.get_inputs()}
    assert shared.sample_rate_hz == 22050 and shared.num_speakers == 1 and shared.language == "en_US"


def test_piper_a_seed_gives_identical_samples_whatever_ran_before_or_beside(piper_pair):
    from concurrent.futures import ThreadPoolExecutor

    from inference.adapters.base import TextRequest

    _shared, a, b = piper_pair
    first = a.run(TextRequest(PIPER_TEXT, piper_options(seed=7)))
    assert first["sentences"] == 2 and first["sample_rate"] == 22050 and first["samples"].dtype == np.float32
    b.run(TextRequest("Something else entirely.", piper_options(seed=8)))  # advances no hidden generator
    again = b.run(TextRequest(PIPER_TEXT, piper_options(seed=7)))
    assert np.array_equal(first["samples"], again["samples"])
    with ThreadPoolExecutor(2) as pool:  # two slots at once on the one shared session
        together = list(pool.map(lambda s: s.run(TextRequest(PIPER_TEXT, piper_options(seed=7)))["samples"], [a, b]))
    assert all(np.array_equal(first["samples"], t) for t in together)
    other = a.run(TextRequest(PIPER_TEXT, piper_options(seed=9)))["samples"]
    assert not np.array_equal(first["samples"][: len(other)], other[: len(first["samples"])])


def test_piper_speed_scales_the_duration_and_streams_per_sentence(piper_pair):
    from inference.adapters.base import TextRequest

    _shared, a, _b = piper_pair
    normal = a.run(TextRequest(PIPER_TEXT, piper_options(seed=1)))["samples"].size
    for speed in (0.5, 2.0, 4.0):
        stretched = a.run(TextRequest(PIPER_TEXT, piper_options(seed=1, speed=speed)))["samples"].size
        assert stretched / normal == pytest.approx(1 / speed, rel=0.03)
    sentences = list(a.stream(TextRequest(PIPER_TEXT, piper_options(seed=1, sentence_silence_s=0.25))))
    assert len(sentences) == 2 and all(s.samples.size > 22050 // 2 for s in sentences)
    assert not sentences[0].samples[-int(0.25 * 22050):].any(), "sentence silence is appended"


def test_piper_refuses_text_without_phonemes_and_unknown_speakers(piper_pair):
    from inference.adapters.base import TextRequest

    _shared, a, _b = piper_pair
    with pytest.raises(InvalidInput) as nothing:
        list(a.stream(TextRequest("...", piper_options())))
    assert nothing.value.param == "input"
    with pytest.raises(InvalidInput) as speaker:
        list(a.stream(TextRequest("Hello.", piper_options(speaker=3))))
    assert speaker.value.param == "speaker"
