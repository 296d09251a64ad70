"""Min-max allocation against brute force."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilientjob.planner import PlannerError
from resilientjob.planner.balance import balance_linear, balance_monotone, makespan


def _brute_force(times: list[float], total: int, minimum: int) -> float:
    best = float("inf")
    ranges = [range(minimum, total + 1)] * len(times)
    for counts in itertools.product(*ranges):
        if sum(counts) == total:
            best = min(best, makespan(times, counts))
    return best


@settings(max_examples=150, deadline=None)
@given(
    times=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=4),
    extra=st.integers(0, 9),
    minimum=st.integers(0, 2),
)
def test_linear_is_optimal(times: list[float], extra: int, minimum: int) -> None:
    total = len(times) * minimum + extra
    counts = balance_linear(times, total, minimum)
    assert sum(counts) == total
    assert min(counts) >= minimum
    assert makespan(times, counts) == pytest.approx(_brute_force(times, total, minimum))


@settings(max_examples=60, deadline=None)
@given(
    fixed=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=3),
    slopes=st.lists(st.floats(0.1, 3.0), min_size=3, max_size=3),
    extra=st.integers(0, 8),
)
def test_monotone_is_optimal_for_affine_pipelines(
    fixed: list[float], slopes: list[float], extra: int
) -> None:
    groups = len(fixed)
    total = groups + extra

    def cost(i: int, m: int) -> float:
        return fixed[i] + slopes[i] * m

    counts = balance_monotone(cost, groups, total)
    best = min(
        max(cost(i, m) for i, m in enumerate(c))
        for c in itertools.product(range(1, total + 1), repeat=groups)
        if sum(c) == total
    )
    assert max(cost(i, m) for i, m in enumerate(counts)) == pytest.approx(best)


@settings(max_examples=60, deadline=None)
@given(
    fixed=st.lists(st.floats(0.0, 5.0), min_size=2, max_size=3),
    slopes=st.lists(st.floats(0.1, 3.0), min_size=3, max_size=3),
    drainable=st.lists(st.booleans(), min_size=3, max_size=3),
    extra=st.integers(0, 6),
)
def test_monotone_with_per_group_floors_is_optimal_and_keeps_them(
    fixed: list[float], slopes: list[float], drainable: list[bool], extra: int
) -> None:
    """S2's floors: a drainable group may end with nothing (costing nothing), the others keep one."""
    groups = len(fixed)
    floors = [0 if drainable[i] else 1 for i in range(groups)]
    total = groups + extra

    def cost(i: int, m: int) -> float:
        return 0.0 if m == 0 else fixed[i] + slopes[i] * m

    counts = balance_monotone(cost, groups, total, floors)
    assert sum(counts) == total
    assert all(count >= floor for count, floor in zip(counts, floors, strict=True))
    best = min(
        max(cost(i, m) for i, m in enumerate(c))
        for c in itertools.product(range(total + 1), repeat=groups)
        if sum(c) == total and all(m >= f for m, f in zip(c, floors, strict=True))
    )
    assert max(cost(i, m) for i, m in enumerate(counts)) == pytest.approx(best)


def test_per_group_floors_are_checked() -> None:
    with pytest.raises(PlannerError, match="one floor per group"):
        balance_monotone(lambda i, m: m, 3, 6, [0, 1])
    with pytest.raises(PlannerError, match="the nearest that can is 5"):
        balance_monotone(lambda i, m: m, 2, 4, [2, 3])


def test_too_few_microbatches_proposes_the_nearest() -> None:
    with pytest.raises(PlannerError, match="the nearest that can is 4") as info:
        balance_linear([1.0] * 4, 3)
    assert info.value.field == "microbatches"
    with pytest.raises(PlannerError, match="finite and positive"):
        balance_linear([1.0, 0.0], 4)


def test_large_instance_is_exact_against_greedy() -> None:
    times = [1.0 + (i * 37 % 101) / 50 for i in range(512)]
    counts = balance_linear(times, 4096)
    greedy = balance_monotone(lambda i, m: times[i] * m, 512, 4096)
    assert makespan(times, counts) == pytest.approx(makespan(times, greedy))


@pytest.mark.parametrize(("slow", "fast"), [(1e20, 1.0), (1e308, 1.0), (1.0, 1e-300), (3e-300, 1e-300)])
def test_linear_far_apart_times_split_as_their_ratio_says_and_end(slow: float, fast: float) -> None:
    """Counts were cast from floats past int64 (1e308 against 1: negative micro-batches), or the greedy
    loop ran on a wrapped count and never ended (1e20 against 1, 1e-300 against 1)."""
    counts = balance_linear([slow, fast], 4)
    scaled = [slow / fast, 1.0] if slow / fast < 1e6 else [1e6, 1.0]  # beyond 1e6: as good as infinitely slow
    assert counts == balance_linear(scaled, 4) and sum(counts) == 4
    with pytest.raises(PlannerError, match="too many times the fastest"):
        balance_linear([1e308, 1e-300], 4)
