"""Fixtures for the control-plane tests (real Redis, real HTTP, real operator process).

`stack` gives a test the API client, the Redis URL and the operator: on the emulator by default, on the
cluster of RJOB_KUBECONFIG when that is set (see `_rjob_stack`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import kopf
import pytest
from _rjob_stack import (
    KUBECONFIG,
    NAMESPACE,
    REAL_CLUSTER,
    Kube,
    Operator,
    Stack,
    api_server,
    connection_from_kubeconfig,
)
from _support import redis_server, rjob_local, rjob_ok


@pytest.fixture
def local(tmp_path: Path) -> Iterator[Path]:
    """`rjob local up` under a fresh state folder (the embedded stack the way a user starts it); `down`
    after the test."""
    state = tmp_path / "local"
    rjob_ok(state, "up")
    try:
        yield state
    finally:
        rjob_local(state, "down")


@pytest.fixture
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield url


@pytest.fixture
async def stack(redis_url: str, tmp_path: Path) -> AsyncIterator[Stack]:
    log = tmp_path / "operator.log"
    if REAL_CLUSTER:
        kube = Kube(connection_from_kubeconfig(KUBECONFIG))
        operator = Operator(None, redis_url, log, kubeconfig=KUBECONFIG, namespace=NAMESPACE)
        try:
            await kube.install_crd()
            operator.start()
            yield Stack(kube, redis_url, operator)
            await kube.delete_jobs()
        finally:
            operator.stop()
            await kube.close()
        return
    async with api_server() as (_, url):
        kube = Kube(kopf.ConnectionInfo(server=url, insecure=True, default_namespace=NAMESPACE))
        operator = Operator(url, redis_url, log)
        operator.start()
        try:
            yield Stack(kube, redis_url, operator)
        finally:
            operator.stop()
            await kube.close()
