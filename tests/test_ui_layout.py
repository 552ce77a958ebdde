"""The UI on a laptop screen and on a desktop: every page at 1024, 1280, 1440 and 1920 px wide in Debian's
Chromium, checked for what sticks out, what cannot be reached, and axe-core's serious violations (light and
dark theme), with the screenshots of every page at 1280 and 1920 px (``docs/images/`` with
``AUDIOSITE_DOC_IMAGES=1``, else ``$AUDIOSITE_ARTIFACTS/ui``).

From 1280 px up nothing scrolls sideways and every model's name, state, counts, timeline and actions are
inside the window; at 1024 px only a table may scroll, inside its own frame, and everything is reachable
by scrolling it. Rows are compact (at most :data:`ROW_MAX_PX` tall).
"""
from __future__ import annotations

import os

import pytest

from .support.browser import WIDTHS, axe_violations, chromium, launch, layout_problems, make_users, open_page, shoot
from .support.clients import body
from .support.stacks import FIXTURE_ENV, run_stack

pytestmark = pytest.mark.stack

playwright_api = pytest.importorskip("playwright.sync_api")
chromium()

LIVE_S = 10.0
ROW_MAX_PX = 64
"""Tallest a model row may be (px): two lines of text (name, family · task) and the padding."""
DOC_IMAGES = os.environ.get("AUDIOSITE_DOC_IMAGES") == "1"

MODELS = [
    {"id": "fx-a", "family": "fixture", "slots": 2},
    {"id": "fx-with-a-rather-long-model-name-v2", "family": "fixture"},
    {"id": "whisper-tiny.en", "family": "whisper", "slots": 1, "lazy": True},
    {"id": "silero-vad", "family": "silero_vad", "lazy": True},
    {"id": "piper-joe", "family": "piper", "lazy": True, "default_voice_preset": "alloy",
     "voice_presets": {"alloy": {"voice": "joe"}}},
]
PAGES = {"dashboard": "/ui/", "activity": "/ui/activity", "log": "/ui/log", "model": "/ui/models/fx-a",
         "playground": "/ui/playground"}
ROW_PARTS = ("link", "state", "active_slots", "queued_requests", "timeline", "menu-button")


@pytest.fixture(scope="module")
def lstack(tmp_path_factory):
    yield from run_stack(tmp_path_factory.mktemp("lstack"), MODELS, redis_db=9, name="uilayout", parallel=True,
                         extra_env=FIXTURE_ENV, extra_config={"ui_management": True})


@pytest.fixture(scope="module")
def users(lstack) -> dict[str, str]:
    made = make_users(lstack)
    with lstack.client() as c:  # some activity: two answers and a 404, so the activity page has rows
        for model in ("fx-a", "fx-a", "no-such-model"):
            c.post("/v1/tasks/run", json=body(model))
    return made


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        chromium_browser = launch(p)
        yield chromium_browser
        chromium_browser.close()


def _open(page, path: str) -> None:
    page.goto(path)
    playwright_api.expect(page.locator("#live-state")).to_have_text("live", timeout=LIVE_S * 1000)
    page.wait_for_timeout(300)  # the first status message drawn


def _inside(box: dict | None, width: int, height: int | None = None) -> bool:
    if box is None:
        return False
    fits_x = box["x"] >= 0 and box["x"] + box["width"] <= width + 0.5
    return fits_x and (height is None or (box["y"] >= 0 and box["y"] + box["height"] <= height + 0.5))


@pytest.mark.parametrize("width", WIDTHS)
def test_every_models_status_and_actions_are_on_screen_at(width, lstack, users, browser):
    page = open_page(browser, lstack, "operator", width=width, height=800)
    _open(page, "/ui/")
    rows = page.locator("#models tbody tr")
    playwright_api.expect(rows).to_have_count(len(MODELS))
    wrap = page.locator(".table-wrap").first
    if width >= 1280:  # nothing scrolls: every part is in the window as the page opens
        assert wrap.evaluate("w => w.scrollWidth <= w.clientWidth + 1"), "the table scrolls in its frame"
    for model in MODELS:
        row = page.locator(f'tr[data-model="{model["id"]}"]')
        assert row.bounding_box()["height"] <= ROW_MAX_PX, (model["id"], row.bounding_box())
        for part in ROW_PARTS:
            element = row.locator(f'[data-field="{part}"]')
            if width < 1280:
                element.scroll_into_view_if_needed()
            assert element.is_visible(), (model["id"], part)
            assert _inside(element.bounding_box(), width), (width, model["id"], part, element.bounding_box())
        wrap.evaluate("w => { w.scrollLeft = 0; }")
    assert layout_problems(page, (".table-wrap",) if width < 1280 else ()) == []
    for model in (MODELS[0], MODELS[-1]):  # a row menu opens inside the window, its controls usable
        button = page.get_by_role("button", name=f"Manage {model['id']}", exact=True)
        button.scroll_into_view_if_needed()
        button.click()
        menu = page.locator(f'tr[data-model="{model["id"]}"] [popover]')
        playwright_api.expect(menu).to_be_visible()
        assert _inside(menu.bounding_box(), width, 800), menu.bounding_box()
        for action in ("Resize", "Load", "Unload", "Unregister"):
            control = menu.get_by_role("button", name=f"{action} {model['id']}", exact=True)
            assert _inside(control.bounding_box(), width, 800), action
        page.keyboard.press("Escape")
        playwright_api.expect(menu).to_be_hidden()
    page.context.close()


@pytest.mark.parametrize("width", WIDTHS)
def test_every_page_fits_the_window_at(width, lstack, users, browser):
    page = open_page(browser, lstack, "operator", width=width, height=800)
    for name, path in PAGES.items():
        _open(page, path)
        problems = layout_problems(page, (".table-wrap",) if width < 1280 else ())
        assert problems == [], (name, problems)
        if width in (1280, 1920):
            shoot(page, f"ui-{name}-{width}", docs=DOC_IMAGES)
    page.context.close()


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_axe_core_finds_no_serious_violation_on_any_page(scheme, lstack, users, browser):
    page = open_page(browser, lstack, "operator", width=1280, height=800, color_scheme=scheme)
    found = {}
    for name, path in PAGES.items():
        _open(page, path)
        if name == "dashboard":  # the row menu and the register form open, so their controls are checked too
            page.get_by_role("button", name="Manage fx-a", exact=True).click()
            found[f"{name} (menu open)"] = axe_violations(page)
            page.keyboard.press("Escape")
            page.get_by_text("Register a model").click()
        found[name] = axe_violations(page)
    assert {name: v for name, v in found.items() if v} == {}
    anonymous = open_page(browser, lstack, None, width=1280, height=800, color_scheme=scheme)
    for path in ("/ui/", "/ui/playground", "/ui/login/"):
        anonymous.goto(path)
        anonymous.wait_for_timeout(300)
        assert axe_violations(anonymous) == [], path
    anonymous.context.close()
    page.context.close()


def test_every_control_of_the_dashboard_is_reached_with_the_keyboard(lstack, users, browser):
    """Tab from the top reaches each row's Manage button; Enter opens its menu, whose first control
    takes the focus with Tab; Escape closes it."""
    page = open_page(browser, lstack, "operator", width=1280, height=800)
    _open(page, "/ui/")
    reached = set()
    for _ in range(200):
        page.keyboard.press("Tab")
        label = page.evaluate("document.activeElement.getAttribute('aria-label') || ''")
        if label.startswith("Manage "):
            reached.add(label.removeprefix("Manage "))
        if len(reached) == len(MODELS):
            break
    assert reached == {m["id"] for m in MODELS}
    page.get_by_role("button", name="Manage fx-a", exact=True).focus()
    page.keyboard.press("Enter")
    menu = page.locator('tr[data-model="fx-a"] [popover]')
    playwright_api.expect(menu).to_be_visible()
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.closest('[popover]') !== null")
    page.keyboard.press("Escape")
    playwright_api.expect(menu).to_be_hidden()
    page.context.close()
