"""Issue #16's fast instantiation gives the plans of the slow path it replaced (`_templates_reference`): the
eq. 5 enumeration in the same order, the same min-max makespans, the same all-reduce colouring and the same
chosen combination, including the 32 x 8 cell of `bench/bench_templates.py --instantiate` at batch 8,192."""

from __future__ import annotations

from collections import Counter
from unittest.mock import patch

import numpy as np
import pytest
from _templates_reference import (
    Reference,
    count_instantiations,
    instantiation_rows,
    makespan,
    rounds_from_bounds,
    two_size_combinations,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from resilientjob.planner import ClusterSpec, JobSpec, ModelProfile
from resilientjob.planner._time_curve import TimeCurve, balance_curves, makespan_of
from resilientjob.planner.estimator import OneFOneB, pipeline_time
from resilientjob.planner.restorer import allreduce_rounds_from_bounds
from resilientjob.planner.templates import (
    _combinations,
    _instantiation_rows,
    _more_instantiations_than,
    _rank,
    _TimeCache,
    generate_templates,
    instantiate,
)


def gpt_96() -> ModelProfile:
    """The 96-layer GPT of `bench/bench_replan.py`."""
    base = ModelProfile.load("gpt3-6.7b")
    return ModelProfile(name="gpt3-96", layers=(base.layers[0], *[base.layers[1]] * 94, base.layers[-1]))


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(1, 9), min_size=1, max_size=6, unique=True).map(sorted),
    st.integers(0, 30),
    st.integers(0, 4),
)
def test_enumeration_keeps_rows_and_order(sizes: list[int], nodes: int, minimum: int) -> None:
    fast = _instantiation_rows(sizes, nodes, minimum)
    assert np.array_equal(fast, instantiation_rows(sizes, nodes, minimum))


def test_enumeration_of_the_bench_cell_keeps_rows_and_order() -> None:
    sizes = list(range(1, 32))
    assert np.array_equal(_instantiation_rows(sizes, 32, 2), instantiation_rows(sizes, 32, 2))


curve_groups = st.lists(
    st.tuples(
        st.integers(1, 40),  # head length
        st.floats(0.0, 5.0),  # start
        st.lists(st.floats(0.0, 3.0), min_size=1, max_size=5),  # increments, cycled
        st.one_of(st.just(0.0), st.floats(0.01, 4.0)),  # slope (0: flat beyond the head)
        st.integers(1, 6),  # copies
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=300, deadline=None)
@given(curve_groups, st.integers(0, 5000))
def test_makespan_equals_the_binary_search_per_curve(
    groups: list[tuple[int, float, list[float], float, int]], extra: int
) -> None:
    curves = []
    for head, start, steps, slope, _ in groups:
        increments = [steps[i % len(steps)] for i in range(head)]
        curves.append(TimeCurve(head=start + np.cumsum(increments), slope=slope))
    copies = [many for *_, many in groups]
    total = sum(copies) + extra
    if all(curve.slope <= 0 for curve in curves) and extra > sum(len(c.head) for c in curves):
        total = sum(copies)  # flat curves absorb any batch at their last value; keep the search busy
    assert makespan_of(curves, copies, total) == makespan(curves, copies, total)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(1, 23), max_size=8, unique=True), min_size=1, max_size=5))
def test_colouring_from_bounds_equals_neighbour_sets(cuts: list[list[int]]) -> None:
    shapes = [[0, *sorted(inner), 24] for inner in cuts]
    assert allreduce_rounds_from_bounds(shapes) == rounds_from_bounds(shapes)


def _chosen(plan_sizes: list[int], sizes: list[int]) -> tuple[int, ...]:
    many = Counter(plan_sizes)
    return tuple(many.get(size, 0) for size in sizes)


@pytest.mark.parametrize(
    ("name", "nodes", "gpus", "batch"),
    [
        ("gpt3-2.7b", 12, 1, 64),
        ("gpt3-2.7b", 12, 1, 8192),
        ("bert-large", 10, 4, 8192),
        ("llama2-7b", 9, 8, 128),
        ("gpt3-6.7b", 14, 2, 8192),
    ],
)
def test_instantiate_picks_what_the_exhaustive_ranking_picks(
    name: str, nodes: int, gpus: int, batch: int
) -> None:
    profile = ModelProfile.load(name)
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=gpus)
    job = JobSpec(global_batch=batch, microbatch_size=1, fault_tolerance=1)
    templates = generate_templates(profile, cluster, 1)
    combos = _combinations(templates.sizes, nodes, 2)
    reference = Reference(profile, cluster, templates)
    expected = reference.rank_exhaustive(combos, job.num_microbatches)
    plan = instantiate(templates, list(range(nodes)), profile, cluster, job)
    assert _chosen([p.template or 0 for p in plan.pipelines], templates.sizes) == expected
    assert plan.step_time_s == pytest.approx(reference.value(expected, job.num_microbatches), rel=1e-12)


@pytest.mark.parametrize(("gpus", "batch"), [(1, 8192), (8, 8192), (8, 1536), (4, 300)])
def test_bench_cells_pick_what_the_old_ranking_picked(gpus: int, batch: int) -> None:
    profile = gpt_96()
    cluster = ClusterSpec(nodes=32, gpus_per_node=gpus)
    templates = generate_templates(profile, cluster, 1)
    combos = _combinations(templates.sizes, 32, 2)
    reference = Reference(profile, cluster, templates)
    expected = reference.rank_bottleneck(combos, batch)
    assert _rank(_TimeCache(profile, cluster, templates), templates.sizes, combos, batch) == expected
    # The split of the batch is the old one too.
    curves = [reference.curves[size] for size, many in zip(templates.sizes, expected, strict=True) if many]
    copies = [many for many in expected if many]
    assert balance_curves(curves, copies, batch)[0] == makespan(curves, copies, batch)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_short_batches_on_deep_pipelines_equal_the_simulation(data: st.DataObject) -> None:
    """Counts below stages - 1 take the shared prefix plus their own cool-down, bit for bit the event
    simulation's result (`pipeline_time`), which they replaced for speed."""
    stages = data.draw(st.integers(2, 24))
    times = st.floats(0.01, 3)
    forward = [data.draw(times) for _ in range(stages)]
    backward = [data.draw(times) for _ in range(stages)]
    sends = [data.draw(st.floats(0, 1)) for _ in range(stages - 1)]
    engine = OneFOneB(forward, backward, sends)
    counts = data.draw(st.lists(st.integers(1, stages + 2), min_size=1, max_size=8))
    for microbatches in counts:
        assert engine.time(microbatches) == pipeline_time(forward, backward, microbatches, sends)
    table = OneFOneB(forward, backward, sends).times(stages + 2)
    for microbatches in range(1, stages - 1):
        assert table[microbatches - 1] == pipeline_time(forward, backward, microbatches, sends)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=8, unique=True).map(sorted),
    st.integers(0, 200),
    st.integers(0, 4),
)
def test_large_clusters_keep_the_two_size_combinations_and_counts(
    sizes: list[int], nodes: int, minimum: int
) -> None:
    exact = count_instantiations(sizes, nodes)
    for cap in (0, exact - 1, exact, 20_000):
        assert _more_instantiations_than(sizes, nodes, cap) == (exact > cap)
    if exact > 0:
        with patch("resilientjob.planner.templates._MAX_COMBINATIONS", 0):
            fast = _combinations(sizes, nodes, minimum)
        assert np.array_equal(fast, two_size_combinations(sizes, nodes, minimum))


def test_the_1024_node_count_is_decided_like_the_exact_one() -> None:
    sizes = list(range(8, 100))
    assert _more_instantiations_than(sizes, 1024, 20_000) == (count_instantiations(sizes, 1024) > 20_000)
    assert not _more_instantiations_than(list(range(1, 32)), 32, 20_000)  # 8,349 rows: enumerated
