"""Oobleck pipeline templates: node specification, exact stage mapping, instantiation, reinstantiation."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilientjob.planner._mapping import Mapping
from resilientjob.planner._node_mapping import NodeSearch
from resilientjob.planner._stage_mapping import StageMapper
from resilientjob.planner.errors import PlannerError
from resilientjob.planner.estimator import (
    OneFOneB,
    allreduce_time,
    estimate_pipeline,
    pipeline_time,
    stage_peak_memory,
)
from resilientjob.planner.plan import Policy
from resilientjob.planner.profile import LayerProfile, ModelProfile, uniform_profile
from resilientjob.planner.spec import ClusterSpec, JobSpec
from resilientjob.planner.template_recovery import reinstantiate
from resilientjob.planner.templates import (
    TemplateSet,
    assemble,
    balance_tables,
    enumerate_instantiations,
    generate_templates,
    instantiate,
    node_specification,
    template_step_time,
)

MiB = 2**20


# ---- independent brute force ----------------------------------------------------------------------------
def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


def brute_force_objective(profile: ModelProfile, gpus: int, nodes: int, memory: int) -> float | None:
    """min over every stage count per node, GPU split per node and layer split of
    sum t + (4S - 1) max t, each stage within memory at its 1F1B peak with 4S micro-batches."""
    layers = profile.num_layers
    best: float | None = None
    for per_node in itertools.product(range(1, gpus + 1), repeat=nodes):
        count = sum(per_node)
        if count > layers:
            continue
        for split in itertools.product(*(list(_compositions(gpus, s)) for s in per_node)):
            widths = [d for node in split for d in node]
            for cuts in itertools.combinations(range(1, layers), count - 1):
                bounds = (0, *cuts, layers)
                times = []
                for k in range(count):
                    start, end = bounds[k], bounds[k + 1]
                    if stage_peak_memory(profile, start, end, widths[k], k, count, 4 * count) > memory:
                        break
                    forward = sum(layer.forward_s for layer in profile.layers[start:end])
                    backward = sum(layer.backward_s for layer in profile.layers[start:end])
                    times.append((forward + backward) / profile.speedup(widths[k]))
                else:
                    value = sum(times) + (4 * count - 1) * max(times)
                    best = value if best is None else min(best, value)
    return best


def random_profile(rng: random.Random, layers: int) -> ModelProfile:
    return ModelProfile(
        layers=tuple(
            LayerProfile(
                forward_s=rng.uniform(0.1, 1.0),
                backward_s=rng.uniform(0.1, 2.0),
                param_bytes=rng.randint(1, 100),
                optimizer_bytes=rng.randint(0, 100),
                activation_bytes=rng.randint(0, 50),
            )
            for _ in range(layers)
        ),
        multi_gpu_efficiency=rng.choice([0.5, 0.9, 1.0]),
    )


def random_speedups(rng: random.Random, profile: ModelProfile, gpus: int) -> ModelProfile:
    """The same layers with an arbitrary speed-up table: sub-linear, super-linear or not even monotone."""
    table = {d: rng.uniform(0.6, 1.2 * d) for d in range(2, gpus + 1)}
    return profile.model_copy(update={"multi_gpu_speedup": table})


def check_mapping(profile: ModelProfile, found: Mapping, gpus: int, nodes: int, memory: int) -> None:
    """Contiguous layers from 0 to L, every GPU of every node used once, every stage within memory."""
    used = {(stage.node, stage.first_gpu + g) for stage in found.stages for g in range(stage.gpus)}
    assert used == {(n, g) for n in range(nodes) for g in range(gpus)}
    assert sum(stage.gpus for stage in found.stages) == nodes * gpus
    assert found.stages[0].start == 0 and found.stages[-1].end == profile.num_layers
    assert [s.start for s in found.stages[1:]] == [s.end for s in found.stages[:-1]]
    count = found.num_stages
    times = []
    for k, stage in enumerate(found.stages):
        assert stage_peak_memory(profile, stage.start, stage.end, stage.gpus, k, count, 4 * count) <= memory
        times.append(sum(profile.stage_times(stage.start, stage.end, stage.gpus)))
    assert found.objective == pytest.approx(sum(times) + (4 * count - 1) * max(times), rel=1e-12)


@pytest.mark.parametrize("seed", range(60))
def test_stage_mapping_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    layers, gpus, nodes = rng.randint(2, 7), rng.randint(1, 3), rng.randint(1, 3)
    profile = random_profile(rng, layers)
    if seed >= 40:  # arbitrary speed-up tables, not only 1 + (d - 1) * efficiency
        profile = random_speedups(rng, profile, gpus)
    memory = rng.choice([10**9, 400, 250, 150])
    expected = brute_force_objective(profile, gpus, nodes, memory)
    found = StageMapper(profile, gpus, nodes + rng.randint(0, 2), memory).best(nodes)
    if expected is None:
        assert found is None
        return
    assert found is not None
    assert found.objective == pytest.approx(expected, rel=1e-9)
    check_mapping(profile, found, gpus, nodes, memory)


def test_node_search_equals_stage_count_search() -> None:
    """The node-level fast path against the stage-count DP (itself checked by brute force above) on larger
    random instances, including every branch: early stops, branch and bound, and the memory fallback."""
    decided = bounded = fallback = 0
    for seed in range(120):
        rng = random.Random(1000 + seed)
        layers, gpus, nodes = rng.randint(4, 18), rng.randint(1, 4), rng.randint(1, 5)
        profile = random_profile(rng, layers)
        if rng.random() < 0.4:
            profile = random_speedups(rng, profile, gpus)
        memory = rng.choice([10**9, 10**9, 2000, 800, 400])
        mapper = StageMapper(profile, gpus, nodes + rng.randint(0, 2), memory)
        search = NodeSearch(mapper)
        done, found = search.best(nodes)
        expected = StageMapper(profile, gpus, nodes, memory).best_by_stage_count(nodes)
        if not done:
            fallback += 1
            assert found is None
            continue
        decided += 1
        bounded += any(not bottleneck and toll > 0 for bottleneck, _, toll in search._passes)
        if expected is None:
            assert found is None
            continue
        assert found is not None
        assert found.objective == pytest.approx(expected.objective, rel=1e-9)
        check_mapping(profile, found, gpus, nodes, memory)
    assert decided >= 80 and bounded >= 5 and fallback >= 2, (decided, bounded, fallback)


def test_node_search_shares_passes_across_sizes() -> None:
    """One StageMapper answers every template size; sizes that reach the same caps reuse passes."""
    rng = random.Random(3)
    profile = random_speedups(rng, random_profile(rng, 16), 4)
    mapper = StageMapper(profile, 4, 6, 10**9)
    separate = [StageMapper(profile, 4, 6, 10**9).best_by_stage_count(size) for size in range(1, 7)]
    for size, expected in zip(range(1, 7), separate, strict=True):
        found = mapper.best(size)
        assert (found is None) == (expected is None)
        if found is not None and expected is not None:
            assert found.objective == pytest.approx(expected.objective, rel=1e-9)
            check_mapping(profile, found, 4, size, 10**9)


def test_template_reports_exact_1f1b_time() -> None:
    profile = random_profile(random.Random(7), 10)
    cluster = ClusterSpec(nodes=4, gpus_per_node=2)
    templates = generate_templates(profile, cluster, 1)
    for template in templates.templates:
        forward, backward = [], []
        for stage in template.stages:
            f, b = profile.stage_times(*stage.layers, len(stage.gpus))
            forward.append(f)
            backward.append(b)
        assert template.iteration_s == pytest.approx(
            pipeline_time(forward, backward, 4 * template.num_stages)
        )
        assert template.nodes == len({stage.node for stage in template.stages})


# ---- node specification ---------------------------------------------------------------------------------
def test_oobleck_fig7_every_combination() -> None:
    """Fig. 7: templates of 2, 3 and 4 nodes over 7 nodes give exactly (2,1,0) and (0,1,1)."""
    assert sorted(enumerate_instantiations([2, 3, 4], 7, 0)) == [(0, 1, 1), (2, 1, 0)]
    assert enumerate_instantiations([2, 3, 4], 7, 3) == [(2, 1, 0)]
    assert enumerate_instantiations([2, 3, 4], 1, 0) == []


@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=4, unique=True),
    nodes=st.integers(0, 18),
    minimum=st.integers(0, 4),
)
@settings(max_examples=60, deadline=None)
def test_enumeration_equals_brute_force(sizes: list[int], nodes: int, minimum: int) -> None:
    expected = [
        combo
        for combo in itertools.product(*(range(nodes // s + 1) for s in sizes))
        if sum(x * s for x, s in zip(combo, sizes, strict=True)) == nodes and sum(combo) >= minimum
    ]
    assert sorted(enumerate_instantiations(sizes, nodes, minimum)) == sorted(expected)


def _memory_for(n0: int) -> int:
    """Device memory that fits a 12-layer uniform model on n0 nodes but not on n0 - 1 (G = 1)."""
    profile = uniform_profile(12, activation_bytes=0)
    per_layer = 2 * profile.layers[0].param_bytes + profile.layers[0].optimizer_bytes
    return -(-12 // n0) * per_layer


@given(n0=st.integers(1, 3), f=st.integers(0, 3), extra=st.integers(0, 6))
@settings(max_examples=25, deadline=None)
def test_frobenius_every_cluster_size_is_instantiable(n0: int, f: int, extra: int) -> None:
    profile = uniform_profile(12, activation_bytes=0)
    total = (f + 1) * n0 + extra
    cluster = ClusterSpec(nodes=total, device_memory_bytes=_memory_for(n0))
    sizes = node_specification(profile, cluster, f)
    assert sizes[0] == n0
    assert sizes == list(range(n0, sizes[-1] + 1))
    assert sizes[-1] == min(total - f * n0, profile.num_layers)
    for alive in range((f + 1) * n0, total + 1):
        assert enumerate_instantiations(sizes, alive, f + 1), f"{alive} nodes not instantiable"


def test_node_specification_errors() -> None:
    profile = uniform_profile(12, activation_bytes=0)
    with pytest.raises(PlannerError) as info:
        node_specification(profile, ClusterSpec(nodes=3, device_memory_bytes=_memory_for(2)), 1)
    assert info.value.field == "fault_tolerance"
    with pytest.raises(PlannerError) as info:
        node_specification(profile, ClusterSpec(nodes=3, device_memory_bytes=10), 0)
    assert info.value.field == "device_memory_bytes"


# ---- instantiation and batch distribution ---------------------------------------------------------------
@pytest.fixture
def two_node_templates() -> tuple[ModelProfile, ClusterSpec, TemplateSet]:
    """n0 = 2 by memory, N = 8, f = 1: sizes 2..6."""
    profile = uniform_profile(12, activation_bytes=0)
    cluster = ClusterSpec(nodes=8, device_memory_bytes=_memory_for(2))
    return profile, cluster, generate_templates(profile, cluster, 1)


def test_template_set_shape(two_node_templates: tuple[ModelProfile, ClusterSpec, TemplateSet]) -> None:
    _, _, templates = two_node_templates
    assert templates.n0 == 2 and templates.sizes == [2, 3, 4, 5, 6]
    assert templates.for_nodes(4).nodes == 4
    with pytest.raises(PlannerError) as info:
        templates.for_nodes(7)
    assert info.value.field == "nodes"


def test_instantiate_picks_fastest_combination(
    two_node_templates: tuple[ModelProfile, ClusterSpec, TemplateSet],
) -> None:
    profile, cluster, templates = two_node_templates
    job = JobSpec(global_batch=12, microbatch_size=1, fault_tolerance=1)
    nodes = [10, 11, 12, 13, 14, 15, 16]
    plan = instantiate(templates, nodes, profile, cluster, job)
    assert sorted(plan.nodes) == nodes and len(plan.pipelines) >= 2
    assert sum(p.microbatches for p in plan.pipelines) == 12
    # Brute force over every combination and every micro-batch split: nothing beats the chosen plan.
    best = None
    for combo in enumerate_instantiations(templates.sizes, 7, 2):
        sizes = [s for s, x in zip(templates.sizes, combo, strict=True) for _ in range(x)]
        for split in _compositions(12, len(sizes)):
            slowest = max(
                template_step_time(profile, cluster, templates.for_nodes(s), m)
                for s, m in zip(sizes, split, strict=True)
            )
            best = slowest if best is None else min(best, slowest)
    compute = max(
        template_step_time(profile, cluster, templates.for_nodes(len(p.nodes)), p.microbatches)
        for p in plan.pipelines
    )
    assert compute == pytest.approx(best)
    assert plan.step_time_s >= compute


def test_batch_distribution_is_optimal(
    two_node_templates: tuple[ModelProfile, ClusterSpec, TemplateSet],
) -> None:
    profile, cluster, templates = two_node_templates
    job = JobSpec(global_batch=9, microbatch_size=1, fault_tolerance=1)
    layout = [(templates.for_nodes(s), list(range(o, o + s))) for s, o in ((4, 0), (2, 4), (3, 6))]
    plan = assemble(profile, cluster, job, templates, layout)
    times = [
        max(template_step_time(profile, cluster, t, m) for (t, _), m in zip(layout, split, strict=True))
        for split in _compositions(9, 3)
    ]
    got = max(
        template_step_time(profile, cluster, t, p.microbatches)
        for (t, _), p in zip(layout, plan.pipelines, strict=True)
    )
    assert got == pytest.approx(min(times))


def test_global_batch_too_small_names_field(
    two_node_templates: tuple[ModelProfile, ClusterSpec, TemplateSet],
) -> None:
    profile, cluster, templates = two_node_templates
    job = JobSpec(global_batch=2, microbatch_size=2, fault_tolerance=1)
    with pytest.raises(PlannerError) as info:
        instantiate(templates, list(range(8)), profile, cluster, job)
    assert info.value.field == "global_batch"
    assert "nearest global batch that can be split is 4" in info.value.message


# ---- reinstantiation ------------------------------------------------------------------------------------
def _current(templates: TemplateSet, profile: ModelProfile, cluster: ClusterSpec, sizes: list[int]) -> object:
    job = JobSpec(global_batch=24, microbatch_size=1, fault_tolerance=1)
    layout, offset = [], 0
    for size in sizes:
        layout.append((templates.for_nodes(size), list(range(offset, offset + size))))
        offset += size
    return assemble(profile, cluster, job, templates, layout), job


def _check_recovery(old: object, new: object, failed: set[int], profile: ModelProfile) -> None:
    from resilientjob.planner.plan import Plan

    assert isinstance(old, Plan) and isinstance(new, Plan)
    assert set(new.nodes) == set(old.nodes) - failed
    assert new.global_batch == old.global_batch and new.generation == old.generation + 1
    held = old.layers_by_node()
    wanted = new.layers_by_node()
    for transfer in new.transfers:
        assert transfer.layer not in held[transfer.dst]  # only missing layers travel
        assert transfer.layer in held[transfer.src] and transfer.src not in failed
        assert transfer.bytes == profile.layers[transfer.layer].state_bytes
    for node, layers in wanted.items():
        received = {t.layer for t in new.transfers if t.dst == node}
        assert layers == (held.get(node, set()) & layers) | received


def test_reinstantiate_simple_keeps_untouched_pipelines(
    two_node_templates: tuple[ModelProfile, ClusterSpec, TemplateSet],
) -> None:
    profile, cluster, templates = two_node_templates
    old, job = _current(templates, profile, cluster, [3, 3, 2])
    new = reinstantiate(templates, old, [1], profile, cluster, job)  # type: ignore[arg-type]
    _check_recovery(old, new, {1}, profile)
    assert sorted(p.nodes for p in new.pipelines) == [(0, 2), (3, 4, 5), (6, 7)]
    untouched = {p.nodes: p.stages for p in old.pipelines if 1 not in p.nodes}  # type: ignore[attr-defined]
    for pipeline in new.pipelines:
        if pipeline.nodes in untouched:
            assert [s.layers for s in pipeline.stages] == [s.layers for s in untouched[pipeline.nodes]]
    assert new.transfers  # the 2-node template splits layers differently from the 3-node one


def test_reinstantiate_borrows_a_node(
    two_node_templates: tuple[ModelProfile, ClusterSpec, TemplateSet],
) -> None:
    profile, cluster, templates = two_node_templates
    old, job = _current(templates, profile, cluster, [3, 3, 2])
    new = reinstantiate(templates, old, [7], profile, cluster, job)  # type: ignore[arg-type]
    _check_recovery(old, new, {7}, profile)
    assert sorted(len(p.nodes) for p in new.pipelines) == [2, 2, 3]
    assert any(p.nodes in ((3, 4, 5), (0, 1, 2)) for p in new.pipelines)  # one lender untouched


def test_reinstantiate_merges_when_nobody_can_lend(
    two_node_templates: tuple[ModelProfile, ClusterSpec, TemplateSet],
) -> None:
    profile, cluster, templates = two_node_templates
    old, job = _current(templates, profile, cluster, [2, 2, 2])
    new = reinstantiate(templates, old, [1], profile, cluster, job)  # type: ignore[arg-type]
    _check_recovery(old, new, {1}, profile)
    assert sorted(len(p.nodes) for p in new.pipelines) == [2, 3]
    assert (4, 5) in {p.nodes for p in new.pipelines}


def test_reinstantiate_with_joined_nodes(
    two_node_templates: tuple[ModelProfile, ClusterSpec, TemplateSet],
) -> None:
    profile, cluster, templates = two_node_templates
    old, job = _current(templates, profile, cluster, [2, 2])
    new = reinstantiate(templates, old, [], profile, cluster, job, joined=[8, 9])  # type: ignore[arg-type]
    assert set(new.nodes) == set(range(4)) | {8, 9}
    assert all(t.dst in {8, 9} for t in new.transfers) and new.transfers


def test_reinstantiate_errors(two_node_templates: tuple[ModelProfile, ClusterSpec, TemplateSet]) -> None:
    profile, cluster, templates = two_node_templates
    old, job = _current(templates, profile, cluster, [2, 2, 2])
    with pytest.raises(PlannerError) as info:
        reinstantiate(templates, old, [0, 1, 2], profile, cluster, job)  # type: ignore[arg-type]
    assert info.value.field == "failed" and "4" in info.value.message
    with pytest.raises(PlannerError) as info:
        reinstantiate(templates, old, [42], profile, cluster, job)  # type: ignore[arg-type]
    assert info.value.field == "failed"


# ---- fast exact tables (issue 2: instantiation without a simulation per micro-batch) ---------------------
@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.1, 2.0), st.floats(0.1, 3.0), st.floats(0.0, 1.0)), min_size=1, max_size=7
    ),
    st.integers(1, 40),
)
def test_onefoneb_times_equal_simulation(stages: list[tuple[float, float, float]], upto: int) -> None:
    forward = [f for f, _, _ in stages]
    backward = [b for _, b, _ in stages]
    sends = [s for _, _, s in stages[1:]]
    table = OneFOneB(forward, backward, sends).times(upto)
    assert len(table) == upto
    for m in range(1, upto + 1):
        assert table[m - 1] == pytest.approx(pipeline_time(forward, backward, m, sends), rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3)), min_size=1, max_size=3), st.integers(0, 6))
def test_balance_tables_equals_brute_force(groups: list[tuple[int, int]], extra: int) -> None:
    # Each group: (stage count, copies); stage times vary by group so the tables differ.
    tables = [
        OneFOneB([1.0 + g] * stages, [2.0 + 0.5 * g] * stages).times(12)
        for g, (stages, _) in enumerate(groups)
    ]
    copies = [many for _, many in groups]
    pipelines = sum(copies)
    total = pipelines + extra
    makespan, counts = balance_tables(tables, copies, total)
    owner = [g for g, many in enumerate(copies) for _ in range(many)]
    assert sum(counts) == total and min(counts) >= 1
    assert max(tables[g][m - 1] for g, m in zip(owner, counts, strict=True)) == makespan
    best = min(
        max(tables[g][m - 1] for g, m in zip(owner, split, strict=True))
        for split in _compositions(total, pipelines)
    )
    assert makespan == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize(
    ("name", "nodes", "batch"), [("bert-large", 30, 128), ("bert-large", 16, 512), ("gpt3-2.7b", 12, 256)]
)
def test_instantiation_ranks_with_gradient_sync_within_5_percent_of_dynamic(
    name: str, nodes: int, batch: int
) -> None:
    """Issue #16: ranked by makespan alone, templates picked DP-heavy layouts whose all-reduce outweighed the
    pipelines; ranked by the full step they come within 5% of the dynamic search on the same nodes."""
    from resilientjob.planner.search import initial_plan

    profile = ModelProfile.load(name)
    cluster = ClusterSpec(nodes=nodes)
    job = JobSpec(global_batch=batch, microbatch_size=1, fault_tolerance=1)
    templates = initial_plan(profile, cluster, job, policy=Policy.TEMPLATES)
    dynamic = initial_plan(profile, cluster, job)
    assert len(templates.pipelines) >= 2
    assert templates.step_time_s <= dynamic.step_time_s * 1.05
    # The ranked value is the plan's own step time: makespan plus the all-reduce rounds it runs.
    makespan = max(estimate_pipeline(profile, cluster, pipeline) for pipeline in templates.pipelines)
    sync = allreduce_time(profile, cluster, templates.allreduce_rounds, len(templates.pipelines))
    assert templates.step_time_s == pytest.approx(makespan + sync, rel=1e-2)
