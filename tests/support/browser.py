"""The browser side of the UI tests: Debian's Chromium (``/usr/bin/chromium``) driven by Playwright,
pages opened as a named user, screenshots, the layout and accessibility checks.

- :func:`launch` starts the browser (fake microphone: Chromium's test tone);
- :func:`open_page` opens a page at a viewport width, logged in as ``operator`` / ``viewer`` or not;
- :func:`make_users` creates ``operator`` (``registry.manage_models``) and ``viewer`` with :data:`PASSWORD`;
- :func:`shoot` saves a screenshot under :data:`ARTIFACTS` (and :data:`DOC_IMAGES` when asked);
- :func:`layout_problems` lists what sticks out of its container or the window;
- :func:`axe_violations` runs axe-core in the page (the ``axe-playwright-python`` wheel's bundled copy).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from .bounds import MODEL_S
from .processes import ROOT, need_program

PASSWORD = "a-long-test-password-1"
ARTIFACTS = Path(os.environ.get("AUDIOSITE_ARTIFACTS", ROOT / "var" / "artifacts")) / "ui"
DOC_IMAGES = ROOT / "docs" / "images"
WIDTHS = (1024, 1280, 1440, 1920)
"""Viewport widths the layout must fit (px): small laptop, the common laptop, large laptop, desktop."""
HEIGHT = 800


def chromium() -> str:
    """Debian's Chromium, or a skip (a failure under ``AUDIOSITE_REQUIRE_PROGRAMS=1``) naming the package."""
    path = Path("/usr/bin/chromium")
    return need_program(path if path.exists() else None, "Debian's chromium for the browser tests", "chromium")


def launch(playwright, microphone_wav: Path | None = None):
    """Chromium headless with a fake microphone that needs no permission prompt: a tone, or the WAV file
    ``microphone_wav`` played in a loop."""
    args = ["--no-sandbox", "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]
    if microphone_wav is not None:
        args.append(f"--use-file-for-fake-audio-capture={microphone_wav}")
    return playwright.chromium.launch(executable_path=chromium(), headless=True, args=args)


def make_users(stack) -> dict[str, str]:
    """``operator`` (may manage) and ``viewer`` (may not), both with :data:`PASSWORD`."""
    done = stack.manage("shell", "--no-imports", "-c", (
        "from django.contrib.auth.models import Permission, User\n"
        "perm = Permission.objects.get(codename='manage_models')\n"
        "for name, may in (('operator', True), ('viewer', False)):\n"
        "    u, _ = User.objects.get_or_create(username=name)\n"
        f"    u.set_password({PASSWORD!r}); u.save()\n"
        "    if may: u.user_permissions.add(perm)\n"))
    assert done.returncode == 0, done.stderr
    return {"operator": PASSWORD, "viewer": PASSWORD}


def open_page(browser, stack, user: str | None = None, width: int = 1500, height: int = 900,
              color_scheme: str = "light"):
    """A new page of its own context (cookies) at ``width`` × ``height``, logged in as ``user`` if given."""
    context = browser.new_context(base_url=stack.url, viewport={"width": width, "height": height},
                                  color_scheme=color_scheme)
    page = context.new_page()
    page.set_default_timeout(MODEL_S * 1000)
    if user is not None:
        page.goto("/ui/login/")
        page.get_by_label("User name").fill(user)
        page.get_by_label("Password").fill(PASSWORD)
        page.get_by_role("button", name="Log in").click()
        page.wait_for_url(re.compile(r"/ui/$"))
    return page


def shoot(page, name: str, docs: bool = False) -> None:
    """Screenshot of the whole page as ``<name>.png`` in :data:`ARTIFACTS`, and in ``docs/images`` with ``docs``."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
    if docs:
        page.screenshot(path=str(DOC_IMAGES / f"{name}.png"), full_page=True)


LAYOUT_PROBLEMS_JS = """(scrollers) => {
  // What does not fit: the page scrolling sideways; an element whose content is wider than its own box
  // while it neither scrolls nor clips on purpose; an element whose right edge is beyond its scroll
  // container's content (or the window). scrollers: CSS selectors of the elements that may scroll sideways.
  const problems = [];
  const root = document.documentElement;
  if (root.scrollWidth > root.clientWidth + 1) {
    problems.push(`page scrolls sideways: ${root.scrollWidth} > ${root.clientWidth}`);
  }
  const name = (el) => el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') +
    (typeof el.className === 'string' && el.className ? '.' + el.className.trim().split(/\\s+/).join('.') : '') +
    (el.dataset && el.dataset.field ? `[${el.dataset.field}]` : '');
  const rows = ['TABLE', 'TBODY', 'THEAD', 'TR'];
  for (const el of document.querySelectorAll('body *')) {
    const style = getComputedStyle(el);
    if (style.display === 'none' || style.display === 'inline') continue;
    if (el.closest('[popover]:not(:popover-open)')) continue;
    if (el.matches('.sr, .sr *, .skip, option, script, template')) continue;
    const box = el.getBoundingClientRect();
    if (box.width === 0 && box.height === 0) continue;
    const wider = el.scrollWidth > el.clientWidth + 1;
    const scrolls = style.overflowX === 'auto' || style.overflowX === 'scroll';
    if (scrolls && wider && !scrollers.some((s) => el.matches(s))) {
      problems.push(`${name(el)} scrolls sideways: ${el.scrollWidth} > ${el.clientWidth}`);
    }
    if (style.overflowX === 'visible' && wider && el.clientWidth > 0 && !rows.includes(el.tagName)) {
      problems.push(`${name(el)} overflows itself: content ${el.scrollWidth} > box ${el.clientWidth}`);
    }
    let frame = el.parentElement;
    while (frame && frame !== document.body && getComputedStyle(frame).overflowX === 'visible') {
      frame = frame.parentElement;
    }
    let limit = root.clientWidth;
    if (frame && frame !== document.body) {
      limit = frame.getBoundingClientRect().left + frame.clientLeft + frame.scrollWidth - frame.scrollLeft;
    }
    if (!el.matches('[popover]') && box.right > limit + 1) {
      problems.push(`${name(el)} ends at ${Math.round(box.right)} beyond ${Math.round(limit)}`);
    }
  }
  return problems;
}"""


def layout_problems(page, scrollers: tuple[str, ...] = ()) -> list[str]:
    """Every element of the page that does not fit (see :data:`LAYOUT_PROBLEMS_JS`); ``scrollers`` may
    scroll sideways inside their own frame."""
    return page.evaluate(LAYOUT_PROBLEMS_JS, list(scrollers))


def axe_violations(page, impacts: tuple[str, ...] = ("serious", "critical")) -> list[str]:
    """axe-core's violations of ``impacts`` on the page as it is now: ``"<rule>: <target> …"`` lines.

    axe-core comes from the ``axe-playwright-python`` wheel (it bundles ``axe.min.js``): nothing is fetched
    at test time."""
    axe_module = pytest.importorskip("axe_playwright_python.sync_playwright")
    results = axe_module.Axe().run(page)
    found = []
    for violation in results.response["violations"]:
        if violation.get("impact") in impacts:
            targets = ", ".join(str(node["target"]) for node in violation["nodes"][:5])
            found.append(f"{violation['id']} ({violation['impact']}): {violation['help']} at {targets}")
    return found
