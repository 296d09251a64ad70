"""Dynamic parallelism (Odyssey section IV-A, Algorithm 1): lay alive nodes out as data-parallel pipelines of
possibly different depths, one node (with all its GPUs) per stage, and pick the lowest estimated step time.

Why it is fast enough for 1,024 nodes:
- DP degrees: a window around the current degree (Odyssey: the new degree rarely differs by more than one),
  within the job's dp_range; the initial plan tries every degree.
- Pipeline depths: integer partitions of the nodes into `dp` parts whose sizes differ by at most `spread`,
  enumerated as multisets (no permutation is tried twice), within the job's pp_range.
- Layer split, cached per pipeline depth and shared across calls (`_search_shapes`): layers split evenly and
  the remainder enumerated, OOM splits filtered by the memory estimator (eq. 14).
- Branch and bound: each partition gets a cheap lower bound first; only those that could beat the best found
  so far are timed exactly (1F1B simulation, `estimator.OneFOneB`).
- Batch distribution: the exact min-max balance (the paper hands out micro-batches by node share; the exact
  balance is never worse) over the partition's shape classes, started from a certified lower bound so that
  only a handful of exact simulations run per class.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ._search_shapes import TIE, StageSplit, shape_table
from .errors import PlannerError
from .estimator import allreduce_time, stage_peak_memory
from .plan import PipelinePlan, Plan, Policy, StagePlan
from .profile import ModelProfile
from .spec import ClusterSpec, JobSpec


@dataclass(frozen=True, slots=True)
class ShapeClass:
    """`count` identical pipelines of `split.stages` nodes; `extra` of them run `microbatches + 1`."""

    split: StageSplit
    count: int
    microbatches: int
    extra: int

    def allocations(self) -> list[int]:
        return [self.microbatches + 1] * self.extra + [self.microbatches] * (self.count - self.extra)


@dataclass(frozen=True, slots=True)
class Layout:
    """A candidate layout found by the search, with its estimated step time."""

    classes: tuple[ShapeClass, ...]
    pipeline_s: float
    allreduce_s: float
    rounds: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def step_time_s(self) -> float:
        return self.pipeline_s + self.allreduce_s

    @property
    def dp(self) -> int:
        return sum(shape.count for shape in self.classes)

    @property
    def nodes(self) -> int:
        return sum(shape.count * shape.split.stages for shape in self.classes)

    @property
    def symmetric(self) -> bool:
        return len(self.classes) == 1

    def describe(self) -> str:
        depths = ",".join(str(shape.split.stages) for shape in self.classes for _ in range(shape.count))
        return f"DP{self.dp} PP[{depths}]"

    def to_plan(self, profile: ModelProfile, cluster: ClusterSpec, job: JobSpec, policy: Policy) -> Plan:
        """A plan whose `node` fields are slots 0..nodes-1 (consecutive per pipeline); place it with
        `restorer.place_plan`."""
        gpus = tuple(range(cluster.gpus_per_node))
        pipelines: list[PipelinePlan] = []
        slot = 0
        for shape in self.classes:
            split = shape.split
            for microbatches in shape.allocations():
                stages = []
                for index, (start, end) in enumerate(itertools.pairwise(split.bounds)):
                    memory = stage_peak_memory(
                        profile, start, end, len(gpus), index, split.stages, microbatches
                    )
                    stages.append(
                        StagePlan(
                            layers=(start, end),
                            node=slot,
                            gpus=gpus,
                            forward_s=split.forward[index],
                            backward_s=split.backward[index],
                            peak_memory_bytes=memory,
                        )
                    )
                    slot += 1
                pipelines.append(PipelinePlan(stages=tuple(stages), microbatches=microbatches))
        return Plan(
            policy=policy,
            microbatch_size=job.microbatch_size,
            pipelines=tuple(pipelines),
            step_time_s=self.step_time_s,
            allreduce_rounds=self.rounds,
        )


# ---- batch distribution ------------------------------------------------------------------------------------
def distribute(
    counts: Sequence[int],
    total: int,
    cost: Callable[[int, int], float],
    start: Sequence[int] | None = None,
) -> tuple[list[int], list[int], float]:
    """Exact min-max allocation of `total` units over classes of identical groups (`counts[c]` groups in
    class c, each costing `cost(c, m)` for m units, non-decreasing in m), every group at least one unit.

    Returns per class the base allocation, how many of its groups get one more, and the makespan. Equal to
    `balance.balance_monotone` on the expanded groups, but the greedy runs per class and starts from a lower
    bound certified by `start` (a guess): a start at or below the optimum leaves the greedy exact.
    """
    classes = len(counts)
    groups = sum(counts)
    if classes == 0 or any(count < 1 for count in counts):
        raise PlannerError("groups", "need at least one group per class")
    if total < groups:
        raise PlannerError("microbatches", f"{total} micro-batches cannot give each of {groups} groups one")
    cap = total - groups + 1
    base = _certified_start(counts, total, cost, start, cap)
    upgraded = [0] * classes
    remaining = total - sum(b * c for b, c in zip(base, counts, strict=True))
    heap = [(cost(c, base[c] + 1), c) for c in range(classes) if base[c] < cap]
    heapq.heapify(heap)
    while remaining:
        _, c = heapq.heappop(heap)
        take = min(counts[c] - upgraded[c], remaining)
        upgraded[c] += take
        remaining -= take
        if upgraded[c] == counts[c]:
            base[c] += 1
            upgraded[c] = 0
            if base[c] < cap:
                heapq.heappush(heap, (cost(c, base[c] + 1), c))
    makespan = max(cost(c, base[c] + (1 if upgraded[c] else 0)) for c in range(classes))
    return base, upgraded, makespan


def _reach(c: int, low: int, limit: float, cap: int, cost: Callable[[int, int], float]) -> int:
    """The largest m in [low, cap] with cost(c, m) <= limit, given cost(c, low) <= limit (galloping)."""
    good, step = low, 1
    bad = cap + 1
    while good + step <= cap:
        if cost(c, good + step) <= limit:
            good += step
            step *= 2
        else:
            bad = good + step
            break
    while bad - good > 1:
        middle = (good + bad) // 2
        if cost(c, middle) <= limit:
            good = middle
        else:
            bad = middle
    return good


def _certified_start(
    counts: Sequence[int],
    total: int,
    cost: Callable[[int, int], float],
    start: Sequence[int] | None,
    cap: int,
) -> list[int]:
    """A per-class allocation no larger than some optimal one. If every class reaching cost <= t gives fewer
    than `total` units, the optimum exceeds t, so the allocation reaching t is below the optimum."""
    ones = [1] * len(counts)
    if start is None:
        return ones
    guess = [min(cap, max(1, g)) for g in start]
    backoff = 1
    for _ in range(12):
        limit = max(cost(c, guess[c]) for c in range(len(counts)))
        reach = [_reach(c, guess[c], limit, cap, cost) for c in range(len(counts))]
        if sum(r * n for r, n in zip(reach, counts, strict=True)) < total:
            return reach
        if guess == ones:
            return ones
        guess = [max(1, g - backoff) if cost(c, g) >= limit else g for c, g in enumerate(guess)]
        backoff *= 2
    return ones


# ---- partitions and the search -----------------------------------------------------------------------------
def partitions(
    nodes: int, parts: int, allowed: Callable[[int], bool], spread: int
) -> Iterator[tuple[tuple[int, int], ...]]:
    """Multisets of `parts` pipeline depths adding up to `nodes`, max - min <= spread, every depth allowed;
    yielded as ((depth, count), ...) with the deepest first."""
    if parts < 1 or nodes < parts:
        return
    for low in range(max(1, -(-nodes // parts) - spread), nodes // parts + 1):
        excess = nodes - parts * low
        for counts in _compositions(parts, excess, spread):
            if counts[0] == 0:
                continue  # the smallest depth must be `low` itself, so each multiset appears once
            shape = tuple((low + i, c) for i, c in reversed(list(enumerate(counts))) if c)
            if all(allowed(depth) for depth, _ in shape):
                yield shape


def _compositions(parts: int, excess: int, spread: int) -> Iterator[list[int]]:
    """Counts c_0..c_spread >= 0 with sum c_i = parts and sum i * c_i = excess."""
    if spread == 0:
        if excess == 0:
            yield [parts]
        return
    for top in range(min(parts, excess // spread) + 1):
        for rest in _compositions(parts - top, excess - top * spread, spread - 1):
            yield [*rest, top]


class DynamicSearch:
    """Algorithm 1 over `nodes` nodes for one (profile, cluster, job); reusable across DP degrees."""

    def __init__(self, profile: ModelProfile, cluster: ClusterSpec, job: JobSpec, nodes: int) -> None:
        self.profile = profile
        self.cluster = cluster
        self.job = job
        self.nodes = nodes
        self.table = shape_table(profile, cluster, job.num_microbatches)
        self.evaluated = 0  # partitions timed exactly (the rest were pruned by their lower bound)

    def allowed(self, depth: int) -> bool:
        low, high = self.job.pp_range or (1, self.profile.num_layers)
        return low <= depth <= high and self.table.split(depth) is not None

    def _sync(self, depths: Sequence[int], dp: int) -> tuple[tuple[tuple[tuple[int, int], ...], ...], float]:
        if dp <= 1:
            return (), 0.0
        rounds = self.table.rounds(tuple(depths))
        return rounds, allreduce_time(self.profile, self.cluster, rounds, dp)

    def lower_bound(self, shape: Sequence[tuple[int, int]]) -> tuple[float, list[int]]:
        """A lower bound on `evaluate(shape).step_time_s` (the exact balance of the pipelines' lower bounds,
        plus the exact all-reduce) and that balance's allocation, a good start for the exact one."""
        depths = [depth for depth, _ in shape]
        counts = [count for _, count in shape]
        total = self.job.num_microbatches
        share = [total * depth // self.nodes - 1 for depth in depths]
        base, _, makespan = distribute(
            counts, total, lambda c, m: self.table.lower(depths[c], m), start=share
        )
        return makespan + self._sync(depths, sum(counts))[1], base

    def evaluate(self, shape: Sequence[tuple[int, int]], start: Sequence[int] | None = None) -> Layout:
        """Exact batch distribution and step time of one partition ((depth, count), ...)."""
        self.evaluated += 1
        depths = [depth for depth, _ in shape]
        counts = [count for _, count in shape]
        total = self.job.num_microbatches
        if start is None:
            start = [total * depth // self.nodes - 1 for depth in depths]
        base, extra, makespan = distribute(
            counts, total, lambda c, m: self.table.time(depths[c], m), start=start
        )
        rounds, sync = self._sync(depths, sum(counts))
        classes = [
            ShapeClass(split=self.table.require(depth), count=counts[c], microbatches=base[c], extra=extra[c])
            for c, depth in enumerate(depths)
        ]
        return Layout(classes=tuple(classes), pipeline_s=makespan, allreduce_s=sync, rounds=rounds)

    def search(self, degrees: Sequence[int], spread: int, keep: int = 1) -> list[Layout]:
        """The `keep` best layouts with these DP degrees (see `search_groups`)."""
        return self.search_groups([(degrees, spread)], keep)

    def search_groups(self, groups: Sequence[tuple[Sequence[int], int]], keep: int = 1) -> list[Layout]:
        """The `keep` best layouts over partitions of each (DP degrees, spread) group, each partition tried
        once. Lowest step time first; ties go to the more symmetric layout, then to fewer pipelines.

        Branch and bound: every partition gets a cheap lower bound; partitions are timed exactly in bound
        order until the bound exceeds the `keep`-th best step time found, so the answer is the same as
        timing them all."""
        shapes: list[tuple[tuple[int, int], ...]] = []
        seen: set[tuple[tuple[int, int], ...]] = set()
        for degrees, spread in groups:
            for dp in degrees:
                if dp > self.job.num_microbatches:
                    continue  # a pipeline without micro-batches would idle
                # A pipeline takes at most a node per layer: past dp x layers nodes the rest idle whatever
                # the split, so partition the nodes the pipelines can use (none of `self.nodes` would).
                used = min(self.nodes, dp * self.profile.num_layers)
                for shape in partitions(used, dp, self.allowed, spread):
                    if shape not in seen:
                        seen.add(shape)
                        shapes.append(shape)
        return self._best(shapes, keep)

    def _best(self, shapes: Sequence[tuple[tuple[int, int], ...]], keep: int) -> list[Layout]:
        pending = []
        for serial, shape in enumerate(shapes):
            bound, start = self.lower_bound(shape)
            pending.append((bound, serial, shape, start))
        pending.sort(key=lambda item: item[:2])
        found: list[tuple[float, int, int, int, Layout]] = []
        for bound, serial, shape, start in pending:
            if len(found) >= keep and bound > found[keep - 1][4].step_time_s * (1 + TIE):
                break
            layout = self.evaluate(shape, start)
            found.append((_rounded(layout.step_time_s), len(layout.classes), layout.dp, serial, layout))
            found.sort(key=lambda item: item[:4])
        return [item[4] for item in found[:keep]]

    def depth_degrees(self, minimum: int = 1) -> list[int]:
        """One DP degree per pipeline depth (nodes // depth): with spread 1 these partitions give a nearly
        equal layout of every feasible depth, a cheap complement to the window around the current degree."""
        low, high = self.job.dp_range or (1, self.nodes)
        degrees = {self.nodes // depth for depth in range(1, min(self.nodes, self.profile.num_layers) + 1)}
        return sorted(dp for dp in degrees if max(low, minimum) <= dp <= high)

    def most_pipelines(self) -> int:
        """The most pipelines that fit (each at least the shallowest depth that fits in memory); 0 if none."""
        low, high = self.job.dp_range or (1, self.nodes)
        most = 0
        for depth in range(1, min(self.nodes, self.profile.num_layers) + 1):
            if self.allowed(depth):
                dp = min(self.nodes // depth, high, self.job.num_microbatches)
                most = max(most, dp if dp >= low else 0)
        return most

    def symmetric(self, keep: int = 1, minimum: int = 1) -> list[Layout]:
        """Varuna-style layouts: identical pipelines, per depth as many as fit (some nodes may idle), at
        least `minimum` of them (f + 1 keeps a replica of every layer through f more failures)."""
        low, high = self.job.dp_range or (1, self.nodes)
        shapes = []
        for depth in range(1, min(self.nodes, self.profile.num_layers) + 1):
            dp = min(self.nodes // depth, high, self.job.num_microbatches)
            if dp >= max(low, minimum) and self.allowed(depth):
                shapes.append(((depth, dp),))
        return self._best(shapes, keep)


def _rounded(value: float) -> float:
    """A sort key that treats estimates equal within the tie tolerance as equal."""
    if value <= 0 or not math.isfinite(value):
        return value
    exponent = math.floor(math.log10(value))
    return round(value, 9 - exponent)


def degree_window(current: int, nodes: int, job: JobSpec, width: int, minimum: int = 1) -> list[int]:
    """DP degrees within `width` of `current`, inside the job's dp_range and [minimum, nodes]."""
    low, high = job.dp_range or (1, nodes)
    first = max(low, minimum, 1, current - width)
    last = min(high, nodes, current + width)
    return list(range(first, last + 1))


def all_degrees(nodes: int, job: JobSpec, minimum: int = 1) -> list[int]:
    low, high = job.dp_range or (1, nodes)
    return list(range(max(low, minimum, 1), min(high, nodes) + 1))
