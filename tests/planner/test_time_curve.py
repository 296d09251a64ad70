"""Time curves (`planner/_time_curve.py`): exact heads, a line beyond them within 1% of the exact 1F1B
times, counts consistent with values, and the min-max split over curves equal to brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilientjob.planner import ClusterSpec, ModelProfile
from resilientjob.planner._time_curve import TimeCurve, balance_curves
from resilientjob.planner.estimator import OneFOneB, pipeline_arrays
from resilientjob.planner.templates import generate_templates, pipeline_plan


@pytest.mark.parametrize(("name", "nodes"), [("bert-large", 12), ("gpt3-2.7b", 12)])
def test_line_beyond_the_head_stays_within_a_tenth_of_a_percent(name: str, nodes: int) -> None:
    profile = ModelProfile.load(name)
    cluster = ClusterSpec(nodes=nodes)
    for template in generate_templates(profile, cluster, 1).templates:
        arrays = pipeline_arrays(
            profile, cluster, pipeline_plan(profile, template, list(range(template.nodes)), 1)
        )
        curve = TimeCurve.of_pipeline(*arrays)
        exact = np.maximum.accumulate(OneFOneB(*arrays).times(2048))
        head = len(curve.head)
        assert np.array_equal(curve.head, exact[:head])
        line = np.array([curve.at(m) for m in range(1, 2049)])
        assert np.max(np.abs(line - exact) / exact) < 1e-2
        # The stored curve is the one instantiation uses.
        assert template.curve_s == tuple(curve.head) and template.slope_s == curve.slope


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 3), st.floats(0.5, 3.0), st.floats(0.1, 2.0), st.integers(1, 5)),
        min_size=1,
        max_size=3,
    ),
    st.integers(0, 14),
)
def test_balance_over_curves_equals_brute_force(
    groups: list[tuple[int, float, float, int]], extra: int
) -> None:
    curves = [
        TimeCurve(head=np.cumsum(np.full(head, step)) + start, slope=step * 1.5)
        for head, start, step, _ in groups
    ]
    copies = [many for *_, many in groups]
    pipelines = sum(copies)
    total = pipelines + extra
    makespan, counts = balance_curves(curves, copies, total)
    assert sum(counts) == total and min(counts) >= 1
    owners = [g for g, many in enumerate(copies) for _ in range(many)]
    assert max(curves[g].at(c) for g, c in zip(owners, counts, strict=True)) == pytest.approx(makespan)
    # Brute force by dynamic programming: best[k] = least max time of the pipelines so far using k units.
    best = {0: 0.0}
    for g in owners:
        best = {
            k: min(max(best[k - c], curves[g].at(c)) for c in range(1, k + 1) if k - c in best)
            for k in range(1, total + 1)
            if any(k - c in best for c in range(1, k + 1))
        }
    best_value = best[total]
    assert makespan == pytest.approx(best_value)
    for curve in curves:
        for m in range(1, 30):
            assert curve.count(curve.at(m), 40) >= m
            assert curve.count(np.nextafter(curve.at(m), 0), 40) <= m - 1 or curve.at(m - 1) == curve.at(m)
