"""The activity view (``/ui/activity``) in Debian's Chromium: the last answered requests, live over the
status socket, filtered by model and outcome, without any request body.

The time from an answer to its row in the page is printed (the issue's target is 200 ms; a row is
written with the metrics batch at most ``metrics.ACTIVITY_FLUSH_S`` = 30 ms after the answer, then
published and forwarded at once). It is measured on one clock: the test's ``time.time()`` when the
answer arrived, the page's ``performance.timeOrigin + performance.now()`` when the row was added.
"""
from __future__ import annotations

import json
import statistics
import time

import pytest

from inference.runtime.context import KEYS

from .support.browser import chromium, launch, make_users, open_page
from .support.clients import body
from .support.stacks import FIXTURE_ENV, run_stack

pytestmark = pytest.mark.stack

playwright_api = pytest.importorskip("playwright.sync_api")
chromium()

LIVE_S = 10.0  # bound of a wait for a live row (the target is 200 ms; this only bounds a failure)
SAMPLES = 12
MODELS = [{"id": "fx-act", "family": "fixture", "slots": 1}, {"id": "fx-other", "family": "fixture"}]
SECRET = "never-kept-0b5e2c"

WATCH_ROWS_JS = """() => {
  window.__rows = [];
  window.addEventListener('activity-row', (e) => {
    window.__rows.push({at_ms: performance.timeOrigin + performance.now(), row: e.detail});
  });
}"""


@pytest.fixture(scope="module")
def astack(tmp_path_factory):
    yield from run_stack(tmp_path_factory.mktemp("astack"), MODELS, redis_db=9, name="uiactivity", parallel=True,
                         extra_env=FIXTURE_ENV)


@pytest.fixture(scope="module")
def users(astack) -> dict[str, str]:
    return make_users(astack)


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        chromium_browser = launch(p)
        yield chromium_browser
        chromium_browser.close()


def _wait_written(stack, newest: int) -> None:
    """Wait until the ``newest`` answers are in the activity list (written with the metrics batch, 30 ms)."""
    deadline = time.monotonic() + LIVE_S
    while time.monotonic() < deadline:
        rows = [json.loads(r) for r in stack.redis.lrange(KEYS.activity, 0, newest - 1)]
        if len(rows) == newest and rows[0]["model"] == "":
            return
        time.sleep(0.05)
    raise AssertionError(f"the last {newest} answers were not written to the activity list in {LIVE_S} s")


def _open_activity(page, query: str = "") -> None:
    page.goto(f"/ui/activity{query}")
    playwright_api.expect(page.locator("#live-state")).to_have_text("live", timeout=LIVE_S * 1000)
    page.evaluate(WATCH_ROWS_JS)


def test_an_answered_request_shows_in_the_activity_view_live(astack, users, browser):
    page = open_page(browser, astack, "operator")
    _open_activity(page)
    delays_ms = []
    with astack.client() as c:
        for n in range(SAMPLES):
            answer = c.post("/v1/tasks/run", json=body("fx-act"))
            answered_at_ms = time.time() * 1000
            assert answer.status_code == 200
            page.wait_for_function(f"window.__rows.length >= {n + 1}", timeout=LIVE_S * 1000)
            shown = page.evaluate(f"window.__rows[{n}]")
            delays_ms.append(shown["at_ms"] - answered_at_ms)
            page.wait_for_timeout(150)  # apart, so each answer starts a batch of its own (the worst case)
    print(f"answer -> activity row in the page over {SAMPLES} requests: median {statistics.median(delays_ms):.0f} ms, "
          f"max {max(delays_ms):.0f} ms, min {min(delays_ms):.0f} ms")
    row = page.locator("#activity tbody tr").first
    playwright_api.expect(row).to_contain_text("fx-act")
    playwright_api.expect(row).to_contain_text("/v1/tasks/run")
    playwright_api.expect(row).to_contain_text("ok 200")
    last = page.evaluate(f"window.__rows[{SAMPLES - 1}].row")
    assert last["model"] == "fx-act" and last["status"] == 200 and last["outcome"] == "ok"
    assert last["queue_ms"] is not None and last["queue_ms"] >= 0
    assert last["run_ms"] is not None and last["run_ms"] >= 0
    assert last["total_ms"] >= last["run_ms"]
    assert last["client"] == "127.0.0.1"
    assert page.evaluate("performance.getEntriesByType('navigation').length") == 1  # never reloaded
    page.context.close()


def test_the_activity_view_filters_by_model_and_outcome(astack, users, browser):
    page = open_page(browser, astack, "operator")
    with astack.client() as c:
        assert c.post("/v1/tasks/run", json=body("fx-other")).status_code == 200
        assert c.post("/v1/tasks/run", json=body("no-such-model")).status_code == 404
    _wait_written(astack, 2)
    _open_activity(page, "?model=fx-other")
    rows = page.locator("#activity tbody tr:not([hidden])")
    playwright_api.expect(rows.first).to_contain_text("fx-other")
    assert set(rows.evaluate_all("rows => rows.map(r => r.dataset.model)")) == {"fx-other"}
    with astack.client() as c:  # a live row of another model arrives hidden under the filter
        assert c.post("/v1/tasks/run", json=body("fx-act")).status_code == 200
    page.wait_for_function("window.__rows.length >= 1", timeout=LIVE_S * 1000)
    assert page.locator('#activity tbody tr[data-model="fx-act"]').first.is_hidden()
    page.locator("#filter-model").select_option("")
    page.locator("#filter-outcome").select_option("client_error")
    assert page.url.endswith("?outcome=client_error")
    outcomes = rows.evaluate_all("rows => rows.map(r => r.dataset.outcome)")
    assert outcomes and set(outcomes) == {"client_error"}
    playwright_api.expect(rows.first).to_contain_text("404")
    page.locator("#filter-outcome").select_option("")
    assert rows.count() == page.locator("#activity tbody tr").count()
    page.context.close()


def test_no_request_body_is_kept_and_visitors_see_no_activity(astack, users, browser):
    """A request's text is in no activity row (Redis list or page); a visitor who is not logged in is
    sent to the login page and gets no activity message on the status socket."""
    visitor = open_page(browser, astack)
    frames: list[str] = []
    visitor.on("websocket", lambda ws: ws.on("framereceived", lambda payload: frames.append(str(payload))))
    visitor.goto("/ui/")
    playwright_api.expect(visitor.locator("#live-state")).to_have_text("live", timeout=LIVE_S * 1000)
    with astack.client() as c:
        assert c.post("/v1/tasks/run", json=body("fx-act", note=SECRET)).status_code in (200, 400)
        assert c.post("/v1/tasks/run", json=body("fx-act")).status_code == 200
    stored = astack.redis.lrange(KEYS.activity, 0, -1)
    assert stored and all(SECRET not in row for row in stored)
    assert {"at", "model", "route", "status", "outcome", "code", "queue_ms", "run_ms", "total_ms", "client",
            "user"} == set(json.loads(stored[0]))
    operator = open_page(browser, astack, "operator")
    _open_activity(operator)
    assert SECRET not in operator.content()
    operator.context.close()
    visitor.wait_for_timeout(500)
    assert frames and not any('"activity"' in frame for frame in frames)
    visitor.goto("/ui/activity")
    assert "/ui/login/" in visitor.url
    visitor.context.close()
