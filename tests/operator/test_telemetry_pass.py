"""The telemetry pass's Event throttle for dismissed slow reports."""

from __future__ import annotations

from resilientjob.operator._telemetry_pass import EventThrottle


def test_one_event_per_interval_and_the_next_counts_those_held_back() -> None:
    throttle = EventThrottle(interval_s=60)
    assert throttle.admit("node 1: within 1.5x", now=100.0) == "node 1: within 1.5x"
    assert throttle.admit("node 2: within 1.5x", now=130.0) is None
    assert throttle.admit("node 3: within 1.5x", now=159.9) is None
    admitted = throttle.admit("node 4: within 1.5x", now=160.0)
    assert admitted == "node 4: within 1.5x (2 more since the last such Event: see the operator's log)"
    assert throttle.admit("node 5: within 1.5x", now=221.0) == "node 5: within 1.5x"
