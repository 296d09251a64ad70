"""Falcon's mitigations S2 and S3 (section 5.3) as pure functions over a DP x PP node grid.

S2, micro-batch redistribution: give data-parallel group i m_i >= 1 micro-batches, sum m_i = M, so that the
slowest group, max_i t_i m_i, finishes as early as possible. Falcon solves a QP (35.9 s for 512 groups); this
is exact in well under a millisecond (see `redistribute`).

S3 (b), topology adjustment for stragglers, on a grid whose row d is data-parallel replica d and whose column
p is pipeline stage p: `consolidate_stragglers` packs k slow nodes into ceil(k / rows) stages, interior ones
first, since a stage is as slow as its slowest node however many slow nodes it holds (Fig. 11). It returns the
new grid, the node permutation, and the weight moves the new placement needs (the restorer's `match_slots`
and `transfer_list`). S3 (a), for slow links, works on whole plans of any shape (`_links`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..balance import balance_linear, makespan
from ..errors import PlannerError
from ..plan import Transfer
from ..profile import ModelProfile
from ..restorer import match_slots, transfer_list

Position = tuple[int, int]
"""(row, column) = (data-parallel replica, pipeline stage)."""


@dataclass(frozen=True, slots=True)
class Redistribution:
    """S2's answer: micro-batches per data-parallel group, the slowest group's time, and the solve time."""

    microbatches: tuple[int, ...]
    makespan_s: float
    solve_s: float


def redistribute(times_s: Sequence[float], microbatches: int, minimum: int = 1) -> Redistribution:
    """Optimal S2: minimise max_i times_s[i] * m_i subject to m_i >= minimum, sum m_i = microbatches.

    Proof sketch. A makespan T is achievable iff T >= t_i * minimum for every i and
    sum_i floor(T / t_i) >= M: each group can take up to floor(T / t_i) micro-batches, and taking some
    away from a group never slows it, so any surplus over M can be removed down to the minimum. The left-hand
    sum is a non-decreasing step function of T that jumps only at the points t_i * k, so the optimum T* is
    the smallest such point at which the allocation max(minimum, floor(T / t_i)) reaches M. `balance_linear`
    bisects on T for the largest such allocation whose sum does not exceed M, then hands out the few remaining
    micro-batches one at a time to the group whose time with one more, t_i (m_i + 1), is smallest (ties to
    the lower index). Those are the next jump points in increasing order, so the last one handed out is T*,
    and no allocation beats it: with makespan T < T* each group holds at most max(minimum, floor(T / t_i))
    micro-batches and these sum to less than M. Cost: 64 bisection steps of O(D) numpy work plus at most D
    heap operations, against a generic integer program (see bench/bench_rebalance.py, which checks the two
    optima agree).
    """
    started = time.perf_counter()
    counts = balance_linear(times_s, microbatches, minimum)
    solve_s = time.perf_counter() - started
    return Redistribution(tuple(counts), makespan(times_s, counts), solve_s)


@dataclass(frozen=True, slots=True)
class NodeGrid:
    """Node ids by (replica, stage), with the layer range [start, end) of each stage."""

    rows: tuple[tuple[int, ...], ...]
    stage_layers: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.rows or not self.rows[0]:
            raise PlannerError("rows", "a grid needs at least one replica and one stage")
        width = len(self.rows[0])
        if any(len(row) != width for row in self.rows):
            raise PlannerError("rows", "every replica must have the same number of stages")
        flat = [node for row in self.rows for node in row]
        if len(set(flat)) != len(flat) or min(flat) < 0:
            raise PlannerError("rows", "node ids must be distinct and >= 0")
        if len(self.stage_layers) != width:
            raise PlannerError("stage_layers", f"need {width} layer ranges, one per stage")
        expected = 0
        for start, end in self.stage_layers:
            if start != expected or end <= start:
                raise PlannerError("stage_layers", f"stages must tile the layers from 0; broken at {start}")
            expected = end

    @property
    def replicas(self) -> int:
        return len(self.rows)

    @property
    def stages(self) -> int:
        return len(self.rows[0])

    @property
    def nodes(self) -> tuple[int, ...]:
        """Node ids in row-major slot order."""
        return tuple(node for row in self.rows for node in row)

    def positions(self) -> dict[int, Position]:
        return {node: (r, c) for r, row in enumerate(self.rows) for c, node in enumerate(row)}

    def holdings(self) -> dict[int, set[int]]:
        """Layers each node holds: its stage's range."""
        return {node: set(range(*self.stage_layers[c])) for node, (_, c) in self.positions().items()}

    def moved(self, positions: dict[int, Position]) -> NodeGrid:
        """The grid with nodes at the given positions."""
        rows = [[-1] * self.stages for _ in range(self.replicas)]
        for node, (r, c) in positions.items():
            rows[r][c] = node
        return NodeGrid(tuple(tuple(row) for row in rows), self.stage_layers)


@dataclass(frozen=True, slots=True)
class TopologyChange:
    """S3 (b)'s answer. `score_*` counts the stages that hold stragglers."""

    before: NodeGrid
    after: NodeGrid
    transfers: tuple[Transfer, ...]
    score_before: float
    score_after: float

    @property
    def permutation(self) -> tuple[int, ...]:
        """Node now in each slot, row-major (slot r * stages + c); `before.nodes` is the old one."""
        return self.after.nodes

    @property
    def moved(self) -> tuple[int, ...]:
        old, new = self.before.positions(), self.after.positions()
        return tuple(sorted(node for node in old if old[node] != new[node]))

    @property
    def transfer_bytes(self) -> int:
        return sum(transfer.bytes for transfer in self.transfers)


def _stage_bytes(grid: NodeGrid, profile: ModelProfile) -> list[int]:
    if grid.stage_layers[-1][1] != profile.num_layers:
        raise PlannerError(
            "stage_layers",
            f"stages cover {grid.stage_layers[-1][1]} layers, the model has {profile.num_layers}",
        )
    return [profile.state_bytes(start, end) for start, end in grid.stage_layers]


def _change(
    grid: NodeGrid, positions: dict[int, Position], profile: ModelProfile, before: float, after: float
) -> TopologyChange:
    new = grid.moved(positions)
    transfers = transfer_list(grid.holdings(), new.holdings(), profile)
    return TopologyChange(grid, new, tuple(transfers), before, after)


def consolidate_stragglers(
    grid: NodeGrid, stragglers: Sequence[int], profile: ModelProfile
) -> TopologyChange:
    """Pack stragglers into ceil(k / replicas) stages, interior stages first (Fig. 11).

    Target stages: interior ones (not the first or last, which also carry embeddings and the loss) before
    exterior ones, then those already holding the most stragglers. Stragglers take target slots by a
    min-cost assignment (bytes to fetch, staying put when possible); healthy nodes fill the other slots
    with the restorer's `match_slots`, then keep their row when they keep their stage.
    """
    positions = grid.positions()
    slow = sorted(set(stragglers))
    for node in slow:
        if node not in positions:
            raise PlannerError("stragglers", f"node {node} is not in the grid")
    stage_bytes = _stage_bytes(grid, profile)
    stages, replicas = grid.stages, grid.replicas
    before = float(len({positions[n][1] for n in slow}))
    needed = math.ceil(len(slow) / replicas)
    if not slow or needed >= stages:
        return _change(grid, positions, profile, before, before)
    count = [0] * stages
    for node in slow:
        count[positions[node][1]] += 1

    def exterior(stage: int) -> bool:
        return stages >= 3 and stage in (0, stages - 1)

    targets = sorted(range(stages), key=lambda s: (exterior(s), -count[s], s))[:needed]
    target_slots = [(r, c) for c in sorted(targets) for r in range(replicas)]
    # Straggler -> target slot: bytes of the slot's stage unless already there, plus a nudge to stay put.
    cost = np.array(
        [
            [
                (0.0 if positions[node][1] == c else float(stage_bytes[c]))
                + (0.0 if positions[node] == (r, c) else 0.5)
                for r, c in target_slots
            ]
            for node in slow
        ]
    )
    from scipy.optimize import linear_sum_assignment  # at first use, as in `restorer.assign`

    rows, cols = linear_sum_assignment(cost)
    placed: dict[int, Position] = {slow[i]: target_slots[j] for i, j in zip(rows, cols, strict=True)}
    taken = set(placed.values())
    free = [(r, c) for r in range(replicas) for c in range(stages) if (r, c) not in taken]
    healthy = {
        node: set(range(*grid.stage_layers[positions[node][1]])) for node in positions if node not in placed
    }
    chosen = match_slots(healthy, [set(range(*grid.stage_layers[c])) for _, c in free], profile)
    # match_slots fixes each healthy node's stage; within a stage any row costs the same, so keep rows.
    by_stage: dict[int, list[int]] = {}
    for node, (_, c) in zip(chosen, free, strict=True):
        by_stage.setdefault(c, []).append(node)
    for c, members in by_stage.items():
        rows_free = [r for r, col in free if col == c]
        stay = [n for n in members if positions[n][1] == c and positions[n][0] in rows_free]
        for node in stay:
            placed[node] = positions[node]
            rows_free.remove(positions[node][0])
        for node, r in zip([n for n in members if n not in stay], rows_free, strict=True):
            placed[node] = (r, c)
    after = float(len({placed[n][1] for n in slow}))
    return _change(grid, placed, profile, before, after)


def slowdown_removed(healthy: float, slowed: float, mitigated: float) -> tuple[float, float] | None:
    """The share of the slowdown a mitigation removed, from three rates (samples or steps per second): in
    step time, Falcon's measure, (slowed - mitigated) / (slowed - 1) of the step times against the healthy
    one; and of the lost throughput, (mitigated - slowed) / (healthy - slowed). None when nothing was slowed
    or no mitigated rate was measured."""
    if not 0 < slowed < healthy or mitigated <= 0:
        return None
    before, after = healthy / slowed, healthy / mitigated
    return (before - after) / (before - 1), (mitigated - slowed) / (healthy - slowed)
