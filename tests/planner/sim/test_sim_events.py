"""Event sources: availability traces (format and errors), Poisson fail-stops, Falcon-shaped fail-slows."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from resilientjob.planner import PlannerError
from resilientjob.planner.sim import (
    SPOT_TRACE,
    FailSlow,
    FailSlowKind,
    every_interval_failures,
    falcon_failslows,
    load_trace,
    parse_trace,
    poisson_failures,
)
from resilientjob.planner.sim.events import FALCON_MEAN_DURATION_S


def test_trace_parses_header_comments_and_sorts() -> None:
    changes = parse_trace(
        ["time_s,node,state", "# a comment", "", "20,1,up", "10.5, 1 ,DOWN  # preempted"], 4
    )
    assert [(c.time_s, c.node, c.up) for c in changes] == [(10.5, 1, False), (20.0, 1, True)]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("10,1", "expected time_s,node,up|down"),
        ("ten,1,up", "time_s must be a number"),
        ("-1,1,up", "time_s must be finite and >= 0"),
        ("10,x,up", "node must be an integer"),
        ("10,9,up", "node 9 is outside"),
        ("10,1,sideways", "state must be up or down"),
    ],
)
def test_trace_errors_name_the_line(line: str, message: str) -> None:
    with pytest.raises(PlannerError) as info:
        parse_trace(["time_s,node,state", "5,0,down", line], 4)
    assert info.value.field == "trace line 3"
    assert message in info.value.message


def test_missing_trace_file_names_the_field(tmp_path: object) -> None:
    with pytest.raises(PlannerError) as info:
        load_trace("/nonexistent/trace.csv", 4)
    assert info.value.field == "trace"


def test_shipped_spot_trace_preempts_about_every_eight_minutes() -> None:
    changes = load_trace(SPOT_TRACE, 32)
    downs = [c for c in changes if not c.up]
    gap_min = 12 * 60 / len(downs)
    assert 7.0 <= gap_min <= 10.0
    # Every up follows a down of the same node: the trace is consistent.
    state = dict.fromkeys(range(32), True)
    for change in changes:
        assert state[change.node] != change.up
        state[change.node] = change.up


def test_poisson_failures_are_seeded_and_have_the_asked_rate() -> None:
    first = poisson_failures(np.random.default_rng(7), 4000, 2, 0.1, 3600.0)
    again = poisson_failures(np.random.default_rng(7), 4000, 2, 0.1, 3600.0)
    assert first == again
    # P(node fails within an hour) = 1 - exp(-G r) with G = 2 devices at r = 0.1 per device-hour.
    expected = 4000 * (1 - math.exp(-0.2))
    assert abs(len(first) - expected) < 4 * math.sqrt(expected)
    assert [f.time_s for f in first] == sorted(f.time_s for f in first)
    assert len({f.node for f in first}) == len(first)


def test_negative_failure_rate_is_refused() -> None:
    with pytest.raises(PlannerError, match="failure_rate"):
        poisson_failures(np.random.default_rng(0), 4, 1, -0.1, 10.0)


def test_every_interval_failures_stop_at_half() -> None:
    stops = every_interval_failures(np.random.default_rng(3), 30, 600.0, until_alive=15)
    assert len(stops) == 15 and len({s.node for s in stops}) == 15


def test_falcon_failslows_are_shaped_like_the_characterisation() -> None:
    slows = falcon_failslows(np.random.default_rng(11), 200, 0.5, 20 * 3600.0)
    links = [s for s in slows if s.kind is FailSlowKind.LINK]
    computes = [s for s in slows if s.kind is FailSlowKind.COMPUTE]
    assert len(links) > 2 * len(computes)  # network congestion dominates (Falcon Table 1)
    for kind, group in ((FailSlowKind.LINK, links), (FailSlowKind.COMPUTE, computes)):
        mean = statistics.fmean(s.duration_s for s in group)
        assert 0.7 * FALCON_MEAN_DURATION_S[kind] < mean < 1.3 * FALCON_MEAN_DURATION_S[kind]
    assert all(1.1 <= s.severity <= 6.0 for s in slows)


def test_failslow_validates_on_construction() -> None:
    with pytest.raises(PlannerError, match="severity"):
        FailSlow(0.0, 1, FailSlowKind.COMPUTE, 0.5, 10.0)
    with pytest.raises(PlannerError, match="duration_s"):
        FailSlow(0.0, 1, FailSlowKind.LINK, 2.0, 0.0)
