"""A new node joins a running job (a replacement pod under a new node id, issue #14): real worker processes on
gloo through the launcher. Node 1 dies, the job goes on without it; then node 4 starts, the planner takes it
in (its scale-up choice), node 4 receives every layer it holds from the surviving replicas and resumes at the
job's step. The losses are those of the failure-free run, and every sample is trained exactly once across the
shrink and the grow."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from test_runtime import (
    _assert_bytes_equal_transfer_plan,
    _assert_each_sample_once,
    _assert_matches_reference,
)

from resilientjob.agent._runtime_schedule import held_layers
from resilientjob.agent.worker import JobConfig
from resilientjob.planner.plan import Policy
from resilientjob.planner.profile import ModelProfile
from resilientjob.testing.launcher import Launcher
from resilientjob.testing.plans import RuntimePlanner
from resilientjob.testing.reference import reference_run

pytestmark = pytest.mark.torch


def test_a_new_node_joins_gets_its_layers_and_the_samples_stay_exactly_once(
    tmp_path: Path, gpt_profile: ModelProfile, job_config: Callable[..., JobConfig]
) -> None:
    # The join is due once step 4 has committed and node 4 is ready, and the harness's control loop must see
    # both before the survivors train past the end: twelve steps of margin, not three (a loaded CI host
    # once finished steps 5-7 before the loop saw step 4, and node 4 never joined).
    steps = 16
    planner = RuntimePlanner.for_job(
        gpt_profile, nodes=4, global_batch=16, microbatch_size=2, dp_range=(2, 2)
    )
    plan = planner.initial()
    config = job_config(steps=steps)
    reference, _, _ = reference_run(config, plan.global_batch, plan.microbatch_size)
    launcher = Launcher(config, plan, planner, tmp_path, fail_at={1: 2}, joins={4: 4})
    result = launcher.run(timeout_s=150)
    assert [p.generation for p in result.plans] == [0, 1, 2]
    shrunk, grown = result.plans[1], result.plans[2]
    assert 1 not in shrunk.nodes and len(shrunk.nodes) == 3
    # The scale-up is the planner's choice by its score (Odyssey eq. 8), and it takes the new node in.
    best = max(grown.candidates, key=lambda c: c.score)
    assert grown.policy == best.policy and grown.layout == best.layout
    assert grown.policy in (Policy.DYNAMIC, Policy.TEMPLATES)  # a new layout, not the rerouted old one
    assert set(grown.nodes) == {0, 2, 3, 4}
    # Node 4 started with nothing: every layer it holds came from a peer, as the plan said.
    held = held_layers(grown)[4]
    received = {layer for layer, src, dst, _ in result.received[grown.generation] if dst == 4 and src != 4}
    assert held and held <= received
    _assert_bytes_equal_transfer_plan(result)
    # The same training as without any failure or join: same losses, each sample once per step.
    _assert_matches_reference(result, reference, steps)
    _assert_each_sample_once(result, plan, steps)
    assert result.return_values[4]["step"] == steps
