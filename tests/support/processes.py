"""Processes the tests start and look at: free ports, one way to start a server and wait until it
listens (:func:`wait_listening`), one :func:`kill_process_tree`, ``serve`` on the embedded default,
and a process as the kernel sees it (``/proc``); system programs some tests drive.
"""
from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

from audiosite.supervision import kill_tree

from .bounds import QUICK_S


ROOT = Path(__file__).resolve().parents[2]
"""The repository (``manage.py`` is there)."""
SERVE_START_S = 240.0
"""How long a ``manage.py serve`` may take to listen on a busy two-core machine (migrations, the
Django and Celery imports of its children, eager model loads), in seconds."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kill_process_tree(proc: subprocess.Popen, also: Iterable[psutil.Process] = ()) -> None:
    """SIGKILL ``proc`` and every process under it (``audiosite.supervision.kill_tree``, the one
    ``serve`` uses on a stalled web process), plus ``also`` (children seen earlier), and reap ``proc``.

    ``serve`` starts its children (web, worker, embedded Redis) in sessions of their own, so a
    killed ``serve`` alone would leave them running: a failing test's cleanup uses this instead of
    ``proc.kill()``. Processes already gone are skipped; waits at most ``QUICK_S`` for each step."""
    if proc.poll() is None:  # (once reaped, its pid may belong to another process)
        kill_tree(proc.pid, QUICK_S)
    victims = list(also)
    for victim in victims:
        try:
            victim.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(victims, timeout=QUICK_S)
    proc.wait(timeout=QUICK_S)


def process_ended(pid: int) -> bool:
    """True when ``pid`` no longer runs: gone, or a zombie not yet reaped by its parent (psutil raises
    ``ZombieProcess`` for some zombies instead of reporting their status)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return True


def wait_listening(proc: subprocess.Popen, log_path: Path, timeout_s: float = SERVE_START_S) -> None:
    """Wait until ``serve`` (``proc``, its output in ``log_path``) logs ``listening on``.

    Raises:
        AssertionError: with the end of the log, once ``proc`` has exited or ``timeout_s`` seconds have
            passed; ``proc`` and its process tree are killed first.
    """
    deadline = time.monotonic() + timeout_s
    while b"listening on" not in log_path.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_process_tree(proc)
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-60:])
            raise AssertionError(f"serve did not start within {timeout_s:g} s:\n{tail}")
        time.sleep(0.2)


def start_serve(args: list[str], *, env: dict, log_path: Path, timeout_s: float = SERVE_START_S) -> subprocess.Popen:
    """Start ``manage.py serve <args>`` in the repository with ``env``, its stdout and stderr in
    ``log_path``, and wait until it listens (:func:`wait_listening`, which raises AssertionError if it
    does not). The one way the tests start a server process."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "manage.py", "serve", *args], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    wait_listening(proc, log_path, timeout_s)
    return proc


def embedded_env(tmp: Path, **extra: str) -> dict:
    """The environment of a ``manage.py serve`` on the embedded default: no DATABASE_URL/REDIS_URL
    (SQLite and the private Redis under ``tmp/var``), none of the caller's AUDIOSITE_* variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL") and not k.startswith("AUDIOSITE_")}
    env.update(AUDIOSITE_VAR_DIR=str(tmp / "var"), PYTHONUNBUFFERED="1", **extra)
    return env


def start_embedded(tmp: Path, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    """``manage.py serve <args>`` on the embedded default (see :func:`embedded_env`), waited until it
    listens (at most 180 s, :func:`start_serve`); returns the process and its log file (stdout and stderr)."""
    log_path = tmp / "serve.log"
    return start_serve(list(args), env=env or embedded_env(tmp), log_path=log_path, timeout_s=180), log_path


def mode_of(path: Path) -> int:
    """The permission bits of ``path`` (e.g. ``0o600``)."""
    return stat.S_IMODE(path.stat().st_mode)



def proc_environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` was started with (``/proc/<pid>/environ``, Linux)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def proc_threads(pid: int) -> int:
    """How many threads process ``pid`` has now (``Threads:`` of ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads line in /proc/{pid}/status")



def peak_rss_bytes(pid: int) -> int:
    """The peak resident set size of process ``pid`` so far (``VmHWM`` of ``/proc/<pid>/status``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")



# -- system programs some tests drive ------------------------------------------------------------------
def need_program(found: str | os.PathLike | None, name: str, package: str) -> str:
    """``found`` (a path to the program) as a str, else skip the test naming the Debian package to
    install; with ``AUDIOSITE_REQUIRE_PROGRAMS=1`` (``.ci/run``, which installs them) fail instead, so a
    missing install step cannot pass as a skip."""
    if found:
        return str(found)
    import pytest  # only the test modules use this helper
    message = f"needs {name} (apt-get install {package}; .ci/run installs it)"
    if os.environ.get("AUDIOSITE_REQUIRE_PROGRAMS") == "1":
        pytest.fail(message + ", and AUDIOSITE_REQUIRE_PROGRAMS=1 turns the skip into a failure", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def accepts_connections(host: str, port: int) -> bool:
    """True if a TCP connection to ``host:port`` is accepted, False if it is refused (other errors raise)."""
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except ConnectionRefusedError:
        return False


def marked_processes(variable: str, value: str) -> list[psutil.Process]:
    """Every process of a marked run: those whose environment carries ``variable=value`` (also started
    after any snapshot of its tree, or orphaned by a killed parent), and the embedded Redis of each of
    its servers (started with an environment of its own; its command line names the server's var folder)."""
    marked, var_dirs = [], set()
    for proc in psutil.process_iter():
        try:
            environ = proc.environ()
        except psutil.Error:
            continue
        if environ.get(variable) == value:
            marked.append(proc)
            if environ.get("AUDIOSITE_VAR_DIR"):
                var_dirs.add(environ["AUDIOSITE_VAR_DIR"])
    for proc in psutil.process_iter():
        try:
            command = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if proc not in marked and any(var_dir in command for var_dir in var_dirs):
            marked.append(proc)
    return marked


def leftovers_stopped(variable: str, value: str, timeout_s: float = 60) -> list[str]:
    """Wait up to ``timeout_s`` for the processes of a marked run (:func:`marked_processes`) to end; stop
    those still running, by pid (``serve`` with SIGINT, the others with SIGTERM, SIGKILL after 30 s),
    and return their command lines (empty: the run left nothing)."""
    _gone, alive = psutil.wait_procs(marked_processes(variable, value), timeout=timeout_s)
    described = []
    for leftover in alive:
        try:
            command = " ".join(leftover.cmdline())
            described.append(command[:120])
            leftover.send_signal(signal.SIGINT if "manage.py serve" in command else signal.SIGTERM)
        except psutil.Error:
            pass
    for stubborn in psutil.wait_procs(alive, timeout=30)[1]:
        stubborn.kill()
    return described
