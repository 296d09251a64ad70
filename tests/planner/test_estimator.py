"""The 1F1B simulator against the closed forms and hand-computed schedules."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from resilientjob.planner import (
    PlannerError,
    pipeline_time,
    reroute_step_time,
    stage_peak_memory,
    symmetric_step_time,
    uniform_profile,
)


@given(
    stages=st.integers(1, 8),
    microbatches=st.integers(1, 24),
    forward=st.floats(0.001, 1.0),
    ratio=st.floats(0.5, 3.0),
)
def test_simulation_equals_eq9_on_symmetric_pipelines(
    stages: int, microbatches: int, forward: float, ratio: float
) -> None:
    backward = forward * ratio
    simulated = pipeline_time([forward] * stages, [backward] * stages, microbatches)
    assert simulated == pytest.approx(symmetric_step_time(stages, microbatches, forward, backward))


def test_unbalanced_pipeline_is_bound_by_its_slowest_stage() -> None:
    # Stage 1 takes 3 units per micro-batch (F+B); with many micro-batches it dominates.
    time = pipeline_time([1.0, 1.0], [1.0, 2.0], microbatches=20)
    assert 20 * 3.0 <= time <= 20 * 3.0 + 2 * 3.0


def test_single_stage_is_sum_of_work() -> None:
    assert pipeline_time([0.5], [1.5], microbatches=7) == pytest.approx(14.0)


def test_hand_computed_two_stage_schedule() -> None:
    # S=2, M=2, F=1, B=2: stage0 F0[0,1] F1[1,2]; stage1 F0[1,2] B0[2,4] F1[4,5] B1[5,7];
    # stage0 B0[4,6] B1[7,9]. Makespan 9 = (2 + 2 - 1) * 3.
    assert pipeline_time([1.0, 1.0], [2.0, 2.0], 2) == pytest.approx(9.0)


def test_send_time_delays_each_hop() -> None:
    base = pipeline_time([1.0, 1.0], [1.0, 1.0], 1)
    assert pipeline_time([1.0, 1.0], [1.0, 1.0], 1, send_s=[0.25]) == pytest.approx(base + 0.5)


def test_reroute_eq12_is_eq13_with_one_failure() -> None:
    eq12 = (4 + 8 - 1 + 8 / (3 - 1)) * (1.0 + 2.0)
    assert reroute_step_time(4, 8, 3, [0, 1, 0, 0], 1.0, 2.0) == pytest.approx(eq12)
    two = reroute_step_time(4, 8, 3, [0, 1, 1, 0], 1.0, 2.0)
    assert two == pytest.approx((4 + 8 - 1 + 2 * 8 / 2) * 3.0)
    with pytest.raises(PlannerError, match="lost all 3 replicas"):
        reroute_step_time(4, 8, 3, [3, 0, 0, 0], 1.0, 2.0)


def test_peak_memory_follows_eq14() -> None:
    profile = uniform_profile(8, param_bytes=10, optimizer_bytes=20, activation_bytes=3)
    # Stage 0 of 4 holds 4 micro-batches in flight; stage 3 holds 1.
    first = stage_peak_memory(profile, 0, 2, gpus=1, stage=0, num_stages=4, microbatches=16)
    last = stage_peak_memory(profile, 6, 8, gpus=1, stage=3, num_stages=4, microbatches=16)
    assert first == 2 * (10 + 10 + 20) + 4 * 2 * 3
    assert last == 2 * (10 + 10 + 20) + 1 * 2 * 3
    # Fewer micro-batches than stages: only those can be in flight.
    assert stage_peak_memory(profile, 0, 2, 1, 0, 4, 2) == 80 + 2 * 2 * 3
