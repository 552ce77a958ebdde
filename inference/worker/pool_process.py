"""A model's pool in a process of its own: a crash costs only that model, an unload gives its memory back.

The worker keeps the scheduler's side (liveness, the run queue, leases, every
reply); each loaded pool lives in a child process started from a fork server
(``multiprocessing``'s ``forkserver`` context: a fresh single-threaded
interpreter forks the children, never the threaded worker itself), which
imports the serving modules once (:data:`PRELOAD`) so a load does not pay
for a Python start-up.

Protocol (``multiprocessing.Pipe``, pickled tuples): a control pipe, and one pipe per slot.

- control, child → worker, once: ``("ready", capacity)`` or ``("failed", "<Type>: <message>")``;
- a slot's pipe, worker → child: ``(kind, header, has_inline)`` then, when ``has_inline``, the
  samples as one ``send_bytes`` (from the popped queue element's own memory; the child reads them
  once: no other copy). A run whose samples wait in ``Keys.input`` carries none: the child reads the
  key itself. Child → worker: the run's reply (``inference.worker.serving.execute``). A batch
  (``serving.BATCH``, ``inference.worker.batching``) sends a list of headers and a list of flags, then
  each present sample buffer in order; its reply is the list of the runs' replies
  (``serving.execute_batch``);
- control, worker → child: ``("close",)``, answered at once ``("closing",)`` (a process that does not
  answer within ``CLOSE_ACK_S`` is killed): finish the runs in progress, close sessions then weights
  (R4.5), exit. The process's end gives every page back to the operating system.

The worker watches each child (:class:`ProcessPool`'s watcher thread): when it ends without being
asked (a segfault, ``os._exit``, the OOM killer, or the worker killing it for a run past its
deadline), every run of that model in flight is answered ``crashed`` (a run past its deadline
``deadline``), after the ``on_exit`` callback has recorded the model failed; other models' processes
are untouched. A child whose worker died reads the end of its control pipe and exits.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from audiosite.serverconfig import ServerConfig, get_config, install_config, slot_count
from inference import specs
from inference.adapters.fixture_barrier import make_barrier
from inference.runtime.context import KEYS, redis_url
from inference.runtime.runs import RunFailure

from . import serving
from .pool import build_pool

log = logging.getLogger(__name__)

PRELOAD = ["inference.worker.pool_process", "inference.adapters.silero_vad", "inference.adapters.whisper",
           "inference.adapters.piper", "inference.adapters.speaker_embedding"]
"""Modules the fork server imports once, so each model's process starts with them loaded (numpy,
onnxruntime, faster-whisper; about 1 s of imports a load would otherwise pay). A module that fails to
import there is imported by the child when its family loads."""

CLOSE_WAIT_S = 180.0
"""How long a closing pool's process may take to finish its runs and close (s): a run still going
gets up to a minute (``Pool.close``), the test family's teardown barrier up to 120 s; after that the
process is killed."""

EXIT_WAIT_S = 10.0
"""After a killed process's pipe ends, how long the reader waits for its exit status (s)."""

CLOSE_ACK_S = 5.0
"""How long a closing pool's process may take to acknowledge the close (s; its control thread answers at
once, whatever its other threads do): one that does not, stopped (SIGSTOP) or hung with the GIL held,
is killed then instead of after :data:`CLOSE_WAIT_S`."""

MAX_POLL_S = 2_000_000.0
"""The longest single wait for a reply (s, about 23 days): a pipe's poll refuses a timeout past 2**31 ms
(``OverflowError``), which the largest ``max_run_ms`` scaled by a long input exceeds."""

_CONTEXT = multiprocessing.get_context("forkserver")
_PRELOAD_SET = threading.Lock()
_preloaded: list[bool] = []


def _context() -> Any:
    """The fork server context, its preload list set before its first use."""
    with _PRELOAD_SET:
        if not _preloaded:
            _CONTEXT.set_forkserver_preload(PRELOAD)
            _preloaded.append(True)
    return _CONTEXT


def fork_server_start() -> None:
    """Start the fork server now (it imports :data:`PRELOAD`, about a second or more), so the worker's
    first load does not wait for it. Called in a thread at the worker's start."""
    _context()
    multiprocessing.forkserver.ensure_running()


class PoolLoadFailed(Exception):
    """A model's process could not build its pool. ``detail``: ``"<Type>: <message>"`` of the failure in
    the child (as an in-process load reports it), or how the process ended."""

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


def exit_text(exitcode: int | None) -> str:
    """How a process ended, in words: ``killed by signal SIGSEGV``, ``exited with code 3``."""
    if exitcode is None:
        return "did not exit"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def crashed_reply(reason: str) -> dict:
    """The reply of a run lost with its model's process (kind ``crashed``, 503 ``model_crashed``)."""
    return {"ok": False, "kind": RunFailure.CRASHED, "message": f"the model's process ended during the run ({reason})"}


def deadline_reply(deadline_s: float) -> dict:
    """The reply of a run stopped at its deadline (kind ``deadline``, 503 ``run_deadline``)."""
    return {"ok": False, "kind": RunFailure.DEADLINE,
            "message": f"the run passed its deadline of {round(deadline_s * 1000)} ms; the model's process was stopped"}


class ProcessPool:
    """The worker's handle on a pool running in a child process (same interface as ``pool.Pool`` for
    the worker: ``execute``, ``close``, ``capacity``, ``meta_json``, ``pid``).

    One pipe per slot: a run borrows a free pipe (admission never grants more runs than slots), sends
    its header and samples, and waits for the reply on that pipe in its own thread, so no other
    thread sits on a run's path. A watcher thread waits for the process's end. Build with :meth:`start`.

    ``on_exit(pool, reason)`` is called once, from the watcher, when the process ends without
    :meth:`close` (crash, kill, deadline), before the runs in flight are answered; ``reason`` says
    how it ended (``killed by signal SIGSEGV``, or why the worker killed it).
    """

    def __init__(self, model_id: str, meta_json: str, process: Any, control: Any, pipes: list, capacity: int,
                 on_exit: Callable[[ProcessPool, str], None]):
        self.model_id = model_id
        self.meta_json = meta_json
        self.capacity = capacity
        self.loaded_at = time.time()
        self.pid: int = process.pid
        self._process = process
        self._control = control
        self._pipes = pipes
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for conn in pipes:
            self._free.put(conn)
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self._gone: str | None = None
        self._closing = False
        self._kill_reason = ""
        self._exited = threading.Event()
        self._pidfd = _pidfd_open(process.pid)
        self._watcher = threading.Thread(target=self._watch, name=f"pool {model_id}", daemon=True)

    @classmethod
    def start(cls, model_id: str, meta: dict, meta_json: str, on_exit: Callable[[ProcessPool, str], None],
              fixture: bool = False, config: ServerConfig | None = None) -> ProcessPool:
        """Start ``model_id``'s process, let it build the pool (``pool.build_pool``) and return once it is ready.

        Args:
            meta: the published registration.
            fixture: give the test family its barriers (``inference.adapters.fixture_barrier``).
            config: the server configuration the child runs with (default: this process's).

        Raises:
            PoolLoadFailed: the build raised in the child (``detail`` is ``"<Type>: <message>"``), or the
                process ended before it was ready.
        """
        config = config or get_config()
        context = _context()
        control, child_control = context.Pipe(duplex=True)
        pairs = [context.Pipe(duplex=True) for _ in range(slot_count(meta.get("slots"), config.runtime))]
        process = context.Process(target=child_main, name=f"model {model_id}", daemon=True,
                                  args=(child_control, [child for _, child in pairs], model_id, meta, meta_json,
                                        config, fixture))
        process.start()
        for conn in (child_control, *(child for _, child in pairs)):
            conn.close()
        pipes = [parent for parent, _ in pairs]
        try:
            message = control.recv()
        except (EOFError, OSError):
            message = ("failed", f"the model's process {exit_text(_joined(process))} while loading")
        if message[0] != "ready":
            if _joined(process) is None:
                process.kill()
            for conn in (control, *pipes):
                conn.close()
            raise PoolLoadFailed(str(message[1]))
        pool = cls(model_id, meta_json, process, control, pipes, int(message[1]), on_exit)
        pool._watcher.start()
        return pool

    @property
    def slots(self) -> int:
        """How many runs of the model may hold a lease at once (one pipe, one session each)."""
        return len(self._pipes)

    def execute(self, kind: str, header: dict, inline: Any = None, deadline_s: float | None = None) -> dict:
        """Serve one run in the model's process (see ``serving.execute`` for ``kind``, ``header``, the reply).

        Args:
            inline: the samples (bytes-like) when they came inside the queue element: written to the
                pipe from their own memory.
            deadline_s: the run's deadline (None = none). Past it the process is killed (every other
                run of the model in flight is answered ``crashed``) and this run answers ``deadline``.

        Returns:
            The child's reply; :func:`crashed_reply` when the process ended during the run.
        """
        if self._gone is not None:
            return crashed_reply(self._gone)
        try:
            conn = self._free.get(timeout=SLOT_WAIT_S)
        except queue.Empty:  # more runs than slots: admission should make this impossible
            return {"ok": False, "kind": RunFailure.ERROR, "message": f"no free slot in {self.model_id}'s process"}
        def send() -> None:
            conn.send((kind, header, inline is not None))
            if inline is not None:
                conn.send_bytes(inline)

        try:
            reply = self._exchange(conn, send, deadline_s, "a run")
        finally:
            self._free.put(conn)
        if reply is _DEADLINE:
            return deadline_reply(deadline_s or 0.0)
        if reply is _CRASHED:
            return crashed_reply(self._gone or "its pipe broke")
        return reply

    def execute_batch(self, headers: list[dict], inlines: list, deadline_s: float | None = None) -> list[dict]:
        """Serve several runs of the model in one session call in its process (``serving.execute_batch``),
        on one pipe: ``(BATCH, headers, [has_inline, ...])``, then each present sample buffer in order.

        Args:
            inlines: per header, its samples (bytes-like) or None.
            deadline_s: the batch's deadline (None = none); past it the process is killed and every
                member answers ``deadline``.

        Returns:
            One reply per header, in order; every member gets :func:`crashed_reply` when the process
            ended during the call.
        """
        if self._gone is not None:
            return [crashed_reply(self._gone)] * len(headers)
        try:
            conn = self._free.get(timeout=SLOT_WAIT_S)
        except queue.Empty:
            return [{"ok": False, "kind": RunFailure.ERROR, "message": f"no free slot in {self.model_id}'s process"}
                    ] * len(headers)
        def send() -> None:
            conn.send((serving.BATCH, headers, [inline is not None for inline in inlines]))
            for inline in inlines:
                if inline is not None:
                    conn.send_bytes(inline)

        try:
            reply = self._exchange(conn, send, deadline_s, "a batch")
        finally:
            self._free.put(conn)
        if reply is _DEADLINE:
            return [deadline_reply(deadline_s or 0.0)] * len(headers)
        if reply is _CRASHED:
            return [crashed_reply(self._gone or "its pipe broke")] * len(headers)
        return reply

    def _exchange(self, conn: Any, send: Callable[[], None], deadline_s: float | None, what: str) -> Any:
        """Send a request on ``conn`` (``send``) and wait for its reply, at most ``deadline_s`` (None: no
        limit; capped at :data:`MAX_POLL_S`). Returns the reply, :data:`_DEADLINE` (past it the process
        is killed: every other run of the model answers ``crashed``) or :data:`_CRASHED` (the process
        ended). Once the model is recorded failed (``on_exit``) the caller's reply frees the slot.

        Raises:
            Exception: anything else between the send and the reply (a bug on the worker's side). The
                pipe may then still get the reply meant for this request, and the next request on it
                would read that one: the process is killed first, so no pipe of it is used again.
        """
        try:
            send()
            if not conn.poll(None if deadline_s is None else min(deadline_s, MAX_POLL_S)):
                self.kill(f"{what} passed its deadline of {round((deadline_s or 0) * 1000)} ms")
                self._exited.wait(EXIT_WAIT_S)
                return _DEADLINE
            return conn.recv()
        except (EOFError, OSError, ValueError):  # the process ended during the run
            self._exited.wait(EXIT_WAIT_S)
            return _CRASHED
        except Exception as exc:
            self.kill(f"{what} failed on the worker's side, its pipe in an unknown state ({type(exc).__name__})")
            self._exited.wait(EXIT_WAIT_S)
            raise

    def kill(self, reason: str) -> None:
        """Kill the process now (SIGKILL); ``reason`` is what the runs in flight and the record say."""
        log.warning("killing the process of %s (pid %s): %s", self.model_id, self.pid, reason)
        with self._lock:  # the watcher closes the pidfd under it: never a stale descriptor
            self._kill_reason = self._kill_reason or reason
            try:
                if self._pidfd is not None:  # the process itself, even once the fork server is gone
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                elif not self._exited.is_set():
                    self._process.kill()
            except (OSError, ValueError):  # already gone or closed
                pass

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Ask the process to finish its runs, close sessions then weights (R4.5) and exit; wait for it
        (killed after ``wait_s``). Its memory goes back to the operating system as it exits."""
        self._closing = True
        acknowledged = False
        try:
            self._control.send(("close",))
            acknowledged = self._control.poll(CLOSE_ACK_S)  # its ack, or the pipe's end (it exited)
        except (OSError, ValueError):
            pass
        if not acknowledged:
            log.warning("the process of %s did not answer the close within %.0f s (stopped or hung); killing it",
                        self.model_id, CLOSE_ACK_S)
            self.kill("it did not answer the close")
        elif not self._exited.wait(wait_s):  # the watcher saw the process end (its pidfd, not the fork server)
            log.warning("the process of %s did not exit within %.0f s; killing it", self.model_id, wait_s)
            self.kill("closing took too long")
        self._exited.wait(EXIT_WAIT_S + 1)
        log.info("the process of %s (pid %s) %s", self.model_id, self.pid, exit_text(self._process.exitcode))

    def _watch(self) -> None:
        """Wait for the process's end; unless it was asked to close, record it (``on_exit``) before the runs
        in flight, which see their pipes end, answer ``crashed`` (class docstring).

        The end is the process's pidfd becoming readable (Linux 5.3+). ``multiprocessing``'s sentinel is
        a socket to the fork server, which also ends when the *fork server* dies (the OOM killer may
        pick it) while every model's process lives on: that alone is not taken for this process's end
        (its exit status, which only the fork server could report, is then unknown)."""
        sentinel = self._process.sentinel
        status_lost = False
        if self._pidfd is None:  # no pidfd here: the sentinel is all there is
            multiprocessing.connection.wait([sentinel])
        elif self._pidfd not in multiprocessing.connection.wait([sentinel, self._pidfd]):
            log.warning("the fork server of %s's process ended; the process (pid %s) runs on, watched by its pid",
                        self.model_id, self.pid)
            multiprocessing.connection.wait([self._pidfd])
            status_lost = True
        reason = self._kill_reason or ("ended (its exit status was lost with the fork server)" if status_lost
                                       else exit_text(_joined(self._process)))
        if not self._closing:
            log.error("the process of %s (pid %s) ended: %s", self.model_id, self.pid, reason)
            try:
                self._on_exit(self, reason)
            except Exception:
                log.exception("recording the end of the process of %s failed", self.model_id)
        self._gone = reason
        self._exited.set()
        for conn in (self._control, *self._pipes):
            conn.close()
        with self._lock:
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None



SLOT_WAIT_S = 5.0
"""How long a run waits for a free pipe (s); admission grants no more runs than slots, so a run finds
one at once (as ``pool.Pool.slot``)."""


def _pidfd_open(pid: int) -> int | None:
    """A pidfd of ``pid`` (readable once the process has ended), or None where the kernel has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


_DEADLINE = object()
_CRASHED = object()
"""What :meth:`ProcessPool._exchange` returns instead of a reply."""


def _joined(process: Any) -> int | None:
    """``process``'s exit code, after waiting up to ``EXIT_WAIT_S`` for it (None if it still runs)."""
    process.join(EXIT_WAIT_S)
    return process.exitcode


def child_main(control: Any, pipes: list, model_id: str, meta: dict, meta_json: str, config: ServerConfig,
               fixture: bool) -> None:
    """The body of a model's process: build the pool, report on ``control``, serve each slot's pipe in a
    thread of its own until told to close.

    Ignores SIGINT (a terminal's Ctrl-C reaches the whole process group; the worker decides when
    its pools close). Exits at once when the worker's end of ``control`` closes (the worker died),
    whatever its other threads are doing (:func:`_watch_control`).
    """
    closing = threading.Event()
    threading.Thread(target=_watch_control, args=(control, closing), name="control", daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"[%(asctime)s: %(levelname)s/model {model_id}] %(message)s")
    install_config(config)
    barrier = make_barrier(redis_url(), KEYS) if fixture and specs.fixture_family_enabled() else None
    try:
        pool = build_pool(model_id, meta, meta_json, barrier)
    except Exception as exc:
        log.exception("loading %s failed", model_id)
        control.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    for index, conn in enumerate(pipes):
        threading.Thread(target=_serve_pipe, args=(pool, conn), name=f"slot {index}", daemon=True).start()
    control.send(("ready", pool.capacity))
    closing.wait()
    pool.close()


def _watch_control(control: Any, closing: threading.Event) -> None:
    """Read the control pipe from the child's first moment: ``("close",)`` sets ``closing``; its end (the
    worker died) ends this process at once, also while the pool is still being built or a run holds
    the other threads (a load held at a barrier would otherwise live on as an orphan and take the
    barrier's release meant for the next worker's load)."""
    try:
        control.recv()
    except (EOFError, OSError):
        os._exit(0)  # the worker died: its runs are answered by the web's liveness watch (R7.4)
    try:
        control.send(("closing",))  # the acknowledgement ProcessPool.close waits for (CLOSE_ACK_S)
    except (OSError, ValueError):
        os._exit(0)
    closing.set()


def _serve_pipe(pool: Any, conn: Any) -> None:
    """Serve the runs arriving on one slot's pipe, one at a time, until the worker closes it."""
    inline: Any
    payload: Any
    while True:
        try:
            kind, header, has_inline = conn.recv()
            if kind == serving.BATCH:  # header: a list of run headers; has_inline: one flag per header
                inline = [conn.recv_bytes() if flag else None for flag in has_inline]
            else:
                inline = conn.recv_bytes() if has_inline else None
        except (EOFError, OSError):
            return
        if kind == serving.BATCH:
            payload = serving.execute_batch(pool, header, inline)
        else:
            payload = serving.execute(pool, kind, header, inline)
        del inline
        try:
            conn.send(payload)
        except (OSError, ValueError):  # the worker is gone; nobody waits for this reply
            return
