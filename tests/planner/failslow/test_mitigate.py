"""S2 against brute force; S3 link reassignment (Fig. 10) and straggler consolidation (Fig. 11)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilientjob.planner import PlannerError, uniform_profile
from resilientjob.planner.failslow import (
    NodeGrid,
    Traffic,
    consolidate_stragglers,
    reassign_congested_links,
    redistribute,
)


@settings(max_examples=150, deadline=None)
@given(times=st.lists(st.floats(0.05, 5.0), min_size=1, max_size=4), extra=st.integers(0, 10))
def test_s2_is_optimal_against_brute_force(times: list[float], extra: int) -> None:
    total = len(times) + extra
    result = redistribute(times, total)
    assert sum(result.microbatches) == total and min(result.microbatches) >= 1
    best = min(
        max(t * m for t, m in zip(times, counts, strict=True))
        for counts in itertools.product(range(1, total + 1), repeat=len(times))
        if sum(counts) == total
    )
    assert result.makespan_s == pytest.approx(best)
    assert result.solve_s >= 0


def test_s2_moves_work_off_the_slow_group() -> None:
    result = redistribute([1.0, 1.0, 1.0, 2.0], 28)
    assert result.microbatches == (8, 8, 8, 4)
    assert result.makespan_s == 8.0
    with pytest.raises(PlannerError) as info:
        redistribute([1.0, 1.0, 1.0], 2)
    assert info.value.field == "microbatches"


def _grid(replicas: int, stages: int, layers_per_stage: int = 2) -> NodeGrid:
    rows = tuple(tuple(r * stages + c for c in range(stages)) for r in range(replicas))
    ranges = tuple((c * layers_per_stage, (c + 1) * layers_per_stage) for c in range(stages))
    return NodeGrid(rows, ranges)


def _check_transfers(
    change_before: NodeGrid, change_after: NodeGrid, transfers: list[tuple[int, int]]
) -> None:
    """Each node that changed stage receives exactly its new stage's layers; nobody else receives any."""
    old, new = change_before.holdings(), change_after.holdings()
    received: dict[int, set[int]] = {}
    for layer, dst in transfers:
        received.setdefault(dst, set()).add(layer)
    assert received == {node: new[node] for node in new if new[node] != old[node]}


def test_s3_moves_a_congested_dp_link_onto_a_pipeline_link() -> None:
    # Fig. 10 on a 2 x 2 grid: node 0 has congested links to node 2 (its data-parallel peer) and node 3.
    # Both cannot avoid node 0 entirely: the best layout carries one on light pipeline traffic, none on DP.
    grid = _grid(2, 2)
    profile = uniform_profile(4)
    congested = [(0, 2), (0, 3)]
    assert grid.traffic(0, 2) is Traffic.DATA_PARALLEL
    change = reassign_congested_links(grid, congested, profile)
    carried = sorted(change.after.traffic(a, b) for a, b in congested)
    assert carried == sorted([Traffic.PIPELINE, Traffic.NONE])
    assert change.score_before == 1.0 and change.score_after == pytest.approx(0.1)
    assert sorted(change.permutation) == sorted(grid.nodes)
    _check_transfers(grid, change.after, [(t.layer, t.dst) for t in change.transfers])
    assert change.transfer_bytes == sum(t.bytes for t in change.transfers) > 0


def test_s3_prefers_a_free_reorder_within_a_stage() -> None:
    # Four replicas: reordering one stage's data-parallel ring takes the link off it and moves no weights.
    grid = _grid(4, 3)
    change = reassign_congested_links(grid, [(1, 4)], uniform_profile(6))
    assert grid.traffic(1, 4) is Traffic.DATA_PARALLEL
    assert change.after.traffic(1, 4) is not Traffic.DATA_PARALLEL
    assert change.transfers == ()
    assert len(change.moved) == 2


def test_s3_leaves_a_grid_without_congestion_alone() -> None:
    grid = _grid(2, 3)
    change = reassign_congested_links(grid, [(0, 5)], uniform_profile(6))  # diagonal: carries nothing
    assert change.after == grid and change.moved == ()
    with pytest.raises(PlannerError, match="not in the grid"):
        reassign_congested_links(grid, [(0, 99)], uniform_profile(6))


@pytest.mark.parametrize(
    ("stragglers", "stages_after"),
    [([1, 6], 1), ([4, 9, 14], 1), ([0, 5, 11, 12, 2, 7], 2)],
)
def test_s3_consolidates_stragglers_into_few_interior_stages(
    stragglers: list[int], stages_after: int
) -> None:
    grid = _grid(4, 4)  # Fig. 16: 4 DP x 4 PP
    profile = uniform_profile(8)
    change = consolidate_stragglers(grid, stragglers, profile)
    positions = change.after.positions()
    stages = {positions[node][1] for node in stragglers}
    assert len(stages) == stages_after == math.ceil(len(stragglers) / grid.replicas)
    assert stages <= {1, 2}  # interior stages: the first and last also carry embeddings and the loss
    assert change.score_after == stages_after < change.score_before
    _check_transfers(grid, change.after, [(t.layer, t.dst) for t in change.transfers])
    # Minimal moves: each straggler outside the targets, and one healthy node per freed slot, changes stage.
    outside = sum(grid.positions()[node][1] not in stages for node in stragglers)
    changed_stage = [n for n in grid.nodes if grid.positions()[n][1] != positions[n][1]]
    assert len(changed_stage) == 2 * outside


def test_s3_consolidation_keeps_healthy_rows_and_validates() -> None:
    grid = _grid(2, 4)
    change = consolidate_stragglers(grid, [1, 5], uniform_profile(8))  # already one interior stage
    assert change.after == grid
    with pytest.raises(PlannerError, match="not in the grid"):
        consolidate_stragglers(grid, [42], uniform_profile(8))
    with pytest.raises(PlannerError, match="model has"):
        consolidate_stragglers(grid, [0], uniform_profile(9))


def test_grid_validation_names_the_field() -> None:
    for rows, ranges, field in [
        (((0, 1), (2,)), ((0, 1), (1, 2)), "rows"),
        (((0, 1), (1, 2)), ((0, 1), (1, 2)), "rows"),
        (((0, 1), (2, 3)), ((0, 1),), "stage_layers"),
        (((0, 1), (2, 3)), ((0, 1), (2, 3)), "stage_layers"),
    ]:
        with pytest.raises(PlannerError) as info:
            NodeGrid(rows, ranges)
        assert info.value.field == field
