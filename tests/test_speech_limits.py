"""Bounds of one speech request (family ``piper``): long sentences are cut at a phoneme budget, the
work of a request is capped before synthesis, options stay in their ranges on both routes, and the
worst input the limits allow keeps the worker's memory and time under the bounds in
docs/operations.md ("Limits on input", speech).

One parallel-runtime stack (PostgreSQL, Redis db 4, daphne + one Celery worker) serves the real
en_US-joe-medium voice with one slot.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
import socket
import threading
import time

import httpx
import psutil
import pytest

from inference.adapters import piper

from .support.bounds import MODEL_S, QUICK_S
from .support.stacks import Stack, run_stack, web_pid, worker_pid

RATE = 22050
MODELS = [{"id": "piper", "family": "piper", "task": "tts", "slots": 1}]
WRITE_TIMEOUT_MS = 3000  # stream_write_timeout_ms of the stack (default 30 s)

# Bounds stated in docs/operations.md: the worker's RSS grows by at most WORKER_GROWTH_BOUND_MB during one
# request, whatever the input within the limits; the request ends within its time bound.
WORKER_GROWTH_BOUND_MB = 600
PROSE = "the quick brown fox jumps over the lazy dog and "
CJK = "中文语音合成测试"


def prose_at_work_limit(length_scale: float, speed: float) -> str:
    """The longest prose without a full stop whose estimated work stays within ``MAX_SPEECH_WORK_S``."""
    opts = {"length_scale": length_scale, "speed": speed, "sentence_silence_s": 0.0}
    words = PROSE.split()
    text = ""
    for n in range(1, 4096):
        longer = " ".join(words[i % len(words)] for i in range(n))
        if piper.speech_work_s(piper.phonemize(longer, "en-us"), opts) > piper.MAX_SPEECH_WORK_S:
            return text
        text = longer
    raise AssertionError("the work limit was never reached")


@pytest.fixture(scope="module")
def tts(tmp_path_factory) -> Iterator[Stack]:
    yield from run_stack(tmp_path_factory.mktemp("tts_limits"), MODELS, redis_db=4, name="tts_limits",
                         parallel=True, extra_config={"stream_write_timeout_ms": WRITE_TIMEOUT_MS})


def test_a_sentence_over_the_phoneme_budget_is_cut_at_word_boundaries_and_a_short_one_is_not():
    sentence = piper.phonemize((PROSE * 20).strip(), "en-us")[0]
    assert len(sentence) > 4 * piper.PHONEMES_PER_RUN
    pieces = piper.split_phonemes(sentence, piper.PHONEMES_PER_RUN)
    assert all(1 <= len(p) <= piper.PHONEMES_PER_RUN for p in pieces)
    assert all(p[0] != " " and p[-1] != " " for p in pieces), "cuts fall on the spaces between words"
    assert " ".join("".join(p) for p in pieces) == "".join(sentence).strip()
    short = piper.phonemize("The quick brown fox jumps over the lazy dog.", "en-us")[0]
    assert piper.split_phonemes(short, piper.PHONEMES_PER_RUN) == [short]
    with_pause = piper.phonemize("one two three four five six seven, eight nine ten eleven twelve", "en-us")[0]
    first = piper.split_phonemes(with_pause, len(with_pause) - 3)[0]
    assert first[-1] == ",", "a cut prefers the pause over the last word boundary"
    word = list("x" * 25)
    assert piper.split_phonemes(word, 10) == [word[:10], word[10:20], word[20:]], "a word over the budget is cut"
    assert piper.phonemes_per_run(10) == piper.PHONEMES_PER_RUN // 10
    assert piper.phonemes_per_run(0.5) == piper.PHONEMES_PER_RUN


class PeakRss:
    """Samples the RSS of a process and its children every 20 ms in a thread; ``peak_mb`` is the largest sum."""

    def __init__(self, pid: int):
        self.process = psutil.Process(pid)
        self.peak_mb = self.base_mb = self._now_mb()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _now_mb(self) -> float:
        total = 0
        for proc in [self.process, *self.process.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total / 2**20

    def _sample(self) -> None:
        while not self._done.wait(0.02):
            self.peak_mb = max(self.peak_mb, self._now_mb())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


WORST = [
    ("cjk_4096_characters", lambda: (CJK * 512)[:4096], {}, 400),
    ("prose_of_4096_characters_without_a_full_stop", lambda: (PROSE * 100)[:4096].strip(), {}, 150),
    ("slowest_pace_at_the_work_limit", lambda: prose_at_work_limit(10.0, 0.25),
     {"length_scale": 10.0, "speed": 0.25}, 200),
]


@pytest.mark.parametrize(("text_of", "options", "time_bound_s"), [w[1:] for w in WORST], ids=[w[0] for w in WORST])
def test_the_worst_allowed_speech_keeps_the_worker_under_its_memory_and_time_bounds(tts, text_of, options,
                                                                                     time_bound_s):
    """The worst input the limits allow (4,096 characters that make one long espeak sentence, or the
    slowest pace at the work limit) is synthesised whole while the worker's RSS grows by less than
    WORKER_GROWTH_BOUND_MB (before the phoneme budget: +5.4 GB for the prose, +9 GB for the CJK)."""
    text = text_of()
    with tts.client(timeout=MODEL_S) as client:  # warm: the voice loaded, espeak and the graph's arena set up
        assert client.post("/v1/tasks/run", json={"model": "piper", "request": {"text": "Warm up."}}).status_code == 200
    with PeakRss(worker_pid(tts)) as rss:
        started = time.monotonic()
        with tts.client(timeout=time_bound_s) as client:
            try:
                answer = client.post("/v1/tasks/run", json={"model": "piper", "request": {
                    "text": text, "options": {"seed": 1, **options}}})
            except httpx.HTTPError as exc:
                raise AssertionError(f"no answer ({exc!r}); serve's log:\n{tts.log_tail(120)}") from exc
        elapsed_s = time.monotonic() - started
    assert answer.status_code == 200, answer.text
    result = answer.json()
    growth_mb = rss.peak_mb - rss.base_mb
    print(f"{len(text)} characters, {options}: {result['duration']:.0f} s of speech in {result['sentences']} pieces "
          f"in {elapsed_s:.1f} s, "
          f"worker {rss.base_mb:.0f} MB → peak {rss.peak_mb:.0f} MB (+{growth_mb:.0f} MB)")
    assert growth_mb < WORKER_GROWTH_BOUND_MB
    assert elapsed_s < time_bound_s
    tts.wait_idle("piper", timeout_s=10)


@pytest.mark.parametrize("route", ["speech", "tasks"])
def test_too_much_speech_for_one_request_is_a_400_before_synthesis_and_frees_the_slot(tts, route):
    """4,096 characters of prose at length_scale 10 (about 2,400 s of speech), or of CJK at speed 0.25
    (about 5,200 s) are over MAX_SPEECH_WORK_S: a 400 naming ``input`` before any audio, on both
    routes, and the slot is free again."""
    with tts.client(timeout=MODEL_S) as client:
        if route == "tasks":
            answer = client.post("/v1/tasks/run", json={"model": "piper", "request": {
                "text": (PROSE * 100)[:4096], "options": {"length_scale": 10}}})
        else:
            answer = client.post("/v1/audio/speech", json={"model": "piper", "input": (CJK * 512)[:4096],
                                                            "speed": 0.25})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "input"
    assert "1800 s" in error["message"]
    tts.wait_idle("piper", timeout_s=10)


OUT_OF_RANGE = [("length_scale", 10.5), ("length_scale", 0), ("noise_scale", 2.5), ("noise_w", -0.1),
                ("sentence_silence_s", 5.5), ("speed", 0.2), ("speed", 4.5), ("speaker", -1)]


@pytest.mark.parametrize(("option", "value"), OUT_OF_RANGE, ids=[f"{o}={v}" for o, v in OUT_OF_RANGE])
def test_an_option_out_of_its_range_is_a_400_through_tasks_run(tts, option, value):
    with tts.client() as client:
        answer = client.post("/v1/tasks/run", json={"model": "piper", "request": {
            "text": "Hello there.", "options": {option: value}}})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == f"request.options.{option}"


@pytest.mark.parametrize("speed", [0.2, 4.5])
def test_a_speed_out_of_its_range_is_a_400_through_the_speech_route(tts, speed):
    with tts.client() as client:
        answer = client.post("/v1/audio/speech", json={"model": "piper", "input": "Hello there.", "speed": speed})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "speed"


def test_a_client_that_never_reads_a_speech_stream_is_dropped_and_holds_little_web_memory(tts):
    """A client that opens a long speech stream (about 12 min of PCM, 30 MB, at speed 0.25) and never
    reads it: the web process's RSS grows by less than 12 MB while the stream is blocked, the server
    drops the connection after ``stream_write_timeout_ms`` without reads, and the lease is released
    (R8.3); the client gets far less than the whole body. Before the write gate daphne buffered the
    whole body for as long as the client stayed connected."""
    text = " ".join(f"This is sentence number {i} of a long story that nobody will hear to its end."
                    for i in range(50))
    body = json.dumps({"model": "piper", "input": text, "response_format": "pcm", "speed": 0.25, "seed": 4})
    host, port = tts.url.rsplit("//", 1)[1].split(":")
    web = psutil.Process(web_pid(tts))
    with tts.client() as client:  # warm: the voice loaded, the web's encoder path imported
        assert client.post("/v1/audio/speech", json={"model": "piper", "input": "Warm up.",
                                                     "response_format": "pcm"}).status_code == 200
    base_mb = peak_mb = web.memory_info().rss / 2**20
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(QUICK_S)
    try:
        sock.connect((host, int(port)))
        sock.sendall((f"POST /v1/audio/speech HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        started = time.monotonic()
        leased = False
        while time.monotonic() - started < 2 * MODEL_S:
            peak_mb = max(peak_mb, web.memory_info().rss / 2**20)
            leases = tts.counters("piper")["leases"]
            leased = leased or leases == 1
            if leased and leases == 0:
                break
            time.sleep(0.05)
        freed_after_s = time.monotonic() - started
        received, closed = 0, False
        try:
            while chunk := sock.recv(1 << 16):
                received += len(chunk)
            closed = True
        except ConnectionResetError:
            closed = True
        except TimeoutError:
            pass  # still open: the server kept the connection (and its buffer)
    finally:
        sock.close()
    growth_mb = peak_mb - base_mb
    print(f"web {base_mb:.0f} MB → peak {peak_mb:.0f} MB (+{growth_mb:.1f} MB); lease free after "
          f"{freed_after_s:.1f} s; the client got {received} bytes")
    assert leased, "the stream took the slot"
    assert tts.counters("piper")["leases"] == 0, f"the lease was still held after {freed_after_s:.0f} s"
    assert closed, f"the server kept the connection open after sending {received} bytes"
    assert received < 15 * 2**20, "the connection was dropped long before the whole body (about 30 MB)"
    assert growth_mb < 12
    tts.wait_idle("piper", timeout_s=10)
