"""Pipeline shapes for plan search: the best layer split of the model into a given number of stages (one node
per stage), a cheap lower bound on its 1F1B time, and its exact time for any micro-batch count.

The split follows Odyssey's recipe: layers split evenly by count, the leftover layers placed by enumeration
(every placement when there are few; otherwise structured placements plus the min-max placement found by
dynamic programming), splits that would not fit in memory (eq. 14) dropped. Candidates are ranked by a lower
bound on the 1F1B makespan (exact for equal stages); up to `EXACT_DEPTH` stages the best few are re-timed by
simulation. `ShapeTable` caches all of this per depth and is shared by the initial plan and every replan of
a job (`shape_table`).
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .errors import PlannerError
from .estimator import OneFOneB, pipeline_time
from .profile import ModelProfile
from .restorer import allreduce_rounds_from_bounds
from .spec import ClusterSpec

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

ENUMERATE_LIMIT = 512  # remainder placements enumerated exhaustively up to this many
EXACT_SPLITS = 4  # best splits per depth (by the lower bound) re-timed by simulation ...
EXACT_DEPTH = 32  # ... for pipelines up to this deep (4 x 2 x 32^2 simulated ops at most)
TIE = 1e-9  # relative tolerance under which two estimates count as equal


@dataclass(frozen=True, slots=True)
class StageSplit:
    """One pipeline shape: stage boundaries and the per-stage numbers the estimators need."""

    bounds: tuple[int, ...]
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    sends: tuple[float, ...]
    peak_memory_bytes: int
    # max_i(intercepts[i] + m * slopes[i]) bounds the 1F1B time from below once m >= stages.
    intercepts: FloatArray = field(repr=False, compare=False)
    slopes: FloatArray = field(repr=False, compare=False)

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1

    def lower(self, microbatches: int) -> float:
        """A lower bound on `pipeline_time` of this split with `microbatches` micro-batches."""
        if microbatches >= self.stages:
            return float(np.max(self.intercepts + microbatches * self.slopes))
        row = (np.array([self.forward]), np.array([self.backward]), np.array([self.sends]).reshape(1, -1))
        return float(_makespan_bound(*row, microbatches)[0])

    @property
    def layer_counts(self) -> list[int]:
        return [end - start for start, end in itertools.pairwise(self.bounds)]


def _placements(stages: int, extras: int) -> IntArray:
    """Which stages take one of the `extras` leftover layers: every choice when there are few, else a
    structured sample (back, front, middle and evenly spread); the min-max choice is added by the caller."""
    if extras == 0:
        return np.zeros((1, stages), dtype=np.int64)
    if math.comb(stages, extras) <= ENUMERATE_LIMIT:
        rows = list(itertools.combinations(range(stages), extras))
    else:
        middle = (stages - extras) // 2
        rows = [
            tuple(range(stages - extras, stages)),
            tuple(range(extras)),
            tuple(range(middle, middle + extras)),
        ]
        for phase in range(4):
            rows.append(
                tuple(
                    sorted(
                        {min(stages - 1, (i * stages + phase * stages // 4) // extras) for i in range(extras)}
                    )
                )
            )
        rows = [row for row in rows if len(row) == extras]
    matrix = np.zeros((len(rows), stages), dtype=np.int64)
    for index, row in enumerate(rows):
        matrix[index, list(row)] = 1
    return matrix


class ShapeTable:
    """For one (profile, cluster, micro-batch count): the best layer split per pipeline depth and the exact
    pipeline time per (depth, micro-batches). Splits are timed at the depth's node share of the batch
    (`microbatches * stages / nodes`) and checked for memory at the deepest in-flight count any pipeline can
    reach. Tables are kept across calls (`shape_table`): a replan reuses what the initial plan computed."""

    def __init__(self, profile: ModelProfile, cluster: ClusterSpec, microbatches: int) -> None:
        self.profile = profile
        self.cluster = cluster
        self.microbatches = microbatches
        # Node share of the batch is taken over the initial cluster, so the table does not depend on how
        # many nodes are alive and one table serves the initial plan and every replan of a job.
        self.nodes = cluster.nodes
        self.gpus = cluster.gpus_per_node
        scale = 1.0 / profile.speedup(self.gpus)
        self._forward = profile.prefix("forward") * scale
        self._backward = profile.prefix("backward") * scale
        self._static = 2 * profile.prefix("param") + profile.prefix("optimizer")
        self._activation = profile.prefix("activation")
        outputs = np.array([layer.output_bytes for layer in profile.layers], dtype=np.float64)
        self._send = outputs / cluster.inter_node_bandwidth + cluster.message_latency_s
        # Plain lists for the scalar-heavy dynamic programme (numpy scalar indexing is slow).
        self._static_list: list[float] = self._static.tolist()
        self._activation_list: list[float] = self._activation.tolist()
        self._splits: dict[int, StageSplit | None] = {}
        self._times: dict[tuple[int, int], float] = {}
        self._lower: dict[tuple[int, int], float] = {}
        self._engines: dict[int, OneFOneB] = {}
        self._rounds: dict[tuple[int, ...], tuple[tuple[tuple[int, int], ...], ...]] = {}

    # ---- layer split ---------------------------------------------------------------------------------------
    def split(self, stages: int) -> StageSplit | None:
        """The best memory-feasible split of the layers into `stages` stages, or None if none fits."""
        if stages not in self._splits:
            self._splits[stages] = self._best_split(stages)
        return self._splits[stages]

    def require(self, stages: int) -> StageSplit:
        split = self.split(stages)
        if split is None:
            raise PlannerError("device_memory_bytes", f"no split into {stages} stages fits in device memory")
        return split

    def stage_memory(self, start: int, end: int, position: int, stages: int) -> float:
        in_flight = min(stages - position, self.microbatches)
        static = self._static_list[end] - self._static_list[start]
        dynamic = in_flight * (self._activation_list[end] - self._activation_list[start])
        return float(math.floor((static + dynamic) / self.gpus))

    def _minmax_placement(self, stages: int, base: int, extras: int) -> list[int] | None:
        """The placement of leftover layers minimising the slowest stage among memory-feasible ones: dynamic
        programming over (stage, extras used so far), vectorised over the second index. Ties put extras
        late, where fewer activations wait."""
        layers = self.profile.num_layers
        work = self._forward + self._backward
        limit = self.cluster.device_memory_bytes
        used = np.arange(extras + 1)
        best = np.full(extras + 1, math.inf)
        best[0] = 0.0
        choice = np.zeros((stages + 1, extras + 1), dtype=np.int64)
        for stage in range(stages):
            start = np.minimum(stage * base + used, layers)
            in_flight = min(stages - stage, self.microbatches)
            following = np.full(extras + 1, math.inf)
            for take in (0, 1):
                end = start + base + take
                valid = (used + take <= extras) & (end <= layers) & np.isfinite(best)
                end = np.minimum(end, layers)
                memory = np.floor(
                    (
                        self._static[end]
                        - self._static[start]
                        + in_flight * (self._activation[end] - self._activation[start])
                    )
                    / self.gpus
                )
                cost = np.where(
                    valid & (memory <= limit), np.maximum(best, work[end] - work[start]), math.inf
                )
                if take:
                    cost = np.concatenate(([math.inf], cost[:-1]))  # lands on used + 1
                better = cost < following
                following = np.where(better, cost, following)
                choice[stage + 1][better] = take
            best = following
        if not math.isfinite(best[extras]):
            return None
        placement = [0] * stages
        remaining = extras
        for stage in range(stages, 0, -1):
            placement[stage - 1] = int(choice[stage][remaining])
            remaining -= placement[stage - 1]
        return placement

    def _best_split(self, stages: int) -> StageSplit | None:
        layers = self.profile.num_layers
        if stages > layers:
            return None
        base, extras = divmod(layers, stages)
        placements = _placements(stages, extras)
        optimal = self._minmax_placement(stages, base, extras) if extras else None
        if optimal is not None:
            placements = np.vstack([placements, np.array([optimal], dtype=np.int64)])
        counts = placements + base
        bounds = np.zeros((len(counts), stages + 1), dtype=np.int64)
        bounds[:, 1:] = np.cumsum(counts, axis=1)
        low, high = bounds[:, :-1], bounds[:, 1:]
        forward = self._forward[high] - self._forward[low]
        backward = self._backward[high] - self._backward[low]
        in_flight = np.minimum(stages - np.arange(stages), self.microbatches)
        memory = np.floor(
            (
                self._static[high]
                - self._static[low]
                + in_flight * (self._activation[high] - self._activation[low])
            )
            / self.gpus
        )
        peak = memory.max(axis=1)
        feasible = peak <= self.cluster.device_memory_bytes
        if not feasible.any():
            return None
        reference = max(1, round(self.microbatches * stages / self.nodes))
        sends = self._send[high[:, :-1] - 1] if stages > 1 else np.zeros((len(counts), 0))
        bound = _quantise(_makespan_bound(forward, backward, sends, reference))
        order = [int(i) for i in np.lexsort((peak, bound)) if feasible[i]]
        # The bound ranks splits (exact for equal stages); where simulating is cheap, the best few are
        # re-timed exactly, since unequal stages can reorder them by a few percent.
        index = order[0]
        if len(order) > 1 and stages <= EXACT_DEPTH:
            # The bound ranks splits (exactly for equal stages). Unequal stages can reorder the best few by a
            # few percent through the pipeline's fill and drain, so those are simulated exactly up to
            # 2 x stages micro-batches (fill, drain and the start of the steady state) and extended at the
            # steady-state rate of their slowest stage.
            probe = min(reference, 2 * stages)
            timed = []
            for i in order[:EXACT_SPLITS]:
                head = pipeline_time(forward[i].tolist(), backward[i].tolist(), probe, sends[i].tolist())
                slowest = float((forward[i] + backward[i]).max())
                timed.append((head + (reference - probe) * slowest, float(peak[i]), i))
            best = timed[0]
            for key in timed[1:]:
                if _better(key, best):
                    best = key
            index = best[2]
        intercepts, slopes = _bound_lines(forward[index], backward[index], sends[index])
        return StageSplit(
            bounds=tuple(int(b) for b in bounds[index]),
            forward=tuple(float(x) for x in forward[index]),
            backward=tuple(float(x) for x in backward[index]),
            sends=tuple(float(x) for x in sends[index]),
            peak_memory_bytes=int(peak[index]),
            intercepts=intercepts,
            slopes=slopes,
        )

    # ---- timing --------------------------------------------------------------------------------------------
    def time(self, stages: int, microbatches: int) -> float:
        """Exact 1F1B time of the best `stages`-deep pipeline running `microbatches` micro-batches."""
        key = (stages, microbatches)
        found = self._times.get(key)
        if found is None:
            engine = self._engines.get(stages)
            if engine is None:
                split = self.require(stages)
                engine = self._engines[stages] = OneFOneB(split.forward, split.backward, split.sends)
            found = engine.time(microbatches)
            self._times[key] = found
        return found

    def lower(self, stages: int, microbatches: int) -> float:
        """A lower bound on `time(stages, microbatches)`, without simulating."""
        key = (stages, microbatches)
        found = self._lower.get(key)
        if found is None:
            found = self.require(stages).lower(microbatches)
            self._lower[key] = found
        return found

    def rounds(self, depths: tuple[int, ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
        """All-reduce rounds of a layout with pipelines of these (distinct) depths."""
        found = self._rounds.get(depths)
        if found is None:
            shapes = [self.require(depth).bounds for depth in depths]
            found = tuple(tuple(segments) for segments in allreduce_rounds_from_bounds(shapes))
            self._rounds[depths] = found
        return found


_TABLES: OrderedDict[tuple[str, ClusterSpec, int], ShapeTable] = OrderedDict()
_TABLES_KEPT = 8


def shape_table(profile: ModelProfile, cluster: ClusterSpec, microbatches: int) -> ShapeTable:
    """The shared ShapeTable of this job (least recently used tables beyond a few are dropped)."""
    key = (profile.model_dump_json(), cluster, microbatches)
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = ShapeTable(profile, cluster, microbatches)
        while len(_TABLES) > _TABLES_KEPT:
            _TABLES.popitem(last=False)
    else:
        _TABLES.move_to_end(key)
    return table


def clear_shape_tables() -> None:
    """Forget every cached table (benchmarks use it to time a cold search)."""
    _TABLES.clear()


def _bound_terms(
    forward: FloatArray, backward: FloatArray, sends: FloatArray
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Per row and stage k: the earliest start of the first forward at k, the least time from the end of the
    last backward at k to the end of the step, and the least cycle from a forward's start at k to the end of
    the same micro-batch's backward at k (the work of k and every later stage, and the hops both ways)."""
    rows, stages = forward.shape
    link = np.zeros((rows, stages))
    link[:, 1:] = sends  # the hop between stage k - 1 and stage k
    hops = np.cumsum(link, axis=1)
    before = np.zeros((rows, stages))
    before[:, 1:] = np.cumsum(forward, axis=1)[:, :-1]
    arrive = before + hops
    before[:, 1:] = np.cumsum(backward, axis=1)[:, :-1]
    leave = before + hops
    work = forward + backward
    later_work = work.sum(axis=1, keepdims=True) - np.cumsum(work, axis=1) + work
    later_hops = 2 * (hops[:, -1:] - hops)
    return arrive, leave, later_work + later_hops


def _makespan_bound(
    forward: FloatArray, backward: FloatArray, sends: FloatArray, microbatches: int
) -> FloatArray:
    """A lower bound on the 1F1B makespan per row (one row per candidate split): it ranks splits and prunes
    layouts before the exact simulation. Every term is a chain of precedences of the schedule; for stage k:
    - busy: k runs m forwards and m backwards after the first forward arrives;
    - first trip: after its warm-up k waits for micro-batch 0 to go down and come back, then does the rest;
    - window: 1F1B keeps at most stages - k micro-batches in flight at k (forward i + stages - k starts
      after backward i ends), so k needs ceil(m / (stages - k)) full cycles."""
    stages = forward.shape[1]
    m = microbatches
    arrive, leave, cycle = _bound_terms(forward, backward, sends)
    in_flight = stages - np.arange(stages)
    busy = arrive + m * (forward + backward) + leave
    first_trip = arrive + cycle - backward + m * backward + (m - np.minimum(in_flight, m)) * forward + leave
    window = arrive + ((m - 1) // in_flight + 1) * cycle + leave
    bound: FloatArray = np.maximum(np.maximum(busy, first_trip), window).max(axis=1)
    return bound


def _bound_lines(
    forward: FloatArray, backward: FloatArray, sends: FloatArray
) -> tuple[FloatArray, FloatArray]:
    """`_makespan_bound` of one split relaxed to lines in m (intercepts, slopes), valid for m >= stages:
    every warm-up is then full, and ceil(m / n) >= m / n."""
    stages = len(forward)
    arrive, leave, cycle = (term[0] for term in _bound_terms(forward[None], backward[None], sends[None]))
    in_flight = stages - np.arange(stages)
    work = forward + backward
    intercepts = np.concatenate(
        [arrive + leave, arrive + cycle - backward - in_flight * forward + leave, arrive + leave]
    )
    slopes = np.concatenate([work, work, cycle / in_flight])
    return intercepts, slopes


def _quantise(values: FloatArray) -> FloatArray:
    """Round to a relative grid so that float noise in prefix-sum differences does not break ties."""
    scale = float(np.abs(values).max()) or 1.0
    return np.round(values / (scale * TIE))


def _better(key: tuple[float, float, int], best: tuple[float, float, int]) -> bool:
    """Lower time wins; within the tie tolerance, lower peak memory, then the lower index."""
    if key[0] < best[0] * (1 - TIE):
        return True
    if key[0] > best[0] * (1 + TIE):
        return False
    return (key[1], key[2]) < (best[1], best[2])
