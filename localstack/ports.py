"""Free TCP ports for the local stack's servers and the tests' own.

A port picked by binding port 0 and then released lies in the kernel's ephemeral range, where any outgoing
connection on the machine (the operator's to the API server, a worker's to Redis) or another bind to port 0
may take it before its owner binds it again: the owner then fails with EADDRINUSE (CI saw the operator's
metrics server do so, and kopf's startup retried for a minute). Ports below that range are never handed out
by the kernel, so one picked there stays free until a caller of this function binds it."""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]

_LOWEST = 20000
"""Below this are well-known services' ports (Redis 6379, a local API server 6443, Prometheus 9090...)."""
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_ATTEMPTS = 64
_pick = random.SystemRandom()  # not `random`: a test that seeds it would make every process pick alike
_given: set[int] = set()
"""Ports this process handed out: two picks before either is bound must not be the same port."""


def _ephemeral_start() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default, and what other systems start near


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("0.0.0.0", port))  # every address: the metrics servers bind all of them
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port that nothing uses now on loopback, below the kernel's ephemeral range where it can be
    (the module's docstring says why); else one the kernel picks."""
    start = _ephemeral_start()
    if start - _LOWEST >= 1000:
        for _ in range(_ATTEMPTS):
            port = _pick.randrange(_LOWEST, start)
            if port not in _given and _bindable(port):
                _given.add(port)
                return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
