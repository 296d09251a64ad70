"""The checkpoint state the operator hands the planner: the last checkpoint the agents' schedule wrote, so a
checkpoint restart costs the steps since then (issue #14), not half an interval."""

from __future__ import annotations

import pytest
from _support import bert_spec_fields

from resilientjob.operator.api import parse_spec
from resilientjob.operator.planning import (
    checkpoint_state,
    plan_initial,
    plan_next,
    planner_inputs,
    warn_node_local_checkpoints,
)
from resilientjob.planner import Policy


def _spec(checkpoint: dict[str, int | str]):  # type: ignore[no-untyped-def]
    return parse_spec(bert_spec_fields(checkpoint={"volume": "shared-checkpoints", **checkpoint}))


@pytest.mark.parametrize(
    ("checkpoint", "step", "last"),
    [
        ({"intervalSteps": 10}, 25, 20),
        ({"intervalSteps": 10}, 7, None),  # none written yet: a restart redoes every step
        ({"intervalS": 60}, 1000, None),  # replaced below by the plan's step time
    ],
)
def test_last_checkpoint_follows_the_schedule(
    checkpoint: dict[str, int], step: int, last: int | None
) -> None:
    spec = _spec(checkpoint)
    inputs = planner_inputs(spec)
    current = plan_initial(spec, inputs)
    state = checkpoint_state(spec, current, step)
    assert state is not None and state.configured and state.step == step
    if "intervalS" in checkpoint:
        every = int(60 / current.step_time_s)
        last = step - step % every or None
    assert state.last_step == last
    assert checkpoint_state(spec, current, None) is None


def test_checkpoints_without_a_volume_are_node_local_and_a_restart_starts_over() -> None:
    spec = parse_spec(bert_spec_fields(checkpoint={"intervalSteps": 10}))
    inputs = planner_inputs(spec)
    current = plan_initial(spec, inputs)
    state = checkpoint_state(spec, current, 25)
    assert state is not None and state.last_step is None and state.lost_steps() == 25
    stage0 = [pipeline.stages[0].node for pipeline in current.pipelines]
    plan = plan_next(spec, inputs, current, failed=stage0, step=25)
    candidate = next(c for c in plan.candidates if c.policy is Policy.CHECKPOINT)
    assert "all 25 steps so far redone" in candidate.reason, candidate.reason


def test_replan_beyond_f_charges_the_steps_since_the_checkpoint() -> None:
    spec = _spec({"intervalSteps": 10})
    inputs = planner_inputs(spec)
    current = plan_initial(spec, inputs)
    # Every replica of some layer gone: only the checkpoint can run.
    stage0 = [pipeline.stages[0].node for pipeline in current.pipelines]
    plan = plan_next(spec, inputs, current, failed=stage0, step=25)
    assert plan.policy is Policy.CHECKPOINT
    candidate = next(c for c in plan.candidates if c.policy is Policy.CHECKPOINT)
    assert "step 20, 5 steps redone" in candidate.reason


@pytest.mark.parametrize(
    ("fields", "warned"),
    [
        ({"model": "gpt"}, True),  # trains, and each pod's checkpoints go with it
        ({"model": "gpt", "checkpoint": {"volume": "shared-checkpoints"}}, False),  # a shared claim
        ({"model": "synthetic:bert-large"}, False),  # the synthetic loop writes no checkpoint
        ({"model": "synthetic:bert-large", "checkpoint": {"volume": "shared-checkpoints"}}, False),
    ],
)
def test_a_job_is_warned_of_node_local_checkpoints_when_it_trains_without_a_shared_volume(
    fields: dict[str, object], warned: bool
) -> None:
    assert warn_node_local_checkpoints(parse_spec(bert_spec_fields(**fields))) is warned
