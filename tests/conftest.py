"""Shared fixtures."""

from __future__ import annotations

import pytest

from resilientjob.planner import ClusterSpec, JobSpec, ModelProfile, uniform_profile


@pytest.fixture
def profile9() -> ModelProfile:
    """The nine equal layers of Odyssey's Fig. 3."""
    return uniform_profile(9)


@pytest.fixture
def cluster9() -> ClusterSpec:
    return ClusterSpec(nodes=9, gpus_per_node=1)


@pytest.fixture
def job() -> JobSpec:
    return JobSpec(global_batch=48, microbatch_size=1, fault_tolerance=1)
