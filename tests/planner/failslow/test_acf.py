"""Iteration times from collective-call streams: period by ACF, error against the true iteration times."""

from __future__ import annotations

import numpy as np
import pytest

from resilientjob.planner import PlannerError
from resilientjob.planner.failslow import CollectiveCall, acf, encode, iteration_times, recurring_period
from resilientjob.planner.failslow.tracegen import call_stream


def _per_iteration_error(estimated: np.ndarray, truth: np.ndarray) -> float:
    # The stream starts mid-iteration, so estimate j spans true iterations j and j + 1: take the alignment
    # (offset 0 or 1) that fits best, then the mean relative error per iteration.
    n = len(estimated)
    return min(float(np.mean(np.abs(estimated - truth[k : k + n]) / truth[k : k + n])) for k in (0, 1))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("calls", [1, 4, 12, 30])
@pytest.mark.parametrize("jitter_cv", [0.005, 0.02, 0.05])
def test_period_and_mean_iteration_time_within_one_percent(seed: int, calls: int, jitter_cv: float) -> None:
    stream = call_stream(np.random.default_rng(seed), 150, calls, base_s=2.5, jitter_cv=jitter_cv)
    result = iteration_times(stream.calls)
    assert result.period == calls
    truth = stream.iteration_s
    assert abs(result.mean_s - truth.mean()) / truth.mean() <= 0.01
    if jitter_cv <= 0.02:
        # Each estimate blends two neighbouring iterations, so per-iteration error follows the jitter.
        assert _per_iteration_error(result.times_s, truth) <= 0.01


def test_slowdown_shows_in_the_iteration_times() -> None:
    rng = np.random.default_rng(7)
    stream = call_stream(rng, 100, 8, base_s=1.0, jitter_cv=0.005)
    # Stretch every timestamp after the 50th iteration's start by 1.5x: the job got 50% slower there.
    cut = stream.calls[8 * 50].timestamp_s
    stretched = [
        CollectiveCall(
            c.op, c.group, c.timestamp_s if c.timestamp_s < cut else cut + 1.5 * (c.timestamp_s - cut)
        )
        for c in stream.calls
    ]
    times = iteration_times(stretched).times_s
    assert np.median(times[:40]) == pytest.approx(1.0, rel=0.01)
    assert np.median(times[-40:]) == pytest.approx(1.5, rel=0.01)


def test_acf_is_one_at_the_period_and_low_elsewhere() -> None:
    codes = encode(["ar", "ag", "rs", "ar"] * 50)
    values = acf(codes, 8)
    assert values[3] == pytest.approx(1.0)
    assert values[7] == pytest.approx(1.0)
    assert max(values[[0, 1, 2, 4, 5, 6]]) < 0.5
    assert recurring_period(codes) == 4


def test_single_identity_stream_has_period_one() -> None:
    calls = [CollectiveCall("allreduce", "dp", float(t)) for t in range(10)]
    result = iteration_times(calls)
    assert result.period == 1
    assert np.allclose(result.times_s, 1.0)


def test_aperiodic_stream_is_rejected() -> None:
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 20, 400)
    with pytest.raises(PlannerError, match="no recurring period") as info:
        recurring_period(codes, max_lag=50)
    assert info.value.field == "calls"


def test_bad_streams_name_the_field() -> None:
    with pytest.raises(PlannerError, match="non-decreasing"):
        iteration_times([CollectiveCall("a", "g", 2.0), CollectiveCall("a", "g", 1.0)])
    with pytest.raises(PlannerError, match="two full periods"):
        iteration_times([CollectiveCall(op, "g", float(t)) for t, op in enumerate("abcab")], max_lag=3)
    with pytest.raises(PlannerError) as info:
        CollectiveCall("", "g", 0.0)
    assert info.value.field == "op"
