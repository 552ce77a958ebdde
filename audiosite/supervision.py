"""How ``manage.py serve`` keeps its Celery workers and its web process running: restart with backoff,
tell the others. The web process: :class:`WebSupervisor` (its exit, or a stalled event loop, see there).

A worker process that exits while serve is not stopping (a crash, the OOM
killer, ``kill -9``, even a clean exit nobody asked for) is replaced:

1. serve notices the exit within one tick (``TICK_S``) and logs it;
2. it forgets the dead worker at once instead of letting its liveness key run
   out (``LIVENESS_TTL_MS``), in one script (``forget_worker.lua``): the models
   whose pools it owned are marked unloaded in Redis, a load it had started is
   ended as ``worker_lost`` (its waiters get 503 ``worker_lost`` at once), and
   its liveness key and its entries in ``Keys.worker_pid`` /
   ``Keys.worker_memory`` are deleted; serve then records both in the database
   through its ``on_lost`` callback (the pools unloaded, the load failed). Web
   processes waiting for one of its runs then answer 503 ``worker_lost`` at
   their next watchdog tick (``inference.runtime.loads.await_reply``, at most ``MAX_CHECK_S`` apart), and
   ``/health`` reports ``degraded`` while no other worker is alive;
3. after a delay (:class:`RestartBackoff`) it starts a replacement under a new
   Celery hostname (so a new ``worker_direct`` queue and run queue).

A worker that stops beating without exiting (frozen past ``LIVENESS_TTL_MS``,
or not serve's own) is settled too: every ``SETTLE_EVERY_S`` the supervisor
runs ``settle_lost_pools.lua``, which marks unloaded the ready pools whose
worker's liveness key is gone and ends the loads whose worker is gone, and
hands what it found to ``on_settled`` (serve records it in the database), so
the database follows Redis when a worker dies.

While a worker is being started, ``Keys.worker_starting`` exists (a short TTL,
refreshed every tick): from the spawn until its first liveness beat (at most
``WORKER_BOOT_TIMEOUT_S``), and from ``RESTART_GRACE_S`` before a scheduled
restart. A cold load that finds no live worker waits for a worker only while
that key exists, and otherwise fails with 503 ``no_worker`` at once
(``inference.runtime.loads.load_single_flight``), so requests neither fail
during the first seconds of a quick restart nor wait one lease TTL each for a
restart that is 30 s away.

Tolerated: if Redis cannot be reached, the bookkeeping of that tick is skipped
(logged); the process work (noticing exits, restarting) goes on.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import redis

from inference.scheduler import ForgottenWorker, Keys, Scheduler, SettledPools

TICK_S = 0.2
"""How often serve calls :meth:`WorkerSupervisor.tick`, in seconds (serve's main loop period)."""
RESTART_RESET_AFTER_S = 60.0
"""A worker that stayed up at least this long (seconds) before exiting restarts after the first delay again."""
RESTART_GRACE_S = 2.0
"""A restart due within this many seconds counts as "a worker is being started" (requests wait for it)."""
WORKER_BOOT_TIMEOUT_S = 120.0
"""How long (seconds) a spawned worker that has not beaten yet still counts as being started."""
STARTING_TTL_MS = 5000
"""TTL of ``Keys.worker_starting``: it lapses this soon after serve stops refreshing it (serve killed)."""
STARTING_REFRESH_S = 1.0
"""How often serve refreshes ``Keys.worker_starting`` while a worker is being started, in seconds."""
SETTLE_EVERY_S = 2.0
"""How often the worker supervisor settles the pools and loads of workers whose liveness key is gone
(``Scheduler.settle_lost_pools``), in seconds: one worker beat."""


class RestartBackoff:
    """The delay before restarting one worker: ``first_delay_s``, doubling per quick exit, capped.

    An exit after an uptime of at least ``reset_after_s`` counts as the first
    one again. With the defaults of ``server.json``
    (``worker_restart_delay_ms`` 1000, ``worker_restart_max_delay_ms`` 30000)
    a worker that keeps dying at start-up is restarted after 1, 2, 4, 8, 16,
    30, 30 … s.

    Args:
        first_delay_s: delay after the first exit, > 0.
        max_delay_s: ceiling, ≥ ``first_delay_s``.
        reset_after_s: uptime that resets the doubling (default ``RESTART_RESET_AFTER_S``).
    """

    def __init__(self, first_delay_s: float, max_delay_s: float, reset_after_s: float = RESTART_RESET_AFTER_S):
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self.reset_after_s = reset_after_s
        self.quick_exits = 0

    def next_delay_s(self, uptime_s: float) -> float:
        """Record an exit after ``uptime_s`` seconds up and return the delay (seconds) before the restart."""
        if uptime_s >= self.reset_after_s:
            self.quick_exits = 0
        self.quick_exits += 1
        return min(self.max_delay_s, self.first_delay_s * 2 ** (self.quick_exits - 1))


def describe_exit(returncode: int) -> str:
    """``code N``, with the signal's name for a process killed by a signal (``code -9 (SIGKILL)``)."""
    if returncode < 0:
        try:
            return f"code {returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            pass
    return f"code {returncode}"


@dataclass
class _Slot:
    """One supervised worker position (``--workers N`` gives N): the current process and its restart state."""

    index: int
    backoff: RestartBackoff
    hostname: str = ""
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    alive: bool = False  # its liveness key has been seen since this spawn
    overdue_said: bool = False
    restart_at: float | None = None
    restarts: int = 0


class WorkerSupervisor:
    """Starts ``count`` workers and keeps them running (see the module docstring).

    Args:
        count: worker processes (``serve --workers``).
        spawn: ``spawn(index, hostname) -> Popen`` starts one Celery worker named ``hostname``.
        new_hostname: ``new_hostname(index) -> str``, a fresh Celery hostname for position ``index``.
        redis_client: a synchronous client (``decode_responses=True``, bounded socket timeouts).
        keys: the deployment's key layout.
        lease_ttl_ms: the deployment's lease TTL (the scheduler's scripts take it).
        first_delay_s, max_delay_s: the restart backoff (:class:`RestartBackoff`).
        say: writes one line to serve's log.
        on_lost: ``on_lost(hostname, returncode, forgotten)`` after a worker exited and what it held
            was settled in Redis (``forgotten``: a :class:`ForgottenWorker`, its pools and its load).
        clock: monotonic seconds (``time.monotonic``).
        on_settled: ``on_settled(settled)`` after pools and loads of workers whose liveness key is gone
            were settled in Redis (:class:`SettledPools`; see the module docstring); None = not settled.
    """

    def __init__(self, count: int, spawn: Callable[[int, str], subprocess.Popen],
                 new_hostname: Callable[[int], str], redis_client: Any, keys: Keys, lease_ttl_ms: int,
                 first_delay_s: float, max_delay_s: float, say: Callable[[str], None],
                 on_lost: Callable[[str, int, ForgottenWorker], None], clock: Callable[[], float] = time.monotonic,
                 on_settled: Callable[[SettledPools], None] | None = None):
        self._spawn = spawn
        self._new_hostname = new_hostname
        self._redis = redis_client
        self._keys = keys
        self._scheduler = Scheduler(redis_client, keys, lease_ttl_ms)
        self._say = say
        self._on_lost = on_lost
        self._clock = clock
        self._slots = [_Slot(index, RestartBackoff(first_delay_s, max_delay_s)) for index in range(count)]
        self._advertised_at: float | None = None
        self._redis_failing = False
        self._on_settled = on_settled
        self._settle_at = 0.0

    # -- processes ------------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn every worker (announcing them as being started first)."""
        now = self._clock()
        for slot in self._slots:
            self._start(slot, now)
        self._advertise(now)

    def running(self) -> list[tuple[str, subprocess.Popen]]:
        """``("worker <hostname>", process)`` of every current worker process (exited ones included until
        the next tick notices them)."""
        return [(f"worker {slot.hostname}", slot.proc) for slot in self._slots if slot.proc is not None]

    def tick(self, restart: bool = True) -> list[str]:
        """Notice exits, forget the dead, start due replacements, watch boots, refresh ``Keys.worker_starting``.

        Args:
            restart: schedule a replacement for each exit (False during serve's start-up, when an exit is fatal).

        Returns:
            One line per worker that exited since the last tick (``worker <hostname> exited with code …``).
        """
        now = self._clock()
        exits = []
        for slot in self._slots:
            if slot.proc is not None and slot.proc.poll() is not None:
                exits.append(self._exited(slot, now, restart))
        for slot in self._slots:
            if slot.restart_at is not None and slot.restart_at <= now:
                self._start(slot, now)
        self._watch_boots(now)
        self._advertise(now)
        self._settle(now)
        return exits

    def live_hostnames(self) -> list[str]:
        """The hostnames of this supervisor's workers whose liveness key exists now (beating; [] when
        Redis cannot be reached)."""
        hosts = [slot.hostname for slot in self._slots if slot.proc is not None]
        found = self._redis_call(lambda: [host for host in hosts if self._redis.exists(self._keys.worker_live(host))])
        return found or []

    def close(self) -> None:
        """Stop announcing a worker start (serve is stopping); best effort."""
        for slot in self._slots:
            slot.restart_at = None
        if self._advertised_at is not None:
            self._redis_call(lambda: self._redis.delete(self._keys.worker_starting))
            self._advertised_at = None

    def _start(self, slot: _Slot, now: float) -> None:
        replaced = slot.hostname
        slot.hostname = self._new_hostname(slot.index)
        slot.proc = self._spawn(slot.index, slot.hostname)
        slot.started_at = now
        slot.alive = False
        slot.overdue_said = False
        slot.restart_at = None
        if replaced:
            slot.restarts += 1
            self._say(f"started worker {slot.hostname} (pid {slot.proc.pid}) to replace {replaced} "
                      f"(restart {slot.restarts} of worker {slot.index})")

    def _exited(self, slot: _Slot, now: float, restart: bool) -> str:
        assert slot.proc is not None
        returncode = slot.proc.returncode
        uptime_s = now - slot.started_at
        line = f"worker {slot.hostname} exited with {describe_exit(returncode)} after {uptime_s:.1f} s"
        slot.proc = None
        forgotten = self._forget(slot.hostname)
        if forgotten.pools:
            line += f"; its models {', '.join(forgotten.pools)} are unloaded"
        if forgotten.loads:
            line += f"; its load of {', '.join(forgotten.loads)} is ended"
        if restart:
            delay_s = slot.backoff.next_delay_s(uptime_s)
            slot.restart_at = now + delay_s
            line += f"; restarting it in {delay_s:g} s"
        self._say(line)
        try:
            self._on_lost(slot.hostname, returncode, forgotten)
        except Exception as exc:  # the record is informative; supervision goes on
            self._say(f"recording the models of {slot.hostname} as unloaded failed: {exc}")
        return line

    # -- Redis bookkeeping -----------------------------------------------------------------------
    def _redis_call(self, call: Callable[[], Any]) -> Any:
        """``call()``, or None when Redis cannot be reached (said once per outage)."""
        try:
            result = call()
        except redis.RedisError as exc:
            if not self._redis_failing:
                self._say(f"supervisor: Redis unreachable ({exc}); worker bookkeeping skipped until it returns")
            self._redis_failing = True
            return None
        self._redis_failing = False
        return result

    def _forget(self, hostname: str) -> ForgottenWorker:
        """Settle what a dead worker left and delete its liveness and registry entries, in one step
        (``Scheduler.forget_worker``, one Lua script).

        Its ready pools are marked unloaded, and a load it had started is ended as
        ``worker_lost`` (no backoff), which wakes every caller waiting on that load with 503
        ``worker_lost`` now rather than when its claim expires (``lease_ttl_ms``).

        Returns:
            What it held: the models whose pool was on it and those whose load it ran (nothing when Redis
            is unreachable).
        """
        def forget() -> ForgottenWorker:
            return self._scheduler.forget_worker(hostname, sorted(self._redis.hkeys(self._keys.models_meta)))
        return self._redis_call(forget) or ForgottenWorker([], [])

    def _settle(self, now: float) -> None:
        """Every ``SETTLE_EVERY_S``: settle what workers whose liveness key is gone left (one script,
        ``Scheduler.settle_lost_pools``), say it, and hand it to ``on_settled``."""
        if self._on_settled is None or now < self._settle_at:
            return
        self._settle_at = now + SETTLE_EVERY_S
        settled = self._redis_call(lambda: self._scheduler.settle_lost_pools(
            sorted(self._redis.hkeys(self._keys.models_meta))))
        if not settled or not (settled.pools or settled.loads):
            return
        self._say("workers stopped beating: " + "; ".join(
            [f"model {model_id} on {host or '?'} is unloaded" for model_id, host in settled.pools]
            + [f"the load of {model_id} on {host} is ended" for model_id, host in settled.loads]))
        try:
            self._on_settled(settled)
        except Exception as exc:  # the record is informative; supervision goes on
            self._say(f"recording the models of workers that stopped beating failed: {exc}")

    def _watch_boots(self, now: float) -> None:
        for slot in self._slots:
            if slot.proc is None or slot.alive:
                continue
            live_key = self._keys.worker_live(slot.hostname)
            if self._redis_call(lambda: self._redis.exists(live_key)):  # noqa: B023 (called at once)
                slot.alive = True
                self._say(f"worker {slot.hostname} is alive")
            elif now - slot.started_at > WORKER_BOOT_TIMEOUT_S and not slot.overdue_said:
                slot.overdue_said = True
                self._say(f"worker {slot.hostname} has not reported alive within {WORKER_BOOT_TIMEOUT_S:g} s; "
                          "requests no longer wait for it")

    def _starting(self, now: float) -> bool:
        """True while some position is booting a worker or restarts one within ``RESTART_GRACE_S``."""
        for slot in self._slots:
            if slot.restart_at is not None and slot.restart_at - now <= RESTART_GRACE_S:
                return True
            if slot.proc is not None and not slot.alive and now - slot.started_at <= WORKER_BOOT_TIMEOUT_S:
                return True
        return False

    def _advertise(self, now: float) -> None:
        if self._starting(now):
            if self._advertised_at is None or now - self._advertised_at >= STARTING_REFRESH_S:
                if self._redis_call(lambda: self._redis.set(self._keys.worker_starting, "serve",
                                                            px=STARTING_TTL_MS)) is not None:
                    self._advertised_at = now
        elif self._advertised_at is not None:
            if self._redis_call(lambda: self._redis.delete(self._keys.worker_starting)) is not None:
                self._advertised_at = None


WEB_BOOT_TIMEOUT_S = 120.0
"""How long (seconds) a web process serve (re)started may take to its first heartbeat (Django's and
daphne's start-up on a loaded machine) before it counts as stalled."""
WEB_STOP_WAIT_S = 10.0
"""How long serve waits for a killed web process tree to be gone before starting the replacement, in seconds."""


def kill_tree(pid: int, wait_s: float = WEB_STOP_WAIT_S) -> None:
    """SIGKILL process ``pid`` and its descendants (found before the kill), and wait up to ``wait_s``
    seconds for them to be gone. Processes already gone are skipped."""
    try:
        root = psutil.Process(pid)
        victims = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for victim in victims:
        try:
            victim.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(victims, timeout=wait_s)


class WebSupervisor:
    """Starts serve's web process and keeps it running: a web process that exits, or whose event loop
    stops turning (no heartbeat, ``audiosite.heartbeat``, for ``stall_timeout_s``; none within
    ``WEB_BOOT_TIMEOUT_S`` of its start), is killed with its process tree, what it held in the scheduler
    is let go at once (``on_gone``), and a new one is started after a :class:`RestartBackoff` delay.

    Args:
        spawn: ``spawn(heartbeat_fd) -> Popen`` starts one web process that writes its heartbeat to the
            inherited file descriptor ``heartbeat_fd`` (pass it in ``pass_fds`` and in the environment
            variable ``audiosite.heartbeat.HEARTBEAT_FD_ENV``).
        stall_timeout_s: a heartbeat older than this (seconds) is a stalled loop (``web_stall_timeout_ms``).
        first_delay_s, max_delay_s: the restart backoff.
        say: writes one line to serve's log.
        on_gone: ``on_gone(channel)`` once a web process is dead: ``channel`` is the scheduler channel
            its heartbeat announced ("" if it announced none).
        clock: monotonic seconds (``time.monotonic``).
    """

    def __init__(self, spawn: Callable[[int], subprocess.Popen], stall_timeout_s: float, first_delay_s: float,
                 max_delay_s: float, say: Callable[[str], None], on_gone: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self._spawn = spawn
        self.stall_timeout_s = stall_timeout_s
        self._backoff = RestartBackoff(first_delay_s, max_delay_s)
        self._say = say
        self._on_gone = on_gone
        self._clock = clock
        self.proc: subprocess.Popen | None = None
        self.channel = ""
        self.restarts = 0
        self._read_fd: int | None = None
        self._pending = b""
        self._started_at = 0.0
        self._last_beat: float | None = None
        self._restart_at: float | None = None

    def start(self) -> None:
        """Spawn the web process with a fresh heartbeat pipe."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        try:
            self.proc = self._spawn(write_fd)
        finally:
            os.close(write_fd)  # the child has its own copy; EOF here once it is gone
        self._read_fd = read_fd
        self._pending = b""
        self.channel = ""
        self._started_at = self._clock()
        self._last_beat = None
        self._restart_at = None

    def running(self) -> list[tuple[str, subprocess.Popen]]:
        """``[("web", process)]`` while a web process runs (or has exited unnoticed), else ``[]``."""
        return [("web", self.proc)] if self.proc is not None else []

    def tick(self, restart: bool = True) -> list[str]:
        """Read the heartbeats, notice an exit or a stall (killing a stalled process), start a due restart.

        Args:
            restart: schedule a replacement (False during serve's start-up, when an exit is fatal).

        Returns:
            One line per web process that exited or was killed for a stall since the last tick.
        """
        now = self._clock()
        lines = []
        if self.proc is not None:
            self._read_beats(now)
            if self.proc.poll() is not None:
                lines.append(self._gone(f"web process (pid {self.proc.pid}) exited with "
                                        f"{describe_exit(self.proc.returncode)}", now, restart))
            else:
                stalled = self._stalled(now)
                if stalled:
                    kill_tree(self.proc.pid)
                    try:
                        self.proc.wait(timeout=WEB_STOP_WAIT_S)
                    except subprocess.TimeoutExpired:  # stuck in the kernel: the replacement may fail to bind
                        self._say(f"web process (pid {self.proc.pid}) did not go within {WEB_STOP_WAIT_S:g} s "
                                  "of SIGKILL")
                    lines.append(self._gone(f"web process (pid {self.proc.pid}) {stalled}; killed it", now, restart))
        if self._restart_at is not None and self._restart_at <= now:
            self.restarts += 1
            self.start()
            assert self.proc is not None
            self._say(f"started web process (pid {self.proc.pid}) (restart {self.restarts})")
        return lines

    def close(self) -> None:
        """No restart from now on (serve is stopping)."""
        self._restart_at = None

    def _stalled(self, now: float) -> str:
        """Why the running process counts as stalled, or "" if it does not."""
        if self._last_beat is None:
            if now - self._started_at > WEB_BOOT_TIMEOUT_S:
                return f"sent no heartbeat within {WEB_BOOT_TIMEOUT_S:g} s of its start"
            return ""
        if now - self._last_beat > self.stall_timeout_s:
            return (f"sent no heartbeat for {now - self._last_beat:.1f} s (its event loop stalled; "
                    f"web_stall_timeout_ms={self.stall_timeout_s * 1000:.0f})")
        return ""

    def _read_beats(self, now: float) -> None:
        if self._read_fd is None:
            return
        while True:
            try:
                data = os.read(self._read_fd, 65536)
            except BlockingIOError:
                return
            if not data:  # EOF: the process is gone (its exit is noticed by poll)
                return
            self._pending += data
            *lines, self._pending = self._pending.split(b"\n")
            for line in lines:
                if line == b".":
                    self._last_beat = now
                elif line.startswith(b"chan "):
                    self.channel = line[5:].decode(errors="replace")

    def _gone(self, line: str, now: float, restart: bool) -> str:
        assert self.proc is not None
        uptime_s = now - self._started_at
        self.proc = None
        if self._read_fd is not None:
            os.close(self._read_fd)
            self._read_fd = None
        line += f" after {uptime_s:.1f} s"
        if restart:
            delay_s = self._backoff.next_delay_s(uptime_s)
            self._restart_at = now + delay_s
            line += f"; restarting it in {delay_s:g} s"
        self._say(line)
        try:
            self._on_gone(self.channel)
        except Exception as exc:  # best effort: the scheduler reclaims by TTL anyway
            self._say(f"letting go of what the web process held failed: {exc}")
        return line
