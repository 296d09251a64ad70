"""Exact min-max allocation of integer work units (micro-batches) over parallel workers.

Both Oobleck's batch distribution and Falcon's micro-batch redistribution (S2) ask the same question: give
each of P pipelines m_i >= minimum micro-batches, sum m_i = total, so that the slowest pipeline is as fast as
possible. When every pipeline's time is non-decreasing in m_i, handing out units one at a time to the
pipeline that would finish earliest with one more unit is optimal (the exchange argument: any allocation
whose maximum is smaller would need a unit the greedy order ranks later). `balance_linear` jumps straight to
the end of that greedy order by bisection on the makespan, so 512 groups take well under a millisecond where
Falcon's QP solver took 35.9 s; `balance_monotone` runs the greedy order for arbitrary monotone costs (such as
a 1F1B pipeline's step time).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import numpy as np

from .errors import PlannerError


def _check(count: int, total: int, minimum: int) -> None:
    if count < 1:
        raise PlannerError("groups", "need at least one group to distribute micro-batches over")
    if minimum < 0:
        raise PlannerError("minimum", f"must be >= 0, got {minimum}")
    if total < count * minimum:
        raise PlannerError(
            "microbatches",
            f"{total} micro-batches cannot give each of {count} groups at least {minimum}; "
            f"the nearest that can is {count * minimum}",
        )


def balance_linear(unit_times: Sequence[float], total: int, minimum: int = 1) -> list[int]:
    """Minimise max_i unit_times[i] * m_i subject to sum m_i = total and m_i >= minimum (exact)."""
    _check(len(unit_times), total, minimum)
    times = np.asarray(unit_times, dtype=np.float64)
    if not np.all(np.isfinite(times)) or np.any(times <= 0):
        raise PlannerError("times", "per-micro-batch times must be finite and positive")
    # The split does not depend on the unit: in units of the fastest group, no product below overflows (at
    # 1e20 against 1, counts cast from floats past int64 wrapped negative and the greedy loop never ended).
    with np.errstate(over="ignore"):
        times = times / times.min()
    if not np.all(np.isfinite(times)):
        raise PlannerError("times", "the slowest group's time is too many times the fastest's to compare")

    def allocation(makespan: float) -> np.ndarray:
        # Units whose finishing time t_i * k is <= makespan, never below the minimum (nor above the total).
        counts: np.ndarray = np.clip(np.floor(makespan / times + 1e-12), minimum, max(total, minimum))
        return counts.astype(np.int64)

    # Bisection on the makespan for the largest allocation that does not exceed `total`: the fastest group
    # alone doing all of it is an upper bound.
    low, high = 0.0, float(total)
    for _ in range(64):
        middle = (low + high) / 2
        if int(allocation(middle).sum()) <= total:
            low = middle
        else:
            high = middle
    counts = allocation(low)
    remaining = total - int(counts.sum())
    # The last few units follow the greedy order exactly (ties to the lower index).
    # Python floats: a product past the largest float is inf, which still orders (numpy warned).
    heap = [(float(times[i]) * (int(counts[i]) + 1), i) for i in range(len(times))]
    heapq.heapify(heap)
    for _ in range(remaining):
        _, index = heapq.heappop(heap)
        counts[index] += 1
        heapq.heappush(heap, (float(times[index]) * (int(counts[index]) + 1), index))
    return [int(c) for c in counts]


def balance_monotone(
    cost: Callable[[int, int], float], groups: int, total: int, minimum: int | Sequence[int] = 1
) -> list[int]:
    """Minimise max_i cost(i, m_i) subject to sum m_i = total, m_i >= minimum, for costs non-decreasing in m.
    `minimum` is one floor for every group or one per group (fail-slow S2 lets only slow replicas go to 0).

    Greedy in O(total log groups) evaluations of `cost`; callers cache expensive costs.
    """
    floors = [minimum] * groups if isinstance(minimum, int) else [int(m) for m in minimum]
    if len(floors) != groups:
        raise PlannerError("minimum", f"needs one floor per group ({groups}), got {len(floors)}")
    _check(groups, total, 0)
    if any(floor < 0 for floor in floors):
        raise PlannerError("minimum", f"must be >= 0, got {min(floors)}")
    if sum(floors) > total:
        raise PlannerError(
            "microbatches",
            f"{total} micro-batches cannot give the {groups} groups their floors; the nearest that can is "
            f"{sum(floors)}",
        )
    counts = list(floors)
    heap = [(cost(i, counts[i] + 1), i) for i in range(groups)]
    heapq.heapify(heap)
    for _ in range(total - sum(floors)):
        _, index = heapq.heappop(heap)
        counts[index] += 1
        heapq.heappush(heap, (cost(index, counts[index] + 1), index))
    return counts


def makespan(unit_times: Sequence[float], counts: Sequence[int]) -> float:
    """The slowest group's time for an allocation under linear costs."""
    return max(t * m for t, m in zip(unit_times, counts, strict=True))
