"""The telemetry pass: its Event throttle for dismissed slow reports and validation requests, and what counts
as the job's progress."""

from __future__ import annotations

import logging

import pytest
import redis.asyncio as aioredis
from test_failslow_decisions import PROFILE, grid_plan
from test_failslow_localisation import profile, report, result, rising_job

from resilientjob.agent.telemetry import Telemetry
from resilientjob.operator._failslow import FailSlowTracker
from resilientjob.operator._redis_state import JobRedis, Published, announcement
from resilientjob.operator._telemetry_pass import EventThrottle, PassContext, TelemetryPass
from resilientjob.operator.api import FailSlowSpec
from resilientjob.protocol.keys import JobKeys
from resilientjob.protocol.messages import SlowKind, encode


def test_one_event_per_interval_and_the_next_counts_those_held_back() -> None:
    throttle = EventThrottle(interval_s=60)
    assert throttle.admit("node 1: within 1.5x", now=100.0) == "node 1: within 1.5x"
    assert throttle.admit("node 2: within 1.5x", now=130.0) is None
    assert throttle.admit("node 3: within 1.5x", now=159.9) is None
    admitted = throttle.admit("node 4: within 1.5x", now=160.0)
    assert admitted == "node 4: within 1.5x (2 more since the last such Event: see the operator's log)"
    assert throttle.admit("node 5: within 1.5x", now=221.0) == "node 5: within 1.5x"


async def test_validation_requests_are_logged_each_and_posted_as_events_at_most_once_a_minute(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every communication report asks for a pass (training held for it); on a noisy host they come every few
    seconds. Each request is written to Redis and logged; its Event, like a dismissal's, at most once a
    minute, the next saying how many were held back."""
    client = aioredis.Redis.from_url(redis_url)
    keys = JobKeys("default", "noisy")
    tracker = FailSlowTracker(FailSlowSpec(min_duration_s=0))
    tracker.profile(profile(0, {"0,2": 0.3, "1,3": 0.1}))
    events: list[tuple[str, str, str]] = []
    ctl = PassContext(
        namespace="default",
        name="noisy",
        redis=JobRedis(client, keys),
        tracker=tracker,
        profile=PROFILE,
        validation_timeout_s=30.0,
        working=lambda node: True,
        event=lambda kind, reason, message: events.append((kind, str(reason), message)),
    )
    published = announcement(grid_plan([[0, 1], [2, 3]]))
    telemetry = TelemetryPass()
    caplog.set_level(logging.INFO, logger="resilientjob.operator")
    try:
        for request in (1, 2, 3):
            tracker.report(report(2, 20 * request, 1.6, SlowKind.COMMUNICATION), now=float(request))
            await telemetry._validation(ctl, published)
            assert (
                tracker.awaiting is not None and tracker.awaiting[0] == request
            )  # a pass asked for, each time
            tracker.validated(result(request, []))  # it found nothing: the report is dismissed
    finally:
        await client.aclose()
    requested = [e for e in events if e[1] == "ValidationRequested"]
    assert len(requested) == 1 and requested[0][2].startswith("validation 1 at generation 0"), events
    assert "reported by node 2 (its agent: 1.60x since step 16); suspects" in requested[0][2], events
    logged = [r.getMessage() for r in caplog.records if "validation " in r.getMessage()]
    assert [m.split("validation ")[1].split()[0] for m in logged] == ["1", "2", "3"], logged


async def test_a_parked_nodes_probe_steps_are_no_training_progress(redis_url: str) -> None:
    """A parked node's agent records probe steps under the current generation, counting on from its own last
    step. Taken for the job's progress, they ended a job early (its last step "reached") and re-armed the
    re-formations of `_aborts` (a step "committed" under the re-formed world)."""
    client = aioredis.Redis.from_url(redis_url)
    keys = JobKeys("default", "parked-progress")
    ctl = PassContext(
        namespace="default",
        name="parked-progress",
        redis=JobRedis(client, keys),
        tracker=FailSlowTracker(FailSlowSpec()),
        profile=PROFILE,
        validation_timeout_s=30.0,
        working=lambda node: True,
        event=lambda kind, reason, message: None,
    )
    plan = grid_plan([[0, 1], [2, 3]]).model_copy(update={"generation": 4})
    current = Published.of(announcement(plan, parked=[5]))
    telemetry = TelemetryPass()
    try:
        await telemetry.run(ctl, current)  # the stream is read from its end on
        for node, step in ((0, 30), (5, 90)):  # node 5 parked: its probes count on from its step 60
            await Telemetry(client, keys, node, f"pod-{node}").record_iteration(
                4, step, 0.1, 0 if node else 4
            )
        await telemetry.run(ctl, current)
        assert telemetry.progress is not None and telemetry.progress[:2] == (4, 30)
    finally:
        await client.delete(keys.iterations)
        await client.aclose()


@pytest.mark.parametrize("cause", ["host", "link"])
async def test_a_pass_judges_the_reports_that_came_with_it_by_the_host_rule_before_it_asks_validation(
    redis_url: str, cause: str
) -> None:
    """The pass asks for validation before its `tick` judges the reports that came with it: asked on the
    reporter's own steps alone, 15 healthy minutes at 1.2 held training for 15 passes that came
    milliseconds before the host rule dismissed their reports. A wait that the nodes' compute rose with
    asks for none; a slow link's still does."""
    client = aioredis.Redis.from_url(redis_url)
    keys = JobKeys("default", f"blip-{cause}")
    tracker, onset, last = rising_job(cause)
    ctl = PassContext(
        namespace="default",
        name=f"blip-{cause}",
        redis=JobRedis(client, keys),
        tracker=tracker,
        profile=PROFILE,
        validation_timeout_s=30.0,
        working=lambda node: True,
        event=lambda kind, reason, message: None,
    )
    current = Published.of(announcement(grid_plan([[0, 1], [2, 3], [4, 5], [6, 7]])))
    update = {"onset_step": onset, "baseline_s": 0.11}
    wait = report(3, last, 1.45, SlowKind.COMMUNICATION).model_copy(update=update)
    try:
        assert await Telemetry(client, keys, 3, "pod-3")._send(keys.reports, encode(wait), keep=True)
        await TelemetryPass().run(ctl, current)
        asked = await client.exists(keys.validation_request)
    finally:
        await client.delete(keys.reports, keys.validation_request)
        await client.aclose()
    if cause == "host":
        assert asked == 0 and tracker.awaiting is None and 3 not in tracker.candidates
    else:
        assert asked == 1 and tracker.awaiting is not None and 3 in tracker.candidates
