"""Separate hosts on one machine: each in its own network namespace with its own address on a
bridge, so multi-node tests cross a real network boundary (own address, own loopback, a link
that can be cut). Needs root and iproute2; CI runs as root."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

SUBNET = "10.213.7"


def available() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


def ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, timeout=30)


@dataclass(frozen=True)
class Host:
    netns: str
    address: str
    ifname: str  # its side of the link, for GLOO_SOCKET_IFNAME
    link: str  # the bridge's side: down is a cut network cable

    def command(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def cut(self) -> None:
        ip("link", "set", self.link, "down")

    def reconnect(self) -> None:
        ip("link", "set", self.link, "up")


class Network:
    """``count`` hosts on a bridge; this machine is ``gateway`` on it (Redis and the api)."""

    def __init__(self, count: int) -> None:
        tag = str(os.getpid() % 100000)
        self.bridge = f"tyb{tag}"
        self.gateway = f"{SUBNET}.1"
        self.hosts = [Host(f"ty{tag}h{i}", f"{SUBNET}.{10 + i}", f"ty{tag}p{i}", f"ty{tag}v{i}") for i in range(count)]

    def __enter__(self) -> Network:
        self._remove()
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for h in self.hosts:
            ip("netns", "add", h.netns)
            ip("link", "add", h.link, "type", "veth", "peer", "name", h.ifname)
            ip("link", "set", h.link, "master", self.bridge)
            ip("link", "set", h.link, "up")
            ip("link", "set", h.ifname, "netns", h.netns)
            ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", h.ifname)
            ip("-n", h.netns, "link", "set", h.ifname, "up")
            ip("-n", h.netns, "link", "set", "lo", "up")
        return self

    def __exit__(self, *_: object) -> None:
        self._remove()

    def _remove(self) -> None:
        for h in self.hosts:
            ip("netns", "del", h.netns, check=False)  # takes its end of the veth, and so the pair
        ip("link", "del", self.bridge, check=False)
