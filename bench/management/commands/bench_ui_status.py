"""``python manage.py bench_ui_status --url URL``: how fast a change in Redis reaches the browser UI.

Opens the dashboard (``/ui/``) in Debian's Chromium through Playwright (the
browser tests' tool) and sends ``--repeat`` quick requests, one at a time, to
``--model`` (``/v1/tasks/run`` with 0.1 s of silence). Each request's release
(``release.lua``) sets the model's ``last_used_ms`` and publishes a change notice;
the page shows the new "last use" once the status stream pushes the snapshot. For
each request the page records the wall-clock time (``Date.now()``, the same clock
as this process's ``time.time()`` on one machine) at which that cell changed.

Prints, in ms, median / 95th percentile / max of:

- *response → page*: from the HTTP response arriving here to the page showing the
  change (the release happened just before the response was sent, so this is a
  slight underestimate of release → page);
- *request → page*: from sending the request (the whole run included).

Target: a change reaches the page within 500 ms. Prints PASS/FAIL for the
95th percentile of *response → page* and exits 0 either way (a report, not a gate).
The server must let anonymous visitors see status (``ui_anonymous`` "status", the
default) unless ``--user``/``--password`` are given.
"""
from __future__ import annotations

import base64
import io
import math
import statistics
import time

import httpx
import numpy as np
import soundfile
from django.core.management.base import BaseCommand, CommandError

TARGET_MS = 500.0
CHROMIUM = "/usr/bin/chromium"


def _silence_wav(seconds: float = 0.1, rate_hz: int = 16000) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, np.zeros(int(seconds * rate_hz), dtype=np.float32), rate_hz, format="WAV")
    return buf.getvalue()


def _p95(values: list[float]) -> float:
    """Nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(len(ordered) * 0.95) - 1)]


def _summary(values: list[float]) -> str:
    ordered = sorted(values)
    p95 = _p95(ordered)
    return f"median {statistics.median(ordered):7.1f}  p95 {p95:7.1f}  max {ordered[-1]:7.1f}"


class Command(BaseCommand):
    help = "Latency from a scheduler change (a request's release) to the browser UI showing it."

    def add_arguments(self, parser):
        parser.add_argument("--url", required=True, help="a running server, e.g. http://127.0.0.1:8080")
        parser.add_argument("--model", default="silero-vad", help="a loaded model that answers quickly")
        parser.add_argument("--repeat", type=int, default=20)
        parser.add_argument("--user", default=None)
        parser.add_argument("--password", default=None)

    def handle(self, *args, **opts):
        try:
            from playwright.sync_api import sync_playwright  # noqa: PLC0415  (a test dependency)
        except ImportError as exc:
            raise CommandError("needs playwright (scripts/install.sh installs it) and /usr/bin/chromium") from exc
        url, model, repeat = opts["url"].rstrip("/"), opts["model"], opts["repeat"]
        encoded = base64.b64encode(_silence_wav()).decode()
        cell = f'tr[data-model="{model}"] [data-field="last_used_at"]'
        after_response: list[float] = []
        after_request: list[float] = []
        with sync_playwright() as p, httpx.Client(base_url=url, timeout=60) as client:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            page = browser.new_page()
            if opts["user"]:
                page.goto(f"{url}/ui/login/")
                page.get_by_label("User name").fill(opts["user"])
                page.get_by_label("Password").fill(opts["password"] or "")
                page.get_by_role("button", name="Log in").click()
            page.goto(f"{url}/ui/")
            page.wait_for_function("document.getElementById('live-state').textContent === 'live'")
            if page.locator(cell).count() != 1:
                raise CommandError(f"model {model!r} is not on the dashboard")
            for attempt in range(repeat + 1):  # the first one warms up (load, first decode)
                page.evaluate("""(selector) => {
                    const cell = document.querySelector(selector);
                    const before = cell.title;
                    window.__changedAt = new Promise((resolve) => {
                        const seen = new MutationObserver(() => {
                            if (cell.title !== before) { seen.disconnect(); resolve(Date.now()); }
                        });
                        seen.observe(cell, {attributes: true});
                    });
                }""", cell)
                sent = time.time()
                answer = client.post("/v1/tasks/run", json={"model": model, "request": {"audio_base64": encoded}})
                received = time.time()
                if answer.status_code != 200:
                    raise CommandError(f"request failed: {answer.status_code} {answer.text[:200]}")
                changed_ms = page.evaluate("window.__changedAt")
                if attempt:
                    after_response.append(changed_ms - received * 1000)
                    after_request.append(changed_ms - sent * 1000)
                time.sleep(0.3)  # idle between requests: each change is its own notice
            browser.close()
        self.stdout.write(f"bench_ui_status: {repeat} requests to {model} at {url}")
        self.stdout.write(f"  response -> page (ms): {_summary(after_response)}")
        self.stdout.write(f"  request  -> page (ms): {_summary(after_request)}")
        p95 = _p95(after_response)
        verdict = "PASS" if p95 <= TARGET_MS else "FAIL"
        self.stdout.write(f"  {verdict}: p95 response -> page {p95:.1f} ms (target <= {TARGET_MS:.0f} ms)")
