"""Hosts as Linux network namespaces on one private bridge, and the faults a network can have
between them (a host's link cut, one host cut off from another).

Each :class:`Host` is a network namespace ``as<id>-<name>`` joined to the bridge ``asb<id>`` by a veth
pair (its end inside the namespace is ``eth0``); ``<id>`` is random per :class:`Network`, so two runs on
one machine never share a name, and the /24 subnet is picked among those no route of the machine uses.
The bridge itself has the subnet's ``.1`` address: the machine outside every namespace (the test, an
operator's client) reaches each host through it. Loopback stays **down** inside every namespace, so a
process that relies on ``127.0.0.1`` or ``localhost`` fails instead of passing unnoticed.

Needs root and ``ip`` (iproute2); :func:`netns_problem` says why a machine cannot, for a skip.
"""
from __future__ import annotations

import ipaddress
import os
import random
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

IP = shutil.which("ip") or ("/usr/sbin/ip" if os.path.exists("/usr/sbin/ip") else None)
COMMAND_TIMEOUT_S = 20.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    assert IP, "no ip binary"
    done = subprocess.run([IP, *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def netns_problem() -> str | None:
    """Why network namespaces cannot be made here (not root, no ``ip`` binary, the kernel or the
    container refuses ``ip netns add``), or None when they can (a probe namespace is made and removed)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not IP:
        return "no `ip` program (apt-get install iproute2)"
    probe = f"asprobe{secrets.token_hex(3)}"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"`ip netns add` is not permitted here: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0/13 that overlaps no address or route of the machine (the root namespace)."""
    used = [ipaddress.ip_network(word, strict=False)
            for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines()
            for word in line.split()[:1] if word[0].isdigit()]
    used += [ipaddress.ip_interface(line.split()[3]).network
             for line in _ip("-4", "-o", "addr", "show").stdout.splitlines()]
    for _ in range(200):
        candidate = ipaddress.ip_network(f"10.{random.randint(200, 207)}.{random.randint(0, 255)}.0/24")
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise RuntimeError("no free /24 in 10.200.0.0/13")


@dataclass
class Host:
    """One namespace: ``name`` (``db``, ``web1``…), ``ns`` (the namespace), ``ip`` (its address on the
    bridge), ``link`` (the bridge's end of its veth pair, which :meth:`Network.cut` takes down)."""

    name: str
    ns: str
    ip: str
    link: str
    blocked: list[str] = field(default_factory=list)

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host (``ip netns exec``, which execs it: the pid is the program's)."""
        assert IP
        return [IP, "netns", "exec", self.ns, *argv]


class Network:
    """The bridge and one namespace per host name; :meth:`create` makes them, :meth:`remove` deletes
    them all (also after a partial create), whatever runs inside (kill the processes first: a process
    keeps its namespace alive, but nothing can reach it once the veth is gone)."""

    def __init__(self, names: list[str]):
        self.id = secrets.token_hex(3)
        self.bridge = f"asb{self.id}"
        self.subnet = _free_subnet()
        addresses = list(self.subnet.hosts())
        self.gateway = str(addresses[0])
        self.hosts = {name: Host(name, f"as{self.id}-{name}", str(addresses[10 + i]), f"v{self.id}h{i}")
                      for i, name in enumerate(names)}
        self._made: list[str] = []

    def create(self) -> None:
        """Make the bridge (``.1`` of the subnet, up) and every host: its namespace, a veth pair
        (``eth0`` inside, up, with the host's /24 address), loopback left down."""
        prefix = self.subnet.prefixlen
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append("bridge")
        _ip("addr", "add", f"{self.gateway}/{prefix}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts.values():
            _ip("netns", "add", host.ns)
            self._made.append(host.ns)
            peer = f"{host.link}p"
            _ip("link", "add", host.link, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", host.ns)
            _ip("link", "set", host.link, "master", self.bridge)
            _ip("link", "set", host.link, "up")
            _ip("-n", host.ns, "link", "set", peer, "name", "eth0")
            _ip("-n", host.ns, "addr", "add", f"{host.ip}/{prefix}", "dev", "eth0")
            _ip("-n", host.ns, "link", "set", "eth0", "up")

    def remove(self) -> None:
        """Delete every namespace and the bridge made so far (their veths go with them). Idempotent."""
        for name in reversed(self._made):
            if name == "bridge":
                _ip("link", "del", self.bridge, check=False)
            else:
                _ip("netns", "del", name, check=False)
        self._made.clear()

    # -- faults --
    def cut(self, name: str) -> None:
        """Take host ``name``'s link down at the bridge: its packets go nowhere, nobody is told
        (a pulled cable, a dead switch port)."""
        _ip("link", "set", self.hosts[name].link, "down")

    def restore(self, name: str) -> None:
        """Bring host ``name``'s link back up (the bridge forwards at once: no STP)."""
        _ip("link", "set", self.hosts[name].link, "up")

    def block(self, name: str, other: str) -> None:
        """Cut host ``name`` off host ``other`` only, as a firewall that rejects: a ``prohibit`` route
        in ``name`` makes each new connection to ``other`` fail at once (EACCES). Connections already
        open are left to the caller (reset them from the other side, or they wait on the dead path)."""
        host, target = self.hosts[name], self.hosts[other]
        _ip("-n", host.ns, "route", "add", "prohibit", f"{target.ip}/32")
        host.blocked.append(target.ip)

    def unblock(self, name: str, other: str) -> None:
        """Undo :meth:`block`."""
        host, target = self.hosts[name], self.hosts[other]
        _ip("-n", host.ns, "route", "del", "prohibit", f"{target.ip}/32")
        host.blocked.remove(target.ip)
