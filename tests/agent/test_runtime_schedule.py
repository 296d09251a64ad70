"""The runtime's op schedule (`_runtime_schedule.build_ops`) is the 1F1B order the estimator prices.

The list scheduler once preferred a backward that was not ready yet over a ready forward, which idled
stage workers and turned 1F1B into 2F2B (pipelines ran 20-35% slower than the estimator predicted); these
tests pin the canonical order for single pipelines of every depth and for a heterogeneous layout."""

from __future__ import annotations

import pytest

from resilientjob.agent._runtime_schedule import OpKind, build_ops, sync_groups, world_nodes
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan, Transfer


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


def _grid_plan(grid: list[list[tuple[int, int, int]]], transfers: tuple[Transfer, ...] = ()) -> Plan:
    """A plan from rows of (node, first layer, end layer) stages; a negative node is a failed one whose
    micro-batches node 0 runs (rerouted)."""
    pipelines = tuple(
        PipelinePlan(
            stages=tuple(
                StagePlan(layers=(a, b), node=abs(node), rerouted_to=(0,) if node < 0 else ())
                for node, a, b in row
            ),
            microbatches=2,
        )
        for row in grid
    )
    return Plan(
        policy=Policy.DYNAMIC, microbatch_size=1, step_time_s=1.0, pipelines=pipelines, transfers=transfers
    )


@pytest.mark.parametrize(
    "plan",
    [
        # The demo job's layout, and what S3 made of it on the device run: the pipeline holding link 0-2's
        # end 0 moved so that 0 and 2 are no ring neighbours. Numbered by node, its stage-0 ring [5, 2, 4,
        # 0, 6, 7] had ranks [5, 2, 4, 0, 6, 7], which a group sorts: the ring ran 0-2 again.
        _grid_plan([[(0, 0, 4), (1, 4, 8)], [(2, 0, 4), (3, 4, 8)], [(4, 0, 8)], [(5, 0, 8)]]),
        _grid_plan([[(5, 0, 8)], [(2, 0, 4), (3, 4, 8)], [(4, 0, 8)], [(0, 0, 4), (1, 4, 8)], [(6, 0, 8)]]),
        # Uneven stages (three layer segments), a rerouted stage, a node that only sends a layer.
        _grid_plan(
            [[(7, 0, 3), (1, 3, 8)], [(2, 0, 5), (-6, 5, 8)], [(0, 0, 8)], [(3, 0, 2), (4, 2, 8)]],
            transfers=(Transfer(layer=5, src=9, dst=2, bytes=1),),
        ),
    ],
)
def test_every_gradient_ring_has_ascending_ranks_in_the_plans_order(plan: Plan) -> None:
    """A process group sorts its ranks (torch 2.11 offers no other way), and gloo's and NCCL's rings follow
    group-rank order: the runtime's rings are the plan's only if ranks ascend along them."""
    nodes = world_nodes(plan)
    assert sorted(nodes) == sorted(set(plan.nodes) | {t.src for t in plan.transfers})
    rank = {node: position for position, node in enumerate(nodes)}
    groups = sync_groups(plan)
    assert groups
    for group in groups:
        ranks = [rank[holder] for holder in group.holders]
        assert ranks == sorted(ranks), (group, ranks)
