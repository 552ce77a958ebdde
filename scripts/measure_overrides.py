"""What each framework override of ``audiosite.http`` still buys: stock Django/adrf against ours, one run.

Usage (from the checkout)::

    .venv/bin/python scripts/measure_overrides.py [--repeats 400]

Starts ``manage.py serve`` with no model (its embedded Redis, a temporary SQLite
database and one GPU worker, so ``/health`` answers 200), then, beside it, one
web process per variant below, each the same daphne (``python -m audiosite.web``,
with audiosite's daphne classes) serving ``audiosite.asgi.application`` with one
override swapped for the stock framework code it replaces:

- ``ours``: as shipped;
- ``handler_stock``: the API on Django's ``ASGIHandler`` (``audiosite.http.handler.ApiHandler`` off;
  the same ``API_MIDDLEWARE``);
- ``middleware_stock``: ``API_MIDDLEWARE`` with Django's ``SecurityMiddleware``,
  ``XFrameOptionsMiddleware`` and ``CommonMiddleware`` instead of their ``*OnLoop`` wrappers
  (``audiosite.http.middleware``), under our handler;
- ``initial_stock``: adrf's own ``initial()`` in a thread (``audiosite.http.apiview``'s event-loop
  path off);
- ``all_stock``: the three at once (stock Django + adrf on the same daphne);
- ``body_spool_stock``: a body over 100 KB spooled to a temporary file as Twisted does
  (``audiosite.http.daphne_server.IN_MEMORY_BODY_MAX_BYTES`` = 0).

It then sends sequential keep-alive ``GET`` requests for the cheap routes the overrides exist for
(``/health``, ``/v1/models``, an unknown path's 404, and that 404 for a ``POST`` of
:data:`CLIP_BYTES`, the body-spooling override's case), interleaved in rounds across the variants so a
load change hits all alike, and prints per route and variant the median latency (ms) and the web
process's CPU time per request (ms, user + system, from ``psutil``), each with its ratio to ``ours``.
An override "buys" ``variant / ours - 1`` of latency or CPU; one that buys under 10 % on every route
is not worth its coupling to framework internals.

The same file is the variant's ASGI module: the web processes import it as ``measure_overrides``
(``PYTHONPATH=scripts``) and read ``MEASURE_OVERRIDES_VARIANT``.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANT_ENV = "MEASURE_OVERRIDES_VARIANT"
VARIANTS = ("ours", "handler_stock", "middleware_stock", "initial_stock", "all_stock", "body_spool_stock")
CLIP_BYTES = 150_000
"""The POST route's body: about a 3.5 s WAV sent as base64 JSON or multipart (bytes)."""
ROUTES = (("GET", "/health", 200), ("GET", "/v1/models", 200), ("GET", "/no/such/route", 404),
          ("POST", "/no/such/route", 404))
STOCK_API_MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "audiosite.http.middleware.AllowedHostOnLoop",  # not an override: the API's 400 for a foreign Host
    "django.middleware.common.CommonMiddleware",
]


# -- the variant's ASGI app (imported by each web process) -------------------------------------------
def _build_application(variant: str):
    """``audiosite.asgi.application`` with the overrides ``variant`` names swapped for stock code."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "audiosite.settings")
    import django

    django.setup(set_prefix=False)
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured
    from django.core.handlers.asgi import ASGIHandler
    from django.core.handlers.exception import convert_exception_to_response
    from django.test import override_settings
    from django.utils.module_loading import import_string

    from audiosite.http import apiview, daphne_server, handler

    stock_handler = variant in ("handler_stock", "all_stock")
    stock_middleware = variant in ("middleware_stock", "all_stock")
    if stock_middleware:
        settings.API_MIDDLEWARE = STOCK_API_MIDDLEWARE
    if variant in ("initial_stock", "all_stock"):
        apiview._on_loop = lambda view, request, permissions: False  # adrf's sync_to_async(self.initial)
    if variant == "body_spool_stock":
        daphne_server.IN_MEMORY_BODY_MAX_BYTES = 0  # read by BoundedWebRequest.gotLength at each request

    class StockApiHandler(ASGIHandler):
        """Django's own ``ASGIHandler`` with ``API_MIDDLEWARE`` as its ``MIDDLEWARE``."""

        def load_middleware(self, is_async: bool = False) -> None:
            with override_settings(MIDDLEWARE=list(settings.API_MIDDLEWARE)):
                super().load_middleware(is_async)

    class ApiHandlerAnyMiddleware(handler.ApiHandler):
        """Our handler, taking sync-capable middleware (Django adapts each to the loop with a hop per hook)."""

        def load_middleware(self, is_async: bool = True) -> None:
            self._view_middleware: list = []
            self._template_response_middleware: list = []
            self._exception_middleware: list = []
            chain = convert_exception_to_response(self._get_response_async)
            for path in reversed(settings.API_MIDDLEWARE):
                instance = import_string(path)(chain)
                if any(hasattr(instance, hook) for hook in ("process_view", "process_exception")):
                    raise ImproperlyConfigured(f"{path} has a view hook")
                chain = convert_exception_to_response(instance)
            self._middleware_chain = chain

    if stock_handler:
        handler.ApiHandler = StockApiHandler  # type: ignore[misc]  # read by http_application
    elif stock_middleware:
        handler.ApiHandler = ApiHandlerAnyMiddleware  # type: ignore[misc]
    import audiosite.asgi

    return audiosite.asgi.application


if os.environ.get(VARIANT_ENV):
    application = _build_application(os.environ[VARIANT_ENV])


# -- the runner ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(url_port: int, proc: subprocess.Popen, log: Path, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"a process exited early; see {log}:\n{log.read_text()[-3000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", url_port, timeout=5)
            conn.request("GET", "/health")
            status = conn.getresponse().status
            conn.close()
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"port {url_port} did not answer 200 on /health; see {log}")


def _measure(ports: dict[str, int], pids: dict[str, int], repeats: int, rounds: int = 10) -> dict:
    """``{(variant, path): (latencies_ms, cpu_ms_per_request)}`` of sequential keep-alive GETs."""
    import psutil

    conns = {v: http.client.HTTPConnection("127.0.0.1", port, timeout=30) for v, port in ports.items()}
    procs = {v: psutil.Process(pid) for v, pid in pids.items()}
    times: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], float] = {}

    body = b"x" * CLIP_BYTES

    def get(variant: str, method: str, path: str, expected: int) -> float:
        started = time.perf_counter()
        conns[variant].request(method, path, body if method == "POST" else None)
        resp = conns[variant].getresponse()
        resp.read()
        elapsed = (time.perf_counter() - started) * 1000
        if resp.status != expected:
            raise SystemExit(f"{variant}: {method} {path} answered {resp.status}, expected {expected}")
        return elapsed

    for variant in ports:  # warm-up: imports, first connections, caches
        for method, path, expected in ROUTES:
            for _ in range(30):
                get(variant, method, path, expected)
    per_round = max(1, repeats // rounds)
    for _ in range(rounds):
        for method, path, expected in ROUTES:
            route = f"{method} {path}"
            for variant in ports:
                before = procs[variant].cpu_times()
                batch = [get(variant, method, path, expected) for _ in range(per_round)]
                after = procs[variant].cpu_times()
                times.setdefault((variant, route), []).extend(batch)
                spent = (after.user - before.user) + (after.system - before.system)
                cpu[(variant, route)] = cpu.get((variant, route), 0.0) + spent * 1000
    for conn in conns.values():
        conn.close()
    return {key: (times[key], cpu[key] / len(times[key])) for key in times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=400, help="requests per route and variant (default 400)")
    args = parser.parse_args()
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="measure-overrides-") as tmp_name:
        tmp = Path(tmp_name)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AUDIOSITE_") and k != "REDIS_URL"}
        env.update(DATABASE_URL=f"sqlite:///{tmp / 'db.sqlite3'}", AUDIOSITE_VAR_DIR=str(tmp / "var"),
                   HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", DJANGO_SETTINGS_MODULE="audiosite.settings")
        serve_port = _free_port()
        config = {"host": "127.0.0.1", "port": serve_port, "backend": "cpu", "lazy_load": True, "models": [],
                  "ui_management": True}
        (tmp / "server.json").write_text(json.dumps(config))
        env["AUDIOSITE_CONFIG"] = str(tmp / "server.json")
        try:
            log = tmp / "serve.log"
            with open(log, "wb") as out:
                serve_argv = [sys.executable, "manage.py", "serve", "--config", str(tmp / "server.json")]
                procs.append(subprocess.Popen(serve_argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True))
            _wait_for(serve_port, procs[0], log, 180)
            ports, pids = {}, {}
            for variant in VARIANTS:
                port = _free_port()
                variant_env = {**env, VARIANT_ENV: variant,
                               "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts"), str(ROOT)])}
                vlog = tmp / f"{variant}.log"
                with open(vlog, "wb") as out:
                    proc = subprocess.Popen([sys.executable, "-m", "audiosite.web", "-b", "127.0.0.1", "-p", str(port),
                                             "measure_overrides:application"], cwd=ROOT, env=variant_env,
                                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
                procs.append(proc)
                _wait_for(port, proc, vlog, 60)
                ports[variant], pids[variant] = port, proc.pid
            results = _measure(ports, pids, args.repeats)
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
            for proc in reversed(procs):
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print(f"{'route':<20} {'variant':<17} {'p50 ms':>7} {'x ours':>7} {'CPU ms/req':>11} {'x ours':>7}")
    for method, path, _ in ROUTES:
        route = f"{method} {path}"
        base_p50 = statistics.median(results[("ours", route)][0])
        base_cpu = results[("ours", route)][1]
        for variant in VARIANTS:
            latencies, cpu_ms = results[(variant, route)]
            p50 = statistics.median(latencies)
            print(f"{route:<20} {variant:<17} {p50:7.3f} {p50 / base_p50:7.2f} {cpu_ms:11.3f} {cpu_ms / base_cpu:7.2f}")


if __name__ == "__main__":
    main()
