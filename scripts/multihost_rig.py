"""Run audiosite over separate hosts on this machine: Linux network namespaces on a private bridge
(the rig of tests/test_multihost.py), each process configured by environment as docs/operations.md
("Scale-out") says, loopback down on every host.

    sudo .venv/bin/python scripts/multihost_rig.py            # up, check, measure, down
    sudo .venv/bin/python scripts/multihost_rig.py --hold     # ... and stay up until Ctrl-C

Hosts: db (PostgreSQL), redis, relay (the web processes' path to Redis, where --latency-ms adds
delay), proxy (nginx with deploy/nginx/audiosite.conf), web1, web2 (daphne), w1, w2 (Celery workers).
It starts them in the documented order, sends one VAD request through the proxy from outside every
namespace, measures the web processes' Redis round trips per request (with 0 ms and with
--latency-ms between web and Redis) and prints them; everything it made (namespaces, bridge,
processes, the database folder) is removed when it ends, also on an error or Ctrl-C. Needs root,
``ip`` (iproute2), nginx and setpriv; exits 2 with the reason when network namespaces are not
permitted. docs/operations.md, "Running over several hosts", explains the output.
"""
from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUESTS = 20


def _django(var_dir: Path) -> None:
    """Settings for this process's own imports (the rig's processes get their own environment)."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "audiosite.settings")
    os.environ.setdefault("AUDIOSITE_SECRET_KEY", secrets.token_urlsafe(50))
    os.environ["AUDIOSITE_VAR_DIR"] = str(var_dir)
    import django
    django.setup()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hold", action="store_true", help="stay up until Ctrl-C after the checks")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="delay between web and Redis (default 20)")
    parser.add_argument("--jitter-ms", type=float, default=5.0, help="± uniform jitter of that delay (default 5)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="audiosite-rig-") as tmp:
        return _run(args, Path(tmp))


def _run(args: argparse.Namespace, tmp: Path) -> int:
    _django(tmp / "script-var")
    from tests.support.audio import TINY
    from tests.support.multihost import NGINX, SETPRIV, run_rig
    from tests.support.netns import netns_problem

    problem = netns_problem() or (None if NGINX else "no nginx (apt-get install nginx-light)") or \
        (None if SETPRIV else "no setpriv (util-linux)")
    if problem:
        print(f"multihost rig: cannot run here: {problem}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the rig's cleanup runs on SIGTERM too
    (tmp / "hosts").mkdir()
    rig_gen = run_rig(tmp / "hosts", [{"id": "vad", "family": "silero_vad", "task": "vad"}])
    rig = next(rig_gen)
    try:
        for name, host in rig.hosts.items():
            print(f"{name:6} {host.ip:15} ip netns exec {host.ns} …")
        print(f"proxy: {rig.proxy_url}  (bridge {rig.net.bridge}, subnet {rig.net.subnet})")
        web1 = rig.members["web1"].url
        rig.timed_requests(rig.proxy_url, "vad", 2, TINY)
        print("a VAD request through the proxy: 200")
        base, base_trips = rig.timed_requests(web1, "vad", REQUESTS, TINY)
        rig.relay(f"delay {args.latency_ms} {args.jitter_ms}")
        try:
            slow, slow_trips = rig.timed_requests(web1, "vad", REQUESTS, TINY)
        finally:
            rig.relay("delay 0 0")
        growth_ms = (statistics.median(slow) - statistics.median(base)) * 1000
        print(f"web->Redis round trips per VAD request (n={REQUESTS}): {base_trips:.2f} at 0 ms, "
              f"{slow_trips:.2f} at {args.latency_ms:g} ± {args.jitter_ms:g} ms")
        print(f"median wall time: {statistics.median(base) * 1000:.1f} ms -> {statistics.median(slow) * 1000:.1f} ms "
              f"(+{growth_ms:.1f} ms = {growth_ms / args.latency_ms:.2f} delays)")
        if args.hold:
            print("up; Ctrl-C stops and removes everything")
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the clean-up short
            signal.signal(signum, signal.SIG_IGN)
        print("stopping; removing the namespaces, the bridge and the database folder")
        rig_gen.close()  # stops the processes, removes the namespaces, bridge and database folder
    return 0


if __name__ == "__main__":
    sys.exit(main())
