"""The browser UI in a real browser: Playwright driving Debian's Chromium (``/usr/bin/chromium``)
against a ``serve --parallel-jobs`` stack with ``ui_management`` on (Redis db 9, fixture family).

Named actors: ``operator`` (a user with ``registry.manage_models`` and a password), ``viewer`` (a user
without it), and an anonymous visitor (``ui_anonymous`` = ``status``, the default). Screenshots of the
dashboard and the playground go to ``$AUDIOSITE_ARTIFACTS`` (default ``var/artifacts/ui``).
"""
from __future__ import annotations

import os
import re
import socket
from pathlib import Path
import threading
import time

import httpx
import pytest
from django.test import RequestFactory

from audiosite.errors import InvalidRequest
from ui import views as ui_views

from .support.bounds import MODEL_S, QUICK_S
from .support.browser import PASSWORD, chromium, launch, make_users, open_page, shoot
from .support.clients import body
from .support.processes import ROOT
from .support.stacks import FIXTURE_ENV, entry_of, events_of, run_stack

pytestmark = pytest.mark.stack

playwright_api = pytest.importorskip("playwright.sync_api")
chromium()

SAMPLE = ROOT / "samples" / "librispeech_test_clean_6930-75918-0000.wav"
LIVE_S = 10.0  # bound of a wait for a live update (the target is 500 ms; this only bounds a failure)

UI_MODELS = [
    {"id": "fx-ui", "family": "fixture", "slots": 2},
    {"id": "fx-gone", "family": "fixture"},
    {"id": "whisper-tiny.en", "family": "whisper", "slots": 1, "lazy": True},
    {"id": "silero-vad", "family": "silero_vad", "lazy": True},
    {"id": "piper-joe", "family": "piper", "lazy": True, "default_voice_preset": "alloy",
     "voice_presets": {"alloy": {"voice": "joe"}, "nova": {"voice": "joe", "options": {"sentence_silence_s": 0.2}}}},
    {"id": "emb", "family": "speaker_embedding", "lazy": True},
    {"id": "bp", "family": "basic_pitch", "lazy": True},
    {"id": "diar", "family": "diarization", "lazy": True,
     "load_options": {"vad_model": "silero-vad", "embedding_model": "emb"}},
]


@pytest.fixture(scope="module")
def ustack(tmp_path_factory):
    yield from run_stack(tmp_path_factory.mktemp("ustack"), UI_MODELS, redis_db=9, name="ui", parallel=True,
                         extra_env=FIXTURE_ENV, extra_config={"ui_management": True})


@pytest.fixture(scope="module")
def users(ustack) -> dict[str, str]:
    """``operator`` (may manage) and ``viewer`` (may not), both with :data:`PASSWORD`."""
    return make_users(ustack)


@pytest.fixture(scope="module")
def playwright():
    with playwright_api.sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright):
    chromium_browser = launch(playwright)
    yield chromium_browser
    chromium_browser.close()


def _page(browser, stack, user: str | None = None):
    return open_page(browser, stack, user)


def _menu(page, model_id: str):
    """Open the row menu of ``model_id`` (its manage actions); returns the row."""
    row = page.locator(f'tr[data-model="{model_id}"]')
    page.get_by_role("button", name=f"Manage {model_id}", exact=True).click()
    playwright_api.expect(row.locator("[popover]")).to_be_visible()
    return row


def _open_dashboard(page):
    page.goto("/ui/")
    playwright_api.expect(page.locator("#live-state")).to_have_text("live", timeout=LIVE_S * 1000)


def _cell(page, model_id: str, field: str):
    return page.locator(f'tr[data-model="{model_id}"] [data-field="{field}"]')


def _shoot(page, name: str) -> None:
    """A screenshot at 1280 px wide (``docs/images/ui-<name>-in-use-1280.png`` with ``AUDIOSITE_DOC_IMAGES=1``)."""
    page.set_viewport_size({"width": 1280, "height": 800})
    page.wait_for_timeout(300)
    shoot(page, f"ui-{name}-in-use-1280", docs=os.environ.get("AUDIOSITE_DOC_IMAGES") == "1")


def _as_configured(stack, model_id: str) -> None:
    """Put ``model_id`` back in the state the module's configuration starts it in (loaded unless lazy),
    whatever the module's earlier tests did to it."""
    lazy = next(m for m in UI_MODELS if m["id"] == model_id).get("lazy", False)
    done = stack.manage("unload_model" if lazy else "load_models", model_id)
    assert done.returncode == 0, done.stderr


def test_the_dashboard_lists_the_models_and_the_root_redirects(ustack, browser):
    _as_configured(ustack, "fx-ui")
    _as_configured(ustack, "whisper-tiny.en")
    page = _page(browser, ustack)
    page.goto("/")
    assert page.url.endswith("/ui/")
    playwright_api.expect(page.locator("#live-state")).to_have_text("live", timeout=LIVE_S * 1000)
    rows = page.locator("#models tbody tr")
    assert sorted(rows.evaluate_all("rows => rows.map(r => r.dataset.model)")) == sorted(m["id"] for m in UI_MODELS)
    playwright_api.expect(_cell(page, "fx-ui", "state")).to_have_text("ready")
    playwright_api.expect(_cell(page, "fx-ui", "slots")).to_have_text("2")
    playwright_api.expect(_cell(page, "whisper-tiny.en", "state")).to_have_text("unloaded")
    assert page.locator("form.act").count() == 0  # anonymous: status only
    with ustack.client() as c:
        health = c.get("/health").json()
    assert health["ui"] is True and health["ui_management"] is True
    page.context.close()


def test_an_in_flight_request_shows_one_active_slot_then_none_without_a_reload(ustack, browser):
    page = _page(browser, ustack)
    _open_dashboard(page)
    playwright_api.expect(_cell(page, "fx-ui", "active_slots")).to_have_text("0")
    page.evaluate("window.__loads = performance.getEntriesByType('navigation').length")
    answers: list[httpx.Response] = []

    def request() -> None:
        with ustack.client() as c:
            answers.append(c.post("/v1/tasks/run", json=body("fx-ui", barrier="ui-run")))

    sender = threading.Thread(target=request)
    sender.start()
    ustack.wait_arrived("ui-run")
    playwright_api.expect(_cell(page, "fx-ui", "active_slots")).to_have_text("1", timeout=LIVE_S * 1000)
    released_at = time.monotonic()
    ustack.release("ui-run")
    playwright_api.expect(_cell(page, "fx-ui", "active_slots")).to_have_text("0", timeout=LIVE_S * 1000)
    print(f"release -> page shows 0 active slots: {(time.monotonic() - released_at) * 1000:.0f} ms")
    sender.join(MODEL_S)
    assert [a.status_code for a in answers] == [200]
    assert page.evaluate("performance.getEntriesByType('navigation').length") == 1  # never reloaded
    page.context.close()


def test_unload_from_the_page_changes_the_state_live_and_writes_an_audit_row(ustack, browser, users):
    _as_configured(ustack, "fx-gone")
    page = _page(browser, ustack, "operator")
    _open_dashboard(page)
    playwright_api.expect(_cell(page, "fx-gone", "state")).to_have_text("ready")
    dialogs: list[str] = []

    def accept(dialog) -> None:
        dialogs.append(dialog.message)
        dialog.accept()

    page.on("dialog", accept)
    _menu(page, "fx-gone")
    page.get_by_role("button", name="Unload fx-gone").click()
    playwright_api.expect(_cell(page, "fx-gone", "state")).to_have_text("unloaded", timeout=LIVE_S * 1000)
    assert dialogs and "fx-gone" in dialogs[0]
    row = page.locator('tr[data-model="fx-gone"]')
    playwright_api.expect(row.locator("output.msg")).to_have_text("fx-gone: loaded=false")
    assert ("unload", "ok", "operator") in events_of(ustack, "fx-gone")
    page.context.close()


def test_the_dashboard_shows_the_slot_counts_a_resize_may_ask_for(ustack, browser, users):
    """silero_vad advertises 16 slots but the CPU admission table admits 1..4: the row says 1..4, the count
    a resize error names, not 16."""
    page = _page(browser, ustack, "operator")
    _open_dashboard(page)
    playwright_api.expect(_cell(page, "silero-vad", "admitted_slots")).to_have_text("1..4")
    page.goto("/ui/models/silero-vad")
    playwright_api.expect(page.locator('#status [data-field="admitted_slots"]')).to_have_text("4")
    page.context.close()


def test_load_from_the_page_keeps_the_voice_presets(ustack, browser, users):
    """R4.4: the dashboard's Load button is a plain load of the registration as it is: the lazy model is
    loaded now, with no reconfigure, the voice presets (and every other key) unchanged."""
    def presets() -> set[str]:
        with ustack.client() as c:
            return {v["id"] for v in c.get("/v1/audio/voices", params={"model": "piper-joe"}).json()["voices"]}
    def reconfigures() -> int:
        return sum(1 for event in events_of(ustack, "piper-joe") if event[0] == "reconfigure")
    before, reconfigured = presets(), reconfigures()
    assert {"alloy", "nova"} <= before
    page = _page(browser, ustack, "operator")
    _open_dashboard(page)
    row = _menu(page, "piper-joe")
    page.get_by_role("button", name="Load piper-joe", exact=True).click()  # loads the real Piper voice
    playwright_api.expect(row.locator("output.msg")).to_contain_text("piper-joe", timeout=MODEL_S * 1000)
    assert "error" not in (row.locator("output.msg").get_attribute("class") or "")
    assert presets() == before
    assert reconfigures() == reconfigured
    assert entry_of(ustack, "piper-joe")["state"] == "ready"
    page.context.close()


def test_the_model_pages_configuration_form_changes_only_the_keys_it_sends(ustack, browser, users):
    """R4.4 from the model page: the entry edited in its form (here only ``default_voice_preset``) is
    applied to the registration, every other key (the voice presets) kept; a bad value shows the 400."""
    page = _page(browser, ustack, "operator")
    page.goto("/ui/models/piper-joe")
    form = page.locator("#configure")
    form.locator("textarea").fill('{"default_voice_preset": "nova"}')
    form.get_by_role("button", name="Save and load").click()
    playwright_api.expect(form.locator("output.msg")).to_contain_text("piper-joe: reconfigured",
                                                                      timeout=LIVE_S * 1000)
    with ustack.client() as c:
        voices = c.get("/v1/audio/voices", params={"model": "piper-joe"}).json()["voices"]
    assert {"alloy", "nova"} <= {v["id"] for v in voices}
    assert ("reconfigure", "ok", "operator") in events_of(ustack, "piper-joe")
    form.locator("textarea").fill('{"default_voice_preset": "nobody"}')
    form.get_by_role("button", name="Save and load").click()
    playwright_api.expect(form.locator("output.msg")).to_contain_text("400", timeout=LIVE_S * 1000)
    form.locator("textarea").fill('{"default_voice_preset": "alloy"}')  # back as the module's stack had it
    form.get_by_role("button", name="Save and load").click()
    playwright_api.expect(form.locator("output.msg")).to_contain_text("reconfigured", timeout=LIVE_S * 1000)
    page.context.close()


def test_a_resize_to_an_unsupported_count_shows_the_400_and_keeps_the_old_count(ustack, browser, users):
    page = _page(browser, ustack, "operator")
    _open_dashboard(page)
    row = _menu(page, "whisper-tiny.en")
    row.get_by_label("slots of whisper-tiny.en").fill("8")
    row.get_by_role("button", name="Resize whisper-tiny.en").click()
    message = row.locator("output.msg")
    playwright_api.expect(message).to_contain_text("400 invalid_request_error")
    playwright_api.expect(message).to_contain_text("capacity=4")
    playwright_api.expect(_cell(page, "whisper-tiny.en", "slots")).to_have_text("1")
    with ustack.client() as c:
        assert c.get("/v1/models/whisper-tiny.en").json()["slots"] == 1
    page.context.close()


def test_a_user_without_the_permission_sees_no_controls_and_a_forged_post_gets_403(ustack, browser, users):
    _as_configured(ustack, "fx-ui")
    page = _page(browser, ustack, "viewer")
    _open_dashboard(page)
    playwright_api.expect(_cell(page, "fx-ui", "state")).to_have_text("ready")
    assert page.locator("form.act").count() == 0
    assert page.get_by_role("button", name=re.compile("Unload|Resize|Register")).count() == 0
    forged = page.evaluate("""async () => {
        const token = document.cookie.split('; ').find(c => c.startsWith('csrftoken=')).split('=')[1];
        const form = new FormData();
        form.append('csrfmiddlewaretoken', token);
        const r = await fetch('/ui/manage/fx-ui/unload', {method: 'POST', body: form});
        return [r.status, await r.json()];
    }""")
    assert forged[0] == 403 and forged[1]["error"]["type"] == "forbidden"
    assert "manage_models" in forged[1]["error"]["message"]
    with ustack.client() as c:  # and without the page's CSRF token, Django refuses before the view
        assert c.post("/ui/manage/fx-ui/unload", data={}).status_code == 403
        assert c.get("/v1/models/fx-ui").json()["state"] == "ready"
    page.context.close()


def test_the_lifecycle_log_shows_new_rows_live(ustack, browser, users):
    page = _page(browser, ustack, "operator")
    page.goto("/ui/log?model=fx-ui")
    playwright_api.expect(page.locator("#live-state")).to_have_text("live", timeout=LIVE_S * 1000)
    before = page.locator("#log tbody tr").count()
    assert before == len(events_of(ustack, "fx-ui"))
    done = ustack.manage("unload_model", "fx-ui")
    assert done.returncode == 0, done.stderr
    rows = events_of(ustack, "fx-ui")
    assert len(rows) > before and rows[-1][:2] == ("unload", "ok")
    # Every row written since the page loaded appears at the top, without a reload.
    playwright_api.expect(page.locator("#log tbody tr")).to_have_count(len(rows), timeout=LIVE_S * 1000)
    playwright_api.expect(page.locator("#log tbody tr").first).to_contain_text("unload")
    assert page.evaluate("performance.getEntriesByType('navigation').length") == 1
    page.context.close()


def test_the_playground_transcribes_with_words_finds_speech_and_speaks(ustack, browser):
    """Transcription of a file with its words highlighted in turn while the audio plays; voice activity
    over the waveform; speech the browser decodes."""
    page = _page(browser, ustack)
    page.goto("/ui/playground")
    page.locator("#asr-model").select_option("whisper-tiny.en")
    page.get_by_label("Audio file").first.set_input_files(str(SAMPLE))
    with page.expect_response("**/v1/audio/transcriptions") as answer:
        page.get_by_role("button", name="Transcribe file").click()
    assert answer.value.status == 200
    playwright_api.expect(page.locator("#asr-text")).to_contain_text(
        re.compile("concorde returned to its place amidst the tents", re.I), timeout=MODEL_S * 1000)
    words = page.locator("#asr-words span")
    assert words.count() >= 7
    page.evaluate("document.getElementById('asr-audio').play()")
    highlighted = set()
    for _ in range(40):  # the sample is 3.5 s: the highlighted word moves along
        highlighted.update(page.locator("#asr-words span.now").all_text_contents())
        page.wait_for_timeout(100)
    assert len(highlighted) >= 3, highlighted
    page.get_by_role("button", name="Use the shipped sample").click()
    playwright_api.expect(page.locator("#vad-status")).to_contain_text("segment(s) of speech",
                                                                      timeout=MODEL_S * 1000)
    assert page.locator("#vad-segments li").count() >= 1
    playwright_api.expect(page.locator("#tts-voice option")).not_to_have_count(0)
    page.get_by_role("button", name="Speak", exact=True).click()
    playwright_api.expect(page.locator("#tts-status")).to_have_text("ready", timeout=MODEL_S * 1000)
    duration_s = page.evaluate("""() => new Promise((resolve) => {
        const audio = document.getElementById('tts-audio');
        if (audio.readyState >= 1) resolve(audio.duration); else audio.onloadedmetadata = () => resolve(audio.duration);
    })""")
    assert 1.0 < duration_s < 20.0  # the browser decoded the synthesized WAV: seconds of speech
    page.context.close()


def test_the_playground_compares_speakers_transcribes_music_and_diarizes(ustack, browser):
    """The two shipped readers compared (cosine similarity of their embeddings), a melody made in the page
    transcribed to its notes (piano roll, a MIDI file to download), the two readers one after the other
    diarized into turns over the waveform."""
    page = _page(browser, ustack)
    page.goto("/ui/playground")
    page.get_by_role("button", name="Compare the two shipped samples").click()
    playwright_api.expect(page.locator("#emb-status")).to_contain_text("dimensional embeddings",
                                                                      timeout=MODEL_S * 1000)
    score = float(page.locator("#emb-score").text_content())
    assert -1.0 <= score < 0.9  # two different readers: far from the same voice print
    page.get_by_role("button", name="Use a melody made in the page").click()
    playwright_api.expect(page.locator("#music-status")).to_contain_text("C4 E4 G4 C5 G4 E4 C4",
                                                                        timeout=MODEL_S * 1000)
    with page.expect_download() as download:
        page.get_by_role("link", name="Download the MIDI file").click()
    assert Path(download.value.path()).read_bytes()[:4] == b"MThd"
    page.get_by_role("button", name="Use the two shipped samples, one after the other").click()
    playwright_api.expect(page.locator("#diar-status")).to_contain_text("turn(s)", timeout=MODEL_S * 1000)
    turns = page.locator("#diar-turns li").all_text_contents()
    assert turns and all(t.startswith("SPEAKER_") for t in turns)
    page.locator("#asr-model").select_option("whisper-tiny.en")  # the other panels too, for the screenshot
    page.get_by_role("button", name="Transcribe the shipped sample").click()
    page.get_by_role("button", name="Use the shipped sample").click()
    playwright_api.expect(page.locator("#asr-status")).to_contain_text("done in", timeout=MODEL_S * 1000)
    playwright_api.expect(page.locator("#vad-status")).to_contain_text("segment(s)", timeout=MODEL_S * 1000)
    _shoot(page, "playground")
    page.context.close()


def test_the_microphone_streams_through_realtime_with_deltas_shown_as_they_arrive(ustack, playwright):
    """Chromium's fake microphone plays the shipped sample in a loop: the page streams it through
    ``/v1/realtime``; deltas show before the turn's final text, which is the sample's sentence."""
    microphone_browser = launch(playwright, microphone_wav=SAMPLE)
    try:
        page = _page(microphone_browser, ustack)
        sockets: list[str] = []
        page.on("websocket", lambda ws: sockets.append(ws.url))
        page.goto("/ui/playground")
        page.locator("#asr-model").select_option("whisper-tiny.en")
        page.evaluate("""() => { window.__deltas = [];
            window.addEventListener('live-delta', (e) => window.__deltas.push([performance.now(), e.detail])); }""")
        page.get_by_role("button", name="Start live transcription").click()
        playwright_api.expect(page.locator("#live-text")).to_contain_text(
            re.compile("concorde returned to its place", re.I), timeout=MODEL_S * 1000)
        page.get_by_role("button", name="Stop live transcription").click()
        playwright_api.expect(page.locator("#live-status")).to_have_text("stopped")
        assert any("/v1/realtime?intent=transcription&model=whisper-tiny.en" in url for url in sockets), sockets
        deltas = page.evaluate("window.__deltas")
        assert deltas, "no delta arrived"
        page.context.close()
    finally:
        microphone_browser.close()


def test_queued_requests_show_live_and_the_dashboard_screenshot(ustack, browser, users):
    """Three held requests on a two-slot model: the page shows 2 active and 1 queued, then 0 and 0."""
    page = _page(browser, ustack, "operator")
    _open_dashboard(page)
    answers: list[int] = []

    def request() -> None:
        with ustack.client() as c:
            answers.append(c.post("/v1/tasks/run", json=body("fx-ui", barrier="shot")).status_code)

    senders = [threading.Thread(target=request) for _ in range(3)]
    for sender in senders:
        sender.start()
    ustack.wait_arrived("shot", 2)
    playwright_api.expect(_cell(page, "fx-ui", "active_slots")).to_have_text("2", timeout=LIVE_S * 1000)
    playwright_api.expect(_cell(page, "fx-ui", "queued_requests")).to_have_text("1", timeout=LIVE_S * 1000)
    for _ in range(2):  # let them go one by one: steps on the timeline (and the screenshot shows them)
        page.wait_for_timeout(2000)
        ustack.release("shot")
    page.wait_for_timeout(2000)
    playwright_api.expect(_cell(page, "fx-ui", "active_slots")).to_have_text("1", timeout=LIVE_S * 1000)
    _shoot(page, "dashboard")
    ustack.release("shot")
    playwright_api.expect(_cell(page, "fx-ui", "queued_requests")).to_have_text("0", timeout=LIVE_S * 1000)
    playwright_api.expect(_cell(page, "fx-ui", "active_slots")).to_have_text("0", timeout=LIVE_S * 1000)
    for sender in senders:
        sender.join(MODEL_S)
    assert answers == [200, 200, 200]
    page.context.close()



def test_register_unload_selected_and_unregister_from_the_page(ustack, browser, users):
    """Register with the form (the row appears live), tick it and unload selected, unregister it
    (the row goes away live); each step is in the audit log with the operator as actor. The
    model's page shows its configuration, lifecycle events and request count."""
    page = _page(browser, ustack, "operator")
    _open_dashboard(page)
    page.on("dialog", lambda dialog: dialog.accept())
    page.get_by_text("Register a model").click()
    form = page.locator("#register")
    form.get_by_label("Id").fill("fx-new")
    form.get_by_label("Family").select_option("fixture")
    form.get_by_label("Slots").fill("2")
    form.get_by_role("button", name="Register and load").click()
    playwright_api.expect(form.locator("output.msg")).to_have_text("fx-new: loaded=true, reconfigured=false")
    playwright_api.expect(_cell(page, "fx-new", "state")).to_have_text("ready", timeout=LIVE_S * 1000)
    with ustack.client() as c:
        assert c.post("/v1/tasks/run", json=body("fx-new")).status_code == 200
    page.get_by_label("select fx-new").check()
    page.get_by_role("button", name="Unload selected").click()
    playwright_api.expect(page.locator("#bulk output.msg")).to_have_text("unloaded: fx-new")
    playwright_api.expect(_cell(page, "fx-new", "state")).to_have_text("unloaded", timeout=LIVE_S * 1000)
    detail = page.context.new_page()
    detail.goto("/ui/models/fx-new")
    playwright_api.expect(detail.locator("#config")).to_contain_text('"slots": 2')
    playwright_api.expect(detail.get_by_text("1 request(s) served since registration")).to_be_visible()
    playwright_api.expect(detail.locator("#log tbody tr").first).to_contain_text("unload")
    detail.close()
    _menu(page, "fx-new")
    page.get_by_role("button", name="Unregister fx-new").click()
    playwright_api.expect(page.locator('tr[data-model="fx-new"]')).to_have_count(0, timeout=LIVE_S * 1000)
    events = events_of(ustack, "fx-new")
    assert ("register", "ok", "operator") in events and ("unload", "ok", "operator") in events
    assert events[-1][0] == "unregister" and events[-1][2] == "operator"
    page.context.close()

# -- configuration: "ui": false, "ui_anonymous": "none" (no browser needed) ----------------------------
def _handshake(stack, path: str, origin: str | None = None, cookie: str | None = None) -> int:
    """The HTTP status a WebSocket handshake to ``path`` gets (101 accepted; 403/404 refused)."""
    host = stack.url.rsplit("//", 1)[1]
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}", "Upgrade: websocket", "Connection: Upgrade",
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13"]
    if origin:
        lines.append(f"Origin: {origin}")
    if cookie:
        lines.append(f"Cookie: {cookie}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode()
    host_name, port = host.split(":")
    with socket.create_connection((host_name, int(port)), timeout=QUICK_S) as sock:
        sock.sendall(head)
        answer = sock.recv(4096)
    return int(answer.split(b" ", 2)[1])


def test_ui_off_answers_404_everywhere_and_health_says_so(tmp_path):
    for stack in run_stack(tmp_path, [{"id": "fx", "family": "fixture"}], redis_db=8, name="uioff",
                           extra_env=FIXTURE_ENV, extra_config={"ui": False}):
        with stack.client(follow_redirects=False) as c:
            assert c.get("/health").json()["ui"] is False
            for path in ("/", "/ui/", "/ui/playground", "/ui/log", "/ui/sample.wav", "/ui/login/"):
                assert c.get(path).status_code == 404, path
            assert c.get("/v1/models/fx").status_code == 200  # the API is not the UI
        assert _handshake(stack, "/ui/ws/status", origin=stack.url) == 403


def test_ui_anonymous_none_sends_visitors_to_the_login_page(tmp_path):
    """Legacy runtime too: the dashboard works without slot configuration (slots read 1)."""
    for stack in run_stack(tmp_path, [{"id": "fx", "family": "fixture"}], redis_db=8, name="uianon",
                           extra_env=FIXTURE_ENV, extra_config={"ui_anonymous": "none"}):
        with stack.client(follow_redirects=False) as c:
            for path in ("/ui/", "/ui/playground", "/ui/log", "/ui/models/fx"):
                resp = c.get(path)
                assert resp.status_code == 302 and resp.headers["location"].startswith("/ui/login/?next="), path
            assert c.get("/ui/login/").status_code == 200
            assert c.post("/ui/manage/fx/unload").status_code == 403  # no CSRF token, no session
        assert _handshake(stack, "/ui/ws/status", origin=stack.url) == 403  # anonymous: refused
        done = stack.manage("shell", "--no-imports", "-c", (
            "from django.contrib.auth.models import User\n"
            f"User.objects.create_user('watcher', password={PASSWORD!r})\n"))
        assert done.returncode == 0, done.stderr
        with stack.client(follow_redirects=False) as c:
            login = c.get("/ui/login/")
            token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', login.text).group(1)
            resp = c.post("/ui/login/", data={"username": "watcher", "password": PASSWORD,
                                              "csrfmiddlewaretoken": token}, headers={"Referer": stack.url})
            assert resp.status_code == 302
            page = c.get("/ui/")
            assert page.status_code == 200 and 'id="initial-board"' in page.text
            assert "Unload selected" not in page.text  # ui_management off: status only
            cookie = "; ".join(f"{k}={v}" for k, v in c.cookies.items())
        assert _handshake(stack, "/ui/ws/status", origin=stack.url, cookie=cookie) == 101
        assert _handshake(stack, "/ui/ws/status", origin="http://evil.example", cookie=cookie) == 403


@pytest.mark.parametrize("raw", ["--2", "²", "³2", "١", "1e3", " 2 2", "9" * 13])
def test_a_form_integer_that_is_not_plain_ascii_digits_is_a_400_not_a_500(raw):
    """``'--2'`` or ``'²'`` can pass a naive digit check and then make ``int()`` raise (a 500);
    ``'١'`` (an Arabic-Indic one) can be taken as 1. Only ``-?[0-9]{1,12}`` is an
    integer here; anything else is the API's 400 naming the field."""
    request = RequestFactory().post("/ui/manage/x/resize", data={"slots": raw})
    with pytest.raises(InvalidRequest) as refused:
        ui_views._int_field(request, "slots")
    assert refused.value.param == "slots" and refused.value.status == 400


def test_a_form_integer_of_ascii_digits_is_read():
    request = RequestFactory().post("/ui/manage/x/resize", data={"slots": " 4 ", "busy_timeout_ms": "-1"})
    assert ui_views._int_field(request, "slots") == 4 and ui_views._int_field(request, "busy_timeout_ms") == -1
    assert ui_views._int_field(request, "absent") is None


def test_the_model_page_manages_its_model_and_charts_the_last_hour(ustack, browser, users):
    """From ``/ui/models/<id>``: resize (a count past the admitted ones is the 400 with ``capacity=4``),
    unload, load, the admitted counts per mode, the last error and its retry time, the chart of the
    last hour's queue wait and run time (the requests just served are counted), and unregister, which
    returns to the dashboard."""
    page = _page(browser, ustack, "operator")
    page.on("dialog", lambda dialog: dialog.accept())
    page.goto("/ui/")
    page.get_by_text("Register a model").click()
    form = page.locator("#register")
    form.get_by_label("Id").fill("fx-page")
    form.get_by_label("Family").select_option("fixture")
    form.get_by_role("button", name="Register and load").click()
    playwright_api.expect(form.locator("output.msg")).to_contain_text("fx-page: loaded=true")
    with ustack.client() as c:
        for _ in range(3):
            assert c.post("/v1/tasks/run", json=body("fx-page")).status_code == 200
    page.goto("/ui/models/fx-page")
    playwright_api.expect(page.locator("#live-state")).to_have_text("live", timeout=LIVE_S * 1000)
    playwright_api.expect(page.locator("#admitted-by-mode")).to_contain_text("offline: 1..")
    playwright_api.expect(page.locator("#timing-summary")).to_contain_text("run time: 3 request(s)")
    playwright_api.expect(page.locator("#timing-summary")).to_contain_text("queue wait: 3 request(s)")
    manage = page.locator("#manage")
    manage.get_by_label("Slots").fill("5")  # within the input's range, past the admitted 1..4
    manage.get_by_role("button", name="Resize").click()
    playwright_api.expect(manage.locator("output.msg")).to_contain_text("400")
    manage.get_by_label("Slots").fill("2")
    manage.get_by_role("button", name="Resize").click()
    playwright_api.expect(manage.locator("output.msg")).to_contain_text("fx-page: reconfigured")
    playwright_api.expect(page.locator('#status [data-field="slots"]')).to_have_text("2", timeout=LIVE_S * 1000)
    manage.get_by_role("button", name="Unload", exact=True).click()
    playwright_api.expect(page.locator('#status [data-field="state"]')).to_have_text("unloaded", timeout=LIVE_S * 1000)
    manage.get_by_role("button", name="Load", exact=True).click()
    playwright_api.expect(page.locator('#status [data-field="state"]')).to_have_text("ready", timeout=LIVE_S * 1000)
    playwright_api.expect(page.locator("#log tbody tr").first).to_contain_text("load")
    playwright_api.expect(page.locator('#status [data-field="last_error"]')).to_have_text("none")
    playwright_api.expect(page.locator('#status [data-field="retry_at"]')).to_have_text("–")
    manage.get_by_role("button", name="Unregister").click()
    page.wait_for_url(re.compile(r"/ui/$"))
    playwright_api.expect(page.locator('tr[data-model="fx-page"]')).to_have_count(0, timeout=LIVE_S * 1000)
    assert events_of(ustack, "fx-page")[-1][0] == "unregister"
    page.context.close()


def test_a_failed_load_shows_its_error_and_retry_time_on_the_model_page(ustack, browser, users):
    """A registration whose load fails (the fixture's ``fail_load``): the form shows the error, the
    dashboard row the error, the model page the error and ``retry_at`` (the end of the backoff)."""
    page = _page(browser, ustack, "operator")
    page.on("dialog", lambda dialog: dialog.accept())
    _open_dashboard(page)
    page.get_by_text("Register a model").click()
    form = page.locator("#register")
    form.get_by_label("Id").fill("fx-broken")
    form.get_by_label("Family").select_option("fixture")
    form.get_by_label("Load options (JSON; the spec's defaults shown)").fill('{"fail_load": true}')
    form.get_by_role("button", name="Register and load").click()
    playwright_api.expect(form.locator("output.msg")).to_have_class(re.compile("error"), timeout=LIVE_S * 1000)
    playwright_api.expect(_cell(page, "fx-broken", "last_error")).to_contain_text("injected load failure",
                                                                                  timeout=LIVE_S * 1000)
    page.goto("/ui/models/fx-broken")
    playwright_api.expect(page.locator("#live-state")).to_have_text("live", timeout=LIVE_S * 1000)
    playwright_api.expect(page.locator('#status [data-field="last_error"]')).to_contain_text("injected load failure")
    retry_at = page.locator('#status [data-field="retry_at"]').text_content()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", retry_at.strip()), retry_at
    page.locator("#manage").get_by_role("button", name="Unregister").click()
    page.wait_for_url(re.compile(r"/ui/$"))
    page.context.close()
