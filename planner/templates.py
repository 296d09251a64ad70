"""Oobleck pipeline templates (Oobleck sections 4-5): node specification, GPU-stage mapping, instantiation,
batch distribution and reinstantiation after failures.

- `node_specification`: the smallest memory-feasible template size n0 and the consecutive sizes n0..N - f n0,
  which by the Frobenius argument (appendix A) combine into any N' in [(f + 1) n0, N] nodes.
- `generate_templates`: one optimal template per size (exact optimum of the 1F1B objective, see
  `_stage_mapping`), each reported with the exact 1F1B iteration time at 4 x stages micro-batches.
- `enumerate_instantiations` / `instantiate`: coin-change enumeration of template counts (eq. 5, Fig. 7)
  with at least f + 1 pipelines, micro-batches distributed to minimise the slowest pipeline exactly.
- `reinstantiate` (`template_recovery`, which builds on this module): section 5.1's simple / borrow / merge
  steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ._mapping import Mapping
from ._stage_mapping import StageMapper
from ._time_curve import TimeCurve, balance_curves, makespan_of
from .errors import PlannerError
from .estimator import allreduce_time, estimate_pipeline, pipeline_arrays, stage_peak_memory
from .plan import PipelinePlan, Plan, Policy, StagePlan
from .profile import ModelProfile
from .restorer import allreduce_rounds, allreduce_rounds_from_bounds
from .spec import ClusterSpec, JobSpec

__all__ = [
    "PipelineTemplate",
    "TemplateSet",
    "TemplateStage",
    "assemble",
    "balance_tables",
    "distribute",
    "enumerate_instantiations",
    "generate_templates",
    "instantiate",
    "node_specification",
    "pipeline_plan",
    "template_step_time",
]

# Above this many template combinations, instantiation ranks only those built from at most two template
# sizes: the number of partitions explodes with the cluster (about 2e8 for 100 nodes).
_MAX_COMBINATIONS = 20_000
# Relative tolerance under which two makespans count as equal (they come from sums in different orders).
_TIE = 1e-12


class TemplateStage(BaseModel):
    """Layers [start, end) on some GPUs of one template node."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: tuple[int, int]
    node: int = Field(ge=0, description="Node index within the template, 0..nodes-1.")
    gpus: tuple[int, ...] = Field(min_length=1, description="GPU indices within that node.")

    @model_validator(mode="after")
    def _check(self) -> TemplateStage:
        if not 0 <= self.layers[0] < self.layers[1]:
            raise ValueError(f"layers must be [start, end) with start < end, got {list(self.layers)}")
        if len(set(self.gpus)) != len(self.gpus) or min(self.gpus) < 0:
            raise ValueError(f"gpus must be distinct non-negative indices, got {list(self.gpus)}")
        return self


class PipelineTemplate(BaseModel):
    """How a pipeline of `nodes` nodes runs the model: stages in order, each inside one node."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nodes: int = Field(ge=1)
    stages: tuple[TemplateStage, ...] = Field(min_length=1)
    iteration_s: float = Field(ge=0, description="Exact 1F1B time at 4 x stages micro-batches.")
    objective_s: float = Field(default=0.0, ge=0, description="sum t + (4S - 1) max t, what was minimised.")
    curve_s: tuple[float, ...] = Field(
        default=(), description="Exact 1F1B times for 1..K micro-batches (`_time_curve`); () = not computed."
    )
    slope_s: float = Field(default=0.0, ge=0, description="Seconds per micro-batch beyond the curve's head.")

    @model_validator(mode="after")
    def _check(self) -> PipelineTemplate:
        expected = 0
        for stage in self.stages:
            if stage.layers[0] != expected:
                raise ValueError(f"stages must be contiguous from layer 0; gap or overlap at {expected}")
            if stage.node >= self.nodes:
                raise ValueError(f"stage on node {stage.node} outside a {self.nodes}-node template")
            expected = stage.layers[1]
        if {stage.node for stage in self.stages} != set(range(self.nodes)):
            raise ValueError("every template node must host at least one stage")
        return self

    @property
    def num_stages(self) -> int:
        return len(self.stages)


class TemplateSet(BaseModel):
    """Templates of consecutive sizes n0, n0 + 1, ...; any N' in [(f + 1) n0, N] is a sum of them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    n0: int = Field(ge=1)
    fault_tolerance: int = Field(ge=0)
    templates: tuple[PipelineTemplate, ...] = Field(min_length=1)
    planning_s: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> TemplateSet:
        sizes = [template.nodes for template in self.templates]
        if sizes != list(range(self.n0, self.n0 + len(sizes))):
            raise ValueError(f"template sizes must be consecutive from n0={self.n0}, got {sizes}")
        return self

    @property
    def sizes(self) -> list[int]:
        return [template.nodes for template in self.templates]

    def for_nodes(self, n: int) -> PipelineTemplate:
        index = n - self.n0
        if not 0 <= index < len(self.templates):
            raise PlannerError("nodes", f"no template of {n} nodes (sizes {self.n0}..{self.sizes[-1]})")
        return self.templates[index]


# ---- node specification and generation ------------------------------------------------------------------
def _mapper(profile: ModelProfile, cluster: ClusterSpec, largest: int) -> StageMapper:
    return StageMapper(profile, cluster.gpus_per_node, largest, cluster.device_memory_bytes)


def _specify(
    profile: ModelProfile, cluster: ClusterSpec, fault_tolerance: int
) -> tuple[list[int], StageMapper, dict[int, Mapping]]:
    if fault_tolerance < 0:
        raise PlannerError("fault_tolerance", f"must be >= 0, got {fault_tolerance}")
    total = cluster.nodes
    mapper = _mapper(profile, cluster, total)
    mappings: dict[int, Mapping] = {}
    n0 = None
    # Each node hosts at least one stage of at least one layer, so sizes beyond L cannot exist.
    for size in range(1, min(total, profile.num_layers) + 1):
        found = mapper.best(size)
        if found is not None:
            n0, mappings[size] = size, found
            break
    if n0 is None:
        raise PlannerError(
            "device_memory_bytes",
            f"{profile.name} does not fit {min(total, profile.num_layers)} nodes of "
            f"{cluster.gpus_per_node} x {cluster.device_memory_bytes} bytes at any stage split",
        )
    if (fault_tolerance + 1) * n0 > total:
        raise PlannerError(
            "fault_tolerance",
            f"f={fault_tolerance} needs {(fault_tolerance + 1) * n0} nodes ({fault_tolerance + 1} pipelines "
            f"of at least {n0}), the cluster has {total}",
        )
    largest = total - fault_tolerance * n0
    sizes = [n0]
    for size in range(n0 + 1, largest + 1):
        found = mapper.best(size) if size <= profile.num_layers else None
        if found is None:
            break
        sizes.append(size)
        mappings[size] = found
    if sizes[-1] < min(largest, 2 * n0 - 1):
        # Consecutive sizes n0..2n0-1 are what make every N' >= n0 representable (appendix A).
        raise PlannerError(
            "nodes", f"templates stop at {sizes[-1]} nodes; covering every cluster size needs {2 * n0 - 1}"
        )
    return sizes, mapper, mappings


def node_specification(profile: ModelProfile, cluster: ClusterSpec, fault_tolerance: int) -> list[int]:
    """[n0, ..., N - f n0]: template sizes. Sizes above the layer count (or memory-infeasible ones) are left
    out; the remaining run still has at least n0 consecutive sizes, which keeps the Frobenius guarantee."""
    return _specify(profile, cluster, fault_tolerance)[0]


def _template(profile: ModelProfile, cluster: ClusterSpec, mapping: Mapping) -> PipelineTemplate:
    stages = tuple(
        TemplateStage(
            layers=(stage.start, stage.end),
            node=stage.node,
            gpus=tuple(range(stage.first_gpu, stage.first_gpu + stage.gpus)),
        )
        for stage in mapping.stages
    )
    template = PipelineTemplate(
        nodes=mapping.nodes, stages=stages, iteration_s=0.0, objective_s=mapping.objective
    )
    # The time curve is part of the template, made offline with it: instantiation then never simulates.
    curve = template_curve(profile, cluster, template)
    return template.model_copy(
        update={
            "iteration_s": curve.at(4 * template.num_stages),
            "curve_s": tuple(float(x) for x in curve.head),
            "slope_s": curve.slope,
        }
    )


def template_curve(profile: ModelProfile, cluster: ClusterSpec, template: PipelineTemplate) -> TimeCurve:
    """The template's 1F1B time curve: stored at generation, computed here for hand-made templates."""
    if template.curve_s:
        return TimeCurve(head=np.asarray(template.curve_s, dtype=np.float64), slope=template.slope_s)
    plan = pipeline_plan(profile, template, list(range(template.nodes)), 1)
    return TimeCurve.of_pipeline(*pipeline_arrays(profile, cluster, plan))


def generate_templates(profile: ModelProfile, cluster: ClusterSpec, fault_tolerance: int) -> TemplateSet:
    """Node specification plus the optimal GPU-stage mapping of every template size."""
    began = time.perf_counter()
    sizes, _, mappings = _specify(profile, cluster, fault_tolerance)
    templates = tuple(_template(profile, cluster, mappings[size]) for size in sizes)
    return TemplateSet(
        n0=sizes[0],
        fault_tolerance=fault_tolerance,
        templates=templates,
        planning_s=time.perf_counter() - began,
    )


# ---- pipelines from templates ---------------------------------------------------------------------------
def pipeline_plan(
    profile: ModelProfile,
    template: PipelineTemplate,
    nodes: Sequence[int],
    microbatches: int,
) -> PipelinePlan:
    """The template laid on real node ids (`nodes[i]` plays template node i), with stage estimates."""
    if len(nodes) != template.nodes:
        raise PlannerError("nodes", f"template needs {template.nodes} nodes, got {len(nodes)}")
    count = template.num_stages
    stages = []
    for index, stage in enumerate(template.stages):
        start, end = stage.layers
        forward, backward = profile.stage_times(start, end, len(stage.gpus))
        peak = stage_peak_memory(profile, start, end, len(stage.gpus), index, count, microbatches)
        stages.append(
            StagePlan(
                layers=stage.layers,
                node=nodes[stage.node],
                gpus=stage.gpus,
                forward_s=forward,
                backward_s=backward,
                peak_memory_bytes=peak,
            )
        )
    return PipelinePlan(stages=tuple(stages), microbatches=microbatches, template=template.nodes)


def template_step_time(
    profile: ModelProfile, cluster: ClusterSpec, template: PipelineTemplate, microbatches: int
) -> float:
    """Exact 1F1B time of one pipeline of this template running `microbatches` micro-batches."""
    plan = pipeline_plan(profile, template, list(range(template.nodes)), microbatches)
    return estimate_pipeline(profile, cluster, plan)


def enumerate_instantiations(sizes: Sequence[int], nodes: int, min_pipelines: int) -> list[tuple[int, ...]]:
    """Every (x_0, ..., x_{p-1}) with sum x_i sizes[i] == nodes and sum x_i >= min_pipelines.

    Oobleck eq. 5: X(p', N') = X(p' - 1, N') ++ theta(X(p', N' - n_p'), p'), filled bottom-up over N'.
    """
    return [tuple(int(x) for x in row) for row in _instantiation_rows(sizes, nodes, min_pipelines)]


def _instantiation_rows(sizes: Sequence[int], nodes: int, min_pipelines: int) -> np.ndarray:
    """`enumerate_instantiations` as an integer matrix, one combination per row."""
    if nodes < 0:
        raise PlannerError("nodes", f"must be >= 0, got {nodes}")
    if any(size < 1 for size in sizes):
        raise PlannerError("sizes", f"template sizes must be positive, got {list(sizes)}")
    count = len(sizes)
    # table[n]: ids of the combinations over the templates seen so far that use exactly n nodes, in eq. 5's
    # order. A combination is stored as (parent, template): its parent plus one pipeline of that template,
    # so the table moves one id per combination instead of a whole row (copying rows was the whole cost at
    # 31 templates); the rows are built once at the end by walking the parents.
    parent: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]  # id 0: the empty combination (its own parent)
    column: list[int] = [0]  # the template added by each block of ids, and the block's length
    length: list[int] = [1]
    created = 1
    empty = np.zeros(0, dtype=np.int64)
    table: list[np.ndarray] = [empty] * (nodes + 1)
    table[0] = np.zeros(1, dtype=np.int64)
    for index, size in enumerate(sizes):
        for total in range(size, nodes + 1):
            previous = table[total - size]
            if len(previous):
                fresh = np.arange(created, created + len(previous), dtype=np.int64)
                created += len(previous)
                parent.append(previous)
                column.append(index)
                length.append(len(previous))
                table[total] = np.concatenate([table[total], fresh])
    parents, columns = np.concatenate(parent), np.repeat(np.asarray(column), np.asarray(length))
    ids = table[nodes]
    kind = np.int16 if nodes < 2**15 else np.int64
    rows = np.zeros((len(ids), count), dtype=kind)
    lines = np.arange(len(ids))
    while len(ids):
        live = ids != 0
        ids, lines = ids[live], lines[live]
        rows[lines, columns[ids]] += 1  # one pipeline per row per pass: no repeated (row, column) pairs
        ids = parents[ids]
    kept: np.ndarray = rows[rows.sum(axis=1) >= min_pipelines]
    return kept


def _more_instantiations_than(sizes: Sequence[int], nodes: int, cap: int) -> bool:
    """Whether more than `cap` combinations of `sizes` use exactly `nodes` nodes. Coin-change counting, one
    cumulative sum per size along each residue class (floats: the count of 1,024 nodes has 30 digits, and
    every count that matters, up to `cap`, is exact)."""
    ways = np.zeros(nodes + 1, dtype=np.float64)
    ways[0] = 1.0
    for size in sizes:
        if size > nodes:
            continue
        padded = np.concatenate([ways, np.zeros(-(nodes + 1) % size)]).reshape(-1, size)
        ways = np.cumsum(padded, axis=0).ravel()[: nodes + 1]
    return bool(ways[nodes] > cap)


def _combinations(sizes: Sequence[int], nodes: int, min_pipelines: int) -> np.ndarray:
    if not _more_instantiations_than(sizes, nodes, _MAX_COMBINATIONS):
        return _instantiation_rows(sizes, nodes, min_pipelines)
    # Too many partitions to rank one by one: keep those mixing at most two template sizes, in sorted order
    # without repeats. Such a row is (first size i, its count a, second size j > i, its count b); for each i,
    # every count of it and every j at once. A row of one size has no j (b = 0; j = count below).
    count = len(sizes)
    widths = np.asarray(sizes, dtype=np.int64)
    firsts, counts_a, seconds, counts_b = [], [], [], []
    for i, first in enumerate(sizes):
        many = np.arange(nodes // first + 1, dtype=np.int64)
        rest = nodes - many * first
        alone = np.flatnonzero(rest == 0)
        firsts.append(np.full(len(alone), i, dtype=np.int64))
        counts_a.append(many[alone])
        seconds.append(np.full(len(alone), count, dtype=np.int64))
        counts_b.append(np.zeros(len(alone), dtype=np.int64))
        hit, other = np.nonzero((rest[:, None] % widths[None, i + 1 :] == 0) & (rest[:, None] > 0))
        firsts.append(np.full(len(hit), i, dtype=np.int64))
        counts_a.append(many[hit])
        seconds.append(i + 1 + other)
        counts_b.append(rest[hit] // widths[i + 1 + other])
    i_s, a_s, j_s, b_s = (np.concatenate(part) for part in (firsts, counts_a, seconds, counts_b))
    # A count of zero leaves that size out: a row of size j alone is written with j first.
    lone = a_s == 0
    i_s, a_s = np.where(lone, j_s, i_s), np.where(lone, b_s, a_s)
    j_s, b_s = np.where(lone, count, j_s), np.where(lone, 0, b_s)
    keep = a_s + b_s >= min_pipelines  # (i = count: the empty combination, of zero nodes)
    i_s, a_s, j_s, b_s = i_s[keep], a_s[keep], j_s[keep], b_s[keep]
    # Tuples sort ascending on x_0, x_1, ...: a later first size (more leading zeros) comes first, then its
    # count; then a later second size, then its count. One integer key in that order, deduplicated.
    span = nodes + 1
    key = (((count - i_s) * span + a_s) * (count + 1) + (count - j_s)) * span + b_s
    _, first_of = np.unique(key, return_index=True)
    rows = np.zeros((len(first_of), count), dtype=np.int64)
    line = np.arange(len(first_of))
    one = i_s[first_of] < count
    rows[line[one], i_s[first_of][one]] = a_s[first_of][one]
    two = j_s[first_of] < count
    rows[line[two], j_s[first_of][two]] = b_s[first_of][two]
    return rows


class _TimeCache:
    """Each template's time curve (`template_curve`), shared by every combination ranked."""

    def __init__(self, profile: ModelProfile, cluster: ClusterSpec, templates: TemplateSet) -> None:
        self.profile, self.cluster, self.templates = profile, cluster, templates
        self.curves: dict[int, TimeCurve] = {}
        self.bottleneck: dict[int, float] = {}
        self.offset: dict[int, float] = {}
        self.slope: dict[int, float] = {}  # the curve's line slope (>= the bottleneck when positive)
        self.slope_offset: dict[int, float] = {}  # the least t(m) - m x slope
        self.heaviest: dict[int, float] = {}  # the largest stage's parameter bytes
        self._rounds: dict[tuple[int, ...], list[list[tuple[int, int]]]] = {}

    def curve(self, size: int) -> TimeCurve:
        if size not in self.curves:
            template = self.templates.for_nodes(size)
            self.curves[size] = template_curve(self.profile, self.cluster, template)
            bottleneck = max(
                sum(self.profile.stage_times(*stage.layers, len(stage.gpus))) for stage in template.stages
            )
            head = self.curves[size].head
            self.bottleneck[size] = bottleneck
            # Rounded down a hair so the bound stays below t even where the sums round differently.
            self.offset[size] = float(np.min(head - bottleneck * np.arange(1, len(head) + 1))) * (1 - 1e-12)
            # The same bound along the curve's own slope: beyond the head t(m) - m x slope is constant, so the
            # head's least value holds for every m. Far tighter than the bottleneck's at long batches, where
            # the steady state is slower than the bottleneck (sends on the critical cycle). Lowered by a
            # margin of the curve's scale so rounding never lifts it above t.
            slope = max(self.curves[size].slope, bottleneck)
            lowest = float(np.min(head - slope * np.arange(1, len(head) + 1)))
            self.slope[size] = slope
            self.slope_offset[size] = lowest - 1e-11 * (abs(lowest) + float(head[-1]))
            param = self.profile.prefix("param")
            self.heaviest[size] = max(float(param[s.layers[1]] - param[s.layers[0]]) for s in template.stages)
        return self.curves[size]

    def sync(self, groups: Sequence[tuple[int, int]]) -> float:
        """Gradient all-reduce time of pipelines built from these (template size, count) groups."""
        replicas = sum(many for _, many in groups)
        if replicas <= 1:
            return 0.0
        key = tuple(size for size, _ in groups)
        if key not in self._rounds:
            shapes = [
                [0, *(stage.layers[1] for stage in self.templates.for_nodes(size).stages)] for size in key
            ]
            self._rounds[key] = allreduce_rounds_from_bounds(shapes)
        return allreduce_time(self.profile, self.cluster, self._rounds[key], replicas)

    def __call__(self, size: int, microbatches: int) -> float:
        return self.curve(size).at(microbatches)


def balance_tables(
    tables: Sequence[np.ndarray], copies: Sequence[int], total: int
) -> tuple[float, list[int]]:
    """Min-max split of `total` micro-batches over groups of identical pipelines: `copies[g]` pipelines whose
    time for m micro-batches is `tables[g][m - 1]` (non-decreasing). Returns the optimal makespan and the
    count per pipeline of each group (a list per group flattened in group order)."""
    return balance_curves([TimeCurve.exact(table) for table in tables], copies, total)


def distribute(times: _TimeCache, sizes: Sequence[int], total: int) -> list[int]:
    """Micro-batches per pipeline (in the order of `sizes`) minimising the slowest pipeline's time."""
    distinct = sorted(set(sizes))
    _, counts = balance_curves([times.curve(s) for s in distinct], [sizes.count(s) for s in distinct], total)
    # Hand the per-group counts back in the callers' pipeline order.
    queues: dict[int, list[int]] = {}
    offset = 0
    for size in distinct:
        many = sizes.count(size)
        queues[size] = counts[offset : offset + many]
        offset += many
    return [queues[size].pop(0) for size in sizes]


def assemble(
    profile: ModelProfile,
    cluster: ClusterSpec,
    job: JobSpec,
    templates: TemplateSet,
    pipelines: Sequence[tuple[PipelineTemplate, Sequence[int]]],
    times: _TimeCache | None = None,
) -> Plan:
    """A Plan from templates laid on node ids: micro-batches balanced, step time = slowest pipeline +
    gradient all-reduce rounds."""
    cache = times or _TimeCache(profile, cluster, templates)
    total = job.num_microbatches
    if total < len(pipelines):
        raise PlannerError(
            "global_batch",
            f"{job.global_batch} samples are {total} micro-batches, fewer than the {len(pipelines)} "
            f"pipelines; the nearest global batch that can be split is "
            f"{len(pipelines) * job.microbatch_size}",
        )
    counts = distribute(cache, [template.nodes for template, _ in pipelines], total)
    plans = tuple(
        pipeline_plan(profile, template, nodes, count)
        for (template, nodes), count in zip(pipelines, counts, strict=True)
    )
    rounds = allreduce_rounds(plans)
    compute = max(
        cache(template.nodes, count) for (template, _), count in zip(pipelines, counts, strict=True)
    )
    step = compute + allreduce_time(profile, cluster, rounds, len(plans))
    return Plan(
        policy=Policy.TEMPLATES,
        microbatch_size=job.microbatch_size,
        pipelines=plans,
        step_time_s=step,
        allreduce_rounds=tuple(tuple(segments) for segments in rounds),
    )


def _rank(cache: _TimeCache, sizes: Sequence[int], combos: np.ndarray, total: int) -> tuple[int, ...]:
    """The combination with the smallest step time: the min-max 1F1B makespan plus the gradient all-reduce
    across its pipelines (rounds of the colouring, as `assemble` charges them); the first in `combos` order
    among equals. Ranking by the makespan alone picks data-parallel-heavy layouts whose sync costs more than
    their pipelines save.

    Combinations are taken in order of a lower bound: a pipeline's bottleneck stage runs every micro-batch's
    forward and backward, so t(m) >= offset + m x bottleneck (offset: the least t(m) - m x bottleneck, over
    the head; beyond it the slope is at least the bottleneck's), and a pipeline finishing by T runs at most
    (T - offset) / bottleneck micro-batches: T >= (total + sum offset / bottleneck) / sum(1 / bottleneck).
    The all-reduce is at least one stage's parameters reduced over the pipelines (a stage reduces its
    layers' segments one round after another). Once the bound exceeds the best step, no later combination
    can win."""
    present = np.asarray(combos.any(axis=0)).tolist()
    for size, used in zip(sizes, present, strict=True):
        if used:
            cache.curve(size)
    rates = np.asarray([1.0 / cache.bottleneck[size] if size in cache.bottleneck else 0.0 for size in sizes])
    offsets = np.asarray([cache.offset.get(size, 0.0) for size in sizes]) * rates
    matrix = np.asarray(combos, dtype=np.float64)
    bounds = (total + matrix @ offsets) / (matrix @ rates)
    # Either family of lines bounds every pipeline; the slope's is the tighter one at long batches.
    line_rates = np.asarray([1.0 / cache.slope[size] if size in cache.slope else 0.0 for size in sizes])
    line_offsets = np.asarray([cache.slope_offset.get(size, 0.0) for size in sizes]) * line_rates
    bounds = np.maximum(bounds, (total + matrix @ line_offsets) / (matrix @ line_rates))
    replicas = matrix.sum(axis=1)
    heaviest = np.asarray([cache.heaviest.get(size, 0.0) for size in sizes])
    present = np.where(combos > 0, heaviest[None, :], 0.0).max(axis=1)
    cluster = cache.cluster
    sync_floor = np.where(
        replicas > 1,
        present * 2 * (replicas - 1) / replicas / cluster.inter_node_bandwidth
        + 2 * (replicas - 1) * cluster.message_latency_s,
        0.0,
    )
    bounds = bounds + sync_floor
    fits = matrix.sum(axis=1) <= total
    best: tuple[float, int] | None = None
    for index in np.lexsort((np.arange(len(combos)), bounds)):
        if not fits[index]:
            continue
        if best is not None and bounds[index] > best[0] * (1 + _TIE):
            break
        combo = combos[index]
        groups = [(size, int(many)) for size, many in zip(sizes, combo, strict=True) if many]
        sync = cache.sync(groups)
        if best is not None and bounds[index] - sync_floor[index] + sync > best[0] * (1 + _TIE):
            continue  # its exact all-reduce already rules it out; the makespan is not needed
        value = makespan_of([cache.curve(size) for size, _ in groups], [many for _, many in groups], total)
        value += sync
        # Equal makespans (to rounding) keep the earlier combination, as a scan in enumeration order would.
        if (
            best is None
            or value < best[0] * (1 - _TIE)
            or (value <= best[0] * (1 + _TIE) and index < best[1])
        ):
            best = (value, int(index))
    if best is None:  # unreachable: the combination with the fewest pipelines always fits
        raise PlannerError("global_batch", f"no combination fits {total} micro-batches")
    return tuple(int(x) for x in combos[best[1]])


def instantiate(
    templates: TemplateSet,
    nodes: Sequence[int],
    profile: ModelProfile,
    cluster: ClusterSpec,
    job: JobSpec,
) -> Plan:
    """The fastest combination of templates using every node in `nodes` with >= f + 1 pipelines.

    Pipelines take node ids from `nodes` in order, largest template first."""
    began = time.perf_counter()
    if len(set(nodes)) != len(nodes):
        raise PlannerError("nodes", "node ids repeat")
    if any(node < 0 for node in nodes):
        raise PlannerError("nodes", "node ids must be non-negative")
    minimum = templates.fault_tolerance + 1
    if len(nodes) < minimum * templates.n0:
        raise PlannerError(
            "nodes",
            f"{len(nodes)} nodes cannot hold {minimum} pipelines of at least {templates.n0} nodes",
        )
    combos = _combinations(templates.sizes, len(nodes), minimum)
    if not len(combos):
        raise PlannerError("nodes", f"no combination of template sizes {templates.sizes} uses {len(nodes)}")
    fewest = int(combos.sum(axis=1).min())
    if job.num_microbatches < fewest:
        raise PlannerError(
            "global_batch",
            f"{job.global_batch} samples are {job.num_microbatches} micro-batches, fewer than the {fewest} "
            f"pipelines needed; the nearest global batch that can be split is {fewest * job.microbatch_size}",
        )
    total = job.num_microbatches
    cache = _TimeCache(profile, cluster, templates)
    best = _rank(cache, templates.sizes, combos, total)
    chosen = sorted(
        (size for size, many in zip(templates.sizes, best, strict=True) for _ in range(many)),
        reverse=True,
    )
    pipelines = []
    offset = 0
    for size in chosen:
        pipelines.append((templates.for_nodes(size), list(nodes[offset : offset + size])))
        offset += size
    plan = assemble(profile, cluster, job, templates, pipelines, cache)
    return plan.model_copy(update={"planning_s": time.perf_counter() - began})
