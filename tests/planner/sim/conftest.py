"""Fixtures for the simulator's tests: the stub planner (tests only) and a small profile."""

from __future__ import annotations

import pytest
from sim_stub_planner import StubPlanner

from resilientjob.planner import ModelProfile, uniform_profile


@pytest.fixture
def stub() -> StubPlanner:
    return StubPlanner()


@pytest.fixture
def small_profile() -> ModelProfile:
    return uniform_profile(8)
