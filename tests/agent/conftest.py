"""Fixtures for the training runtime tests: a tiny GPT job and its exact byte profile."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _support import rjob_ok

from resilientjob.agent.models import load_model
from resilientjob.agent.profiler import measure_profile
from resilientjob.agent.worker import JobConfig
from resilientjob.planner.profile import ModelProfile

GPT8 = {"layers": 8, "hidden": 32, "heads": 2, "vocab": 32, "seq_len": 16}


@pytest.fixture(scope="session")
def gpt_profile() -> ModelProfile:
    """Bytes are exact (what the runtime sends); times are nominal so plans do not depend on CPU load."""
    return measure_profile(load_model("gpt", **GPT8), timed=False)


def _job_config(**overrides: object) -> JobConfig:
    options: dict[str, object] = {
        "model": "gpt",
        "model_options": dict(GPT8),
        "num_samples": 128,
        "steps": 8,
        # A bound on stalls only: a peer's death ends every wait through the failure notice at once. At 3 s a
        # switch to a joining node on a loaded two-core CI host kept its peers waiting past it (the joiner
        # imported torch._dynamo with its first AdamW then, now done before it joins: `optim.warm_up`), and
        # the harness does not re-form a world stopped so (`launcher.WorldStopped`).
        "collective_timeout_s": 10.0,
    }
    options.update(overrides)
    return JobConfig.plain(**options)  # type: ignore[arg-type]


@pytest.fixture
def job_config() -> Callable[..., JobConfig]:
    """A tiny-GPT job config factory; keyword arguments override fields."""
    return _job_config


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Path]:
    """`rjob local up` under the test's directory (real API server over HTTP, Redis, operator, kubelet)."""
    state = tmp_path / "local"
    rjob_ok(state, "up")
    try:
        yield state
    finally:
        rjob_ok(state, "down")
