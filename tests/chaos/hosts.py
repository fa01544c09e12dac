"""Simulated hosts for multi-host tests: each "host" is a set of processes with its own host id
(`OMNIFLOW_HOST_ID`) in their own process groups, and — where the machine allows it (root, the
`ip` tool, network namespaces) — its own network namespace that reaches Redis only over a veth
pair, as a second machine would over the network.

`NetLab.unavailable()` says why namespaces cannot be used here (then hosts are process groups
only); `NetLab` creates the namespaces and removes them (and their veth pairs) on `stop()`.
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess
from dataclasses import dataclass, field

IP = shutil.which("ip") or "/usr/sbin/ip"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([IP, *args], capture_output=True, text=True, check=check, timeout=10)


@dataclass
class Netns:
    """One network namespace and its link to the root namespace."""

    name: str
    veth_root: str
    veth_ns: str
    root_ip: str        # the root side of the veth: what processes in the namespace connect to
    ns_ip: str

    def wrap(self, argv: list[str]) -> list[str]:
        return [IP, "netns", "exec", self.name, *argv]


@dataclass
class Host:
    """A simulated machine: a host id, the Redis URL it uses, and optionally a namespace."""

    name: str
    redis_url: str
    netns: Netns | None = None

    @property
    def host_id(self) -> str:
        return f"host-{self.name}"

    def argv(self, argv: list[str]) -> list[str]:
        return self.netns.wrap(argv) if self.netns else argv

    def env(self) -> dict[str, str]:
        return {"OMNIFLOW_HOST_ID": self.host_id, "OMNIFLOW_REDIS_URL": self.redis_url}


@dataclass
class NetLab:
    """`count` network namespaces, each with a veth pair to the root namespace (a /30 each)."""

    count: int
    namespaces: list[Netns] = field(default_factory=list)

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be used on this machine, or None when they can."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        if not os.path.exists(IP):
            return "the `ip` tool (iproute2) is not installed"
        probe = f"ofprobe{os.getpid() % 100000}"
        created = _ip("netns", "add", probe, check=False)
        if created.returncode != 0:
            return f"`ip netns add` failed: {created.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    def start(self) -> NetLab:
        tag = f"{os.getpid() % 10000}{random.randrange(100):02d}"
        used = _ip("-4", "-o", "addr").stdout
        # a /24 no interface uses yet (other test sessions may run labs at the same time)
        third = next(n for n in random.sample(range(256), 256) if f"10.213.{n}." not in used)
        try:
            for i in range(self.count):
                ns = Netns(name=f"of{tag}n{i}", veth_root=f"of{tag}r{i}", veth_ns=f"of{tag}h{i}",
                           root_ip=f"10.213.{third}.{4 * i + 1}", ns_ip=f"10.213.{third}.{4 * i + 2}")
                _ip("netns", "add", ns.name)
                self.namespaces.append(ns)
                _ip("link", "add", ns.veth_root, "type", "veth", "peer", "name", ns.veth_ns)
                _ip("link", "set", ns.veth_ns, "netns", ns.name)
                _ip("addr", "add", f"{ns.root_ip}/30", "dev", ns.veth_root)
                _ip("link", "set", ns.veth_root, "up")
                _ip("netns", "exec", ns.name, IP, "addr", "add", f"{ns.ns_ip}/30", "dev", ns.veth_ns)
                _ip("netns", "exec", ns.name, IP, "link", "set", ns.veth_ns, "up")
                _ip("netns", "exec", ns.name, IP, "link", "set", "lo", "up")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Remove every namespace and veth pair (idempotent; kill their processes first)."""
        for ns in self.namespaces:
            _ip("link", "del", ns.veth_root, check=False)     # deletes the pair
            _ip("netns", "del", ns.name, check=False)
        self.namespaces = []

    def bind_addresses(self) -> list[str]:
        """The root-side addresses a server must listen on to be reached from every namespace."""
        return [ns.root_ip for ns in self.namespaces]
