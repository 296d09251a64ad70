"""A report's onset on the operator's clock (`operator/_failslow_clock.py`): an agent whose clock is off
neither passes `minDurationS` at once nor holds it back, and a `slowed_s` that reaches back past the node's
own last step before the onset is cut to it."""

from __future__ import annotations

import pytest
from test_straggler_window import _node_3_slowed, _report_and_open

from resilientjob.operator._failslow_clock import MAX_DELIVERY_S, NodeClocks
from resilientjob.protocol.messages import IterationRecord, SlowKind, SlowReport

T0 = 1000.0
"""The operator's clock at step 0: step n ends at T0 + n."""


def _steps(clocks: NodeClocks, node: int, steps: range, skew: float, delay: float = 0.05) -> None:
    """One-second steps whose records the node sends at its clock (the operator's + `skew`)."""
    for step in steps:
        sent = T0 + step + skew
        record = IterationRecord(node=node, generation=0, step=step, seconds=1.0, samples=1, sent_at=sent)
        clocks.observe(record, arrival=T0 + step + delay)


def _report(step: int, onset: int, slowed_s: float, skew: float = 0.0, level_s: float = 1.0) -> SlowReport:
    return SlowReport(
        node=3,
        generation=0,
        step=step,
        onset_step=onset,
        slowdown=2.0,
        baseline_s=level_s / 2,
        level_s=level_s,
        kind=SlowKind.COMPUTE,
        detected_at=T0 + step + skew,
        slowed_s=slowed_s,
    )


@pytest.mark.parametrize("skew", [-120.0, -3.0, 0.0, 3.0, 120.0])
def test_the_onset_is_on_the_operators_clock_whatever_the_agents_reads(skew: float) -> None:
    clocks = NodeClocks()
    _steps(clocks, 3, range(100), skew)
    # The slowdown began when step 89 ended (its record went at 89), reported at step 94 after 5 s.
    onset = clocks.onset(_report(94, onset=90, slowed_s=5.0, skew=skew))
    if abs(skew) > MAX_DELIVERY_S or skew > 0:
        assert onset == pytest.approx(T0 + 89.0 + 0.05)  # corrected (by the offset and shortest delivery)
    else:
        assert onset == pytest.approx(T0 + 89.0 + skew)  # within delivery: the clocks are taken to agree


def test_an_agent_clock_ahead_by_a_second_is_seen_as_ahead() -> None:
    """Records that arrive before they were sent come from a clock ahead: no delivery explains that."""
    clocks = NodeClocks()
    _steps(clocks, 3, range(10), skew=1.0)
    assert clocks.offset(3) == pytest.approx(-0.95)
    _steps(clocks, 4, range(10), skew=-1.0)  # behind by a second: a delivery could take that long
    assert clocks.offset(4) == 0.0
    assert clocks.offset(5) == 0.0  # no record yet


def test_a_slowed_s_past_the_nodes_own_steps_is_cut_to_them() -> None:
    clocks = NodeClocks()
    _steps(clocks, 3, range(100), skew=0.0)
    # 5 s honestly (steps 90..94), within the one-step leeway of the agent's sending: kept.
    assert clocks.lasted(_report(94, onset=90, slowed_s=5.0)) == pytest.approx(5.0)
    assert clocks.lasted(_report(94, onset=90, slowed_s=5.9)) == pytest.approx(5.9)
    # A year, or an hour: cut to the time since its last step before the onset was sent, and a step.
    assert clocks.lasted(_report(94, onset=90, slowed_s=86400.0 * 365)) == pytest.approx(6.0)
    assert clocks.onset(_report(94, onset=90, slowed_s=3600.0)) >= T0 + 88.0
    # Without the steps before the onset kept, the report's own figures bound it.
    fresh = NodeClocks()
    assert fresh.lasted(_report(94, onset=90, slowed_s=3600.0, level_s=0.5)) == pytest.approx(2.0)
    assert fresh.lasted(_report(94, onset=90, slowed_s=0.0, level_s=0.5)) == pytest.approx(2.0)
    assert fresh.lasted(_report(94, onset=90, slowed_s=1.5, level_s=0.5)) == pytest.approx(1.5)


@pytest.mark.parametrize(("slowed_s", "opened"), [(5.0, 8), (3600.0, 8)])
def test_min_duration_is_not_passed_by_a_claim_the_steps_do_not_bear_out(
    slowed_s: float, opened: int
) -> None:
    """The tracker dates the report through the node's steps: a `slowed_s` of an hour opens no sooner than
    the five seconds its steps took (9 s of `minDurationS` from the onset, as measured)."""
    job, onset = _node_3_slowed(min_duration_s=9.0, steps=5)
    assert _report_and_open(job, onset, said=onset, level_s=0.3, slowed_s=slowed_s) == opened
