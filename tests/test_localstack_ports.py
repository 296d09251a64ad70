"""The local stack's free ports stay free: outside the kernel's ephemeral range, never handed out twice."""

from __future__ import annotations

import socket

import pytest

from resilientjob.localstack import ports


def test_a_free_port_is_below_the_ephemeral_range_bindable_and_not_given_twice() -> None:
    start = ports._ephemeral_start()
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == len(picked)
    for port in picked:
        assert 1024 <= port < start
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_something_listens_on_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        busy = int(listening.getsockname()[1])
        fresh = ports.free_port()
        offered = iter([busy, fresh])
        monkeypatch.setattr(ports, "_given", set())  # `fresh` was handed out just above
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: 65535)
        monkeypatch.setattr(ports._pick, "randrange", lambda low, high: next(offered))
        assert ports.free_port() == fresh
