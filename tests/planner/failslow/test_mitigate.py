"""S2 against brute force; S3 straggler consolidation (Fig. 11). S3 for slow links: test_links.py."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilientjob.planner import PlannerError, uniform_profile
from resilientjob.planner.failslow import NodeGrid, consolidate_stragglers, redistribute, slowdown_removed


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


def test_the_slowdown_removed_is_measured_in_step_time_and_in_throughput() -> None:
    # A 4x slowdown (100 -> 25 samples/s) that a mitigation brings back to 50: the step went 4x -> 2x the
    # healthy one, two thirds of the slowdown; the throughput won back a third of what was lost.
    step_time, throughput = slowdown_removed(100.0, 25.0, 50.0) or (None, None)
    assert step_time == pytest.approx(2 / 3)
    assert throughput == pytest.approx(1 / 3)
    assert slowdown_removed(100.0, 25.0, 100.0) == pytest.approx((1.0, 1.0))
    worse = slowdown_removed(100.0, 25.0, 20.0)  # a mitigation that made it worse
    assert worse is not None and worse[0] < 0 and worse[1] < 0
    assert slowdown_removed(100.0, 100.0, 90.0) is None  # nothing was slowed
    assert slowdown_removed(100.0, 25.0, 0.0) is None  # no mitigated rate
