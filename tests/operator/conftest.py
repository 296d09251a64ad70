"""Fixtures for the control-plane tests (real Redis, real HTTP, real operator process)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from _rjob_stack import Operator, api_server, redis_server


@pytest.fixture
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield url


@pytest.fixture
async def cluster(redis_url: str, tmp_path: Path) -> AsyncIterator[tuple[object, str, Operator]]:
    async with api_server() as (emulator, url):
        operator = Operator(url, redis_url, tmp_path / "operator.log")
        operator.start()
        try:
            yield emulator, url, operator
        finally:
            operator.stop()
