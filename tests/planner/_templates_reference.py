"""The template instantiation path as it was before issue #16's speed-ups, kept as the slow reference that
the fast path must agree with (`test_templates_fast.py`): the row-copying eq. 5 enumeration, the plain
binary search per curve for the min-max makespan, the neighbour-set colouring of the all-reduce, the
ranking in the order of the bottleneck bound alone, and an exhaustive ranking with no bound at all."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from resilientjob.planner import ClusterSpec, ModelProfile
from resilientjob.planner._time_curve import TimeCurve
from resilientjob.planner.estimator import allreduce_time
from resilientjob.planner.templates import TemplateSet, template_curve

TIE = 1e-12


def instantiation_rows(sizes: Sequence[int], nodes: int, min_pipelines: int) -> np.ndarray:
    count = len(sizes)
    table: list[np.ndarray] = [np.zeros((0, count), dtype=np.int64) for _ in range(nodes + 1)]
    table[0] = np.zeros((1, count), dtype=np.int64)
    for index, size in enumerate(sizes):
        for total in range(size, nodes + 1):
            previous = table[total - size]
            if len(previous):
                bumped = previous.copy()
                bumped[:, index] += 1
                table[total] = np.concatenate([table[total], bumped])
    rows = table[nodes]
    kept: np.ndarray = rows[rows.sum(axis=1) >= min_pipelines]
    return kept


def makespan(curves: Sequence[TimeCurve], copies: Sequence[int], total: int) -> float:
    floor = max(curve.at(1) for curve in curves)
    limit = total - sum(copies) + 1

    def enough(value: float) -> bool:
        if value < floor:
            return False
        pairs = zip(curves, copies, strict=True)
        return sum(many * curve.count(value, limit) for curve, many in pairs) >= total

    best = math.inf
    for curve in curves:
        low, high = 1, limit
        if not enough(curve.at(high)):
            continue
        while low < high:
            middle = (low + high) // 2
            if enough(curve.at(middle)):
                high = middle
            else:
                low = middle + 1
        best = min(best, curve.at(low))
    assert not math.isinf(best)
    return best


def rounds_from_bounds(shapes: Sequence[Sequence[int]]) -> list[list[tuple[int, int]]]:
    bounds = sorted({b for shape in shapes for b in shape})
    segments = list(itertools.pairwise(bounds))
    index = {start: position for position, (start, _) in enumerate(segments)}
    count = len(segments)
    neighbours: list[set[int]] = [set() for _ in range(count)]
    for shape in shapes:
        for start, end in itertools.pairwise(shape):
            members = [index[b] for b in bounds if start <= b < end]
            for member in members:
                neighbours[member].update(other for other in members if other != member)
    colour: dict[int, int] = {}
    for vertex in sorted(range(count), key=lambda i: (-len(neighbours[i]), i)):
        taken = {colour[n] for n in neighbours[vertex] if n in colour}
        colour[vertex] = next(c for c in range(count) if c not in taken)
    rounds: list[list[tuple[int, int]]] = [[] for _ in range(max(colour.values()) + 1)]
    for vertex in range(count):
        rounds[colour[vertex]].append(segments[vertex])
    return rounds


class Reference:
    """Curves, bounds and all-reduce times of a template set, computed the old way."""

    def __init__(self, profile: ModelProfile, cluster: ClusterSpec, templates: TemplateSet) -> None:
        self.profile, self.cluster, self.templates = profile, cluster, templates
        self.curves = {t.nodes: template_curve(profile, cluster, t) for t in templates.templates}
        self.bottleneck: dict[int, float] = {}
        self.offset: dict[int, float] = {}
        self.heaviest: dict[int, float] = {}
        param = profile.prefix("param")
        for template in templates.templates:
            size = template.nodes
            self.bottleneck[size] = max(
                sum(profile.stage_times(*stage.layers, len(stage.gpus))) for stage in template.stages
            )
            head = self.curves[size].head
            ramp = self.bottleneck[size] * np.arange(1, len(head) + 1)
            self.offset[size] = float(np.min(head - ramp)) * (1 - 1e-12)
            self.heaviest[size] = max(float(param[s.layers[1]] - param[s.layers[0]]) for s in template.stages)

    def sync(self, groups: Sequence[tuple[int, int]]) -> float:
        replicas = sum(many for _, many in groups)
        if replicas <= 1:
            return 0.0
        shapes = [[0, *(s.layers[1] for s in self.templates.for_nodes(size).stages)] for size, _ in groups]
        return allreduce_time(self.profile, self.cluster, rounds_from_bounds(shapes), replicas)

    def value(self, combo: Sequence[int], total: int) -> float:
        groups = [(size, int(many)) for size, many in zip(self.templates.sizes, combo, strict=True) if many]
        curves = [self.curves[size] for size, _ in groups]
        return makespan(curves, [many for _, many in groups], total) + self.sync(groups)

    def rank_exhaustive(self, combos: np.ndarray, total: int) -> tuple[int, ...]:
        """Every combination that fits, in enumeration order; the first among equals."""
        best: tuple[float, int] | None = None
        for index, combo in enumerate(combos):
            if int(combo.sum()) > total:
                continue
            value = self.value(combo, total)
            if best is None or value < best[0] * (1 - TIE):
                best = (value, index)
        assert best is not None
        return tuple(int(x) for x in combos[best[1]])

    def rank_bottleneck(self, combos: np.ndarray, total: int) -> tuple[int, ...]:
        """The ranking as it was: in order of the bottleneck bound plus one stage's all-reduce."""
        sizes = self.templates.sizes
        rates = np.asarray([1.0 / self.bottleneck[size] for size in sizes])
        offsets = np.asarray([self.offset[size] for size in sizes]) * rates
        matrix = np.asarray(combos, dtype=np.float64)
        bounds = (total + matrix @ offsets) / (matrix @ rates)
        replicas = matrix.sum(axis=1)
        heaviest = np.asarray([self.heaviest[size] for size in sizes])
        present = np.where(combos > 0, heaviest[None, :], 0.0).max(axis=1)
        cluster = self.cluster
        sync_floor = np.where(
            replicas > 1,
            present * 2 * (replicas - 1) / replicas / cluster.inter_node_bandwidth
            + 2 * (replicas - 1) * cluster.message_latency_s,
            0.0,
        )
        bounds = bounds + sync_floor
        best: tuple[float, int] | None = None
        for index in np.lexsort((np.arange(len(combos)), bounds)):
            if replicas[index] > total:
                continue
            if best is not None and bounds[index] > best[0] * (1 + TIE):
                break
            value = self.value(combos[index], total)
            if (
                best is None
                or value < best[0] * (1 - TIE)
                or (value <= best[0] * (1 + TIE) and index < best[1])
            ):
                best = (value, int(index))
        assert best is not None
        return tuple(int(x) for x in combos[best[1]])


def count_instantiations(sizes: Sequence[int], nodes: int) -> int:
    ways = [1] + [0] * nodes
    for size in sizes:
        for total in range(size, nodes + 1):
            ways[total] += ways[total - size]
    return ways[nodes]


def two_size_combinations(sizes: Sequence[int], nodes: int, min_pipelines: int) -> np.ndarray:
    """The combinations mixing at most two template sizes, sorted, as a Python loop."""
    found: list[tuple[int, ...]] = []
    for i, first in enumerate(sizes):
        for j in range(i, len(sizes)):
            second = sizes[j]
            for many in range(nodes // first + 1):
                rest = nodes - many * first
                if i == j:
                    if rest == 0:
                        counts = [0] * len(sizes)
                        counts[i] = many
                        found.append(tuple(counts))
                    continue
                if rest % second == 0:
                    counts = [0] * len(sizes)
                    counts[i], counts[j] = many, rest // second
                    found.append(tuple(counts))
    kept = sorted({x for x in found if sum(x) >= min_pipelines})
    return np.asarray(kept, dtype=np.int64).reshape(len(kept), len(sizes))
