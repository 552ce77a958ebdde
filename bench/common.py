"""What several benchmarks share: the speech sample, the ``/v1/tasks/run`` body, a quantile, a light
keep-alive HTTP client, and what ``/proc`` says of a stack's processes (role, RSS, CPU time)."""
from __future__ import annotations

import base64
import http.client
import os
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil
from django.conf import settings
from django.core.management.base import CommandError

#: A LibriSpeech utterance shipped in ``samples/`` (16 kHz mono WAV).
SAMPLE = Path(settings.BASE_DIR) / "samples" / "librispeech_test_clean_6930-75918-0000.wav"


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank (no interpolation), in their unit.

    Raises:
        IndexError: ``values`` is empty.
    """
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def task_body(model: str, wav: bytes, **extra) -> dict:
    """The JSON body of ``POST /v1/tasks/run`` for ``model`` with ``wav`` (any audio file's bytes) as
    base64; ``extra`` become the request's ``options``, except ``busy_timeout_ms``, which goes to the
    body's top level."""
    timeout = extra.pop("busy_timeout_ms", None)
    body = {"model": model, "request": {"audio_base64": base64.b64encode(wav).decode(), "options": extra}}
    if timeout is not None:
        body["busy_timeout_ms"] = timeout
    return body


class KeepAliveConn:
    """A keep-alive HTTP/1.1 connection (http.client: a light client, so it adds little noise)."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=120)

    def get(self, path: str) -> tuple[int, float]:
        started = time.perf_counter()
        self.conn.request("GET", path)
        resp = self.conn.getresponse()
        resp.read()
        return resp.status, (time.perf_counter() - started) * 1000

    def post_json(self, path: str, body: bytes) -> tuple[int, bytes, float]:
        """``POST`` of a JSON ``body`` (bytes): status, response body, milliseconds."""
        started = time.perf_counter()
        self.conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        data = resp.read()
        return resp.status, data, (time.perf_counter() - started) * 1000

    def close(self) -> None:
        self.conn.close()


def proc_status_kb(pid: int, field: str) -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``…).

    Raises:
        CommandError: the field is not there.
    """
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise CommandError(f"no {field} in /proc/{pid}/status")


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def process_role(cmdline: list[str]) -> str:
    """Which process of a ``serve`` stack a command line belongs to: ``web``, ``worker``, ``redis``,
    ``fork server`` (the worker's parent of model processes; a model's process has the same command
    line, see :func:`stack_processes`), ``resource tracker``, ``serve`` or ``other``."""
    joined = " ".join(cmdline)
    for needle, role in (("audiosite.web", "web"), ("celery", "worker"), ("redis-server", "redis"),
                         ("multiprocessing.forkserver", "fork server"),
                         ("multiprocessing.resource_tracker", "resource tracker"), ("manage.py serve", "serve")):
        if needle in joined:
            return role
    return "other"


def stack_processes(serve_pid: int) -> dict[int, str]:
    """``serve`` and every process below it, pid -> role (:func:`process_role`; a child of the fork
    server is ``model``, a model's process)."""
    roles: dict[int, str] = {}
    parents: dict[int, int] = {}
    root = psutil.Process(serve_pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            roles[proc.pid], parents[proc.pid] = process_role(proc.cmdline()), proc.ppid()
        except psutil.Error:
            continue
    return {pid: "model" if role == "fork server" and roles.get(parents[pid]) == "fork server" else role
            for pid, role in roles.items()}
