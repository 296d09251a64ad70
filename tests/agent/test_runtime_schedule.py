"""The runtime's op schedule (`_runtime_schedule.build_ops`) is the 1F1B order the estimator prices.

The list scheduler once preferred a backward that was not ready yet over a ready forward, which idled
stage workers and turned 1F1B into 2F2B (pipelines ran 20-35% slower than the estimator predicted); these
tests pin the canonical order for single pipelines of every depth and for a heterogeneous layout."""

from __future__ import annotations

import pytest

from resilientjob.agent._runtime_schedule import OpKind, build_ops
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan


def _canonical_1f1b(stages: int, stage: int, microbatches: int, first: int = 0) -> list[str]:
    """Warm-up forwards, then one forward and one backward, then the cool-down backwards."""
    warmup = min(stages - stage - 1, microbatches)
    order = [f"F{first + i}" for i in range(warmup)]
    for k in range(microbatches - warmup):
        order += [f"F{first + warmup + k}", f"B{first + k}"]
    return order + [f"B{first + i}" for i in range(microbatches - warmup, microbatches)]


def _pipeline(bounds: list[int], first_node: int, microbatches: int) -> PipelinePlan:
    stages = tuple(
        StagePlan(layers=(bounds[i], bounds[i + 1]), node=first_node + i) for i in range(len(bounds) - 1)
    )
    return PipelinePlan(stages=stages, microbatches=microbatches)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 3, 8])
def test_one_pipeline_runs_canonical_1f1b(stages: int, microbatches: int) -> None:
    bounds = [16 * i // stages for i in range(stages + 1)]
    plan = Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=1,
        step_time_s=1.0,
        pipelines=(_pipeline(bounds, 0, microbatches),),
    )
    ops = build_ops(plan)
    for stage in range(stages):
        got = [f"{op.kind}{op.microbatch}" for op in ops[stage]]
        assert got == _canonical_1f1b(stages, stage, microbatches), stage


def test_heterogeneous_pipelines_each_run_1f1b_on_their_own_micro_batches() -> None:
    # DP2 PP[4,3] with unequal stages, as the planner makes of 8 nodes after one failure.
    plan = Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=1,
        step_time_s=1.0,
        pipelines=(_pipeline([0, 4, 8, 12, 16], 0, 4), _pipeline([0, 5, 11, 16], 4, 4)),
    )
    ops = build_ops(plan)
    for stage in range(4):
        assert [f"{op.kind}{op.microbatch}" for op in ops[stage]] == _canonical_1f1b(4, stage, 4)
    for stage in range(3):
        got = [f"{op.kind}{op.microbatch}" for op in ops[4 + stage]]
        assert got == _canonical_1f1b(3, stage, 4, first=4)
    assert all(op.kind in OpKind for node_ops in ops.values() for op in node_ops)
