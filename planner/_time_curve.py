"""A pipeline's 1F1B time as a function of its micro-batch count, in a closed form that does not grow with
the count: exact values up to `EXACT_FACTOR` x stages micro-batches (`OneFOneB.times`), then a line.

Past the warm-up and cool-down every extra micro-batch adds one period of the steady state (a max-plus
system's cycle time), so t(m) = t(K) + (m - K) x slope for m > K, with the slope measured over the last half
of the exact head and never below the bottleneck stage's forward + backward (each micro-batch passes it).
`bench/bench_templates.py --instantiate` measures the line's error against the exact tables (under 1%:
0.7% at worst on its 96-layer GPT cells; a test holds built-in profiles to it). Batch distribution over
curves (`balance_curves`) is then a binary search on the makespan whose cost depends on the pipelines, not
on the number of micro-batches.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import PlannerError
from .estimator import OneFOneB

EXACT_FACTOR = 8  # micro-batches per stage simulated exactly before the line takes over
EXACT_MIN = 16  # ... and at least this many
EXACT_MAX = 256  # ... and at most this many: deep templates reach their steady state within a few stages


@dataclass(frozen=True, slots=True)
class TimeCurve:
    """t(m) for m >= 1: `head[m - 1]` while m <= len(head), else the line through the head's last point."""

    head: np.ndarray  # non-decreasing exact times t(1..K)
    slope: float  # seconds per micro-batch beyond K (0 when the head is the whole table)
    # The head as Python floats: `count` and `at` run thousands of times per ranking, and bisecting a list
    # costs a tenth of a numpy call on one scalar.
    values: list[float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", np.asarray(self.head, dtype=np.float64).tolist())

    @classmethod
    def of_pipeline(
        cls,
        forward: Sequence[float],
        backward: Sequence[float],
        sends: Sequence[float],
        limit: int | None = None,
    ) -> TimeCurve:
        """The curve of a pipeline with these stage times; exact everywhere when `limit` fits in the head."""
        stages = len(forward)
        exact = min(EXACT_MAX, max(EXACT_MIN, EXACT_FACTOR * stages))
        if limit is not None:
            exact = min(exact, max(1, limit))
        head = np.maximum.accumulate(OneFOneB(forward, backward, sends).times(exact))
        bottleneck = max(f + b for f, b in zip(forward, backward, strict=True))
        window = len(head) // 2
        measured = (float(head[-1]) - float(head[-1 - window])) / window if window else bottleneck
        return cls(head=head, slope=max(measured, bottleneck))

    @classmethod
    def exact(cls, table: np.ndarray) -> TimeCurve:
        """A curve that is exactly `table` (non-decreasing) up to its length; flat beyond it."""
        return cls(head=np.asarray(table, dtype=np.float64), slope=0.0)

    def at(self, microbatches: int) -> float:
        values = self.values
        known = len(values)
        if microbatches <= known:
            return values[microbatches - 1]
        return values[-1] + (microbatches - known) * self.slope

    def count(self, makespan: float, limit: int) -> int:
        """How many of m = 1..limit have t(m) <= makespan (a prefix, since t is non-decreasing)."""
        values = self.values
        known = len(values)
        inside = bisect.bisect_right(values, makespan, 0, min(known, limit))
        if inside < known or limit <= known:
            return min(inside, limit)
        if self.slope <= 0:
            return limit
        extra = min(limit - known, max(0, math.floor((makespan - values[-1]) / self.slope)))
        # The division can round either way: settle on the exact boundary of `at`.
        while known + extra < limit and self.at(known + extra + 1) <= makespan:
            extra += 1
        while extra > 0 and self.at(known + extra) > makespan:
            extra -= 1
        return known + extra


def makespan_of(curves: Sequence[TimeCurve], copies: Sequence[int], total: int) -> float:
    """The smallest value T of some curve at which the pipelines absorb `total` micro-batches when each takes
    the most it can finish by T: the exact min-max optimum for non-decreasing times.

    For each curve, the smallest m whose value absorbs the batch; T is the least of those values. The search
    starts where the curves' lines meet the batch (`_estimate`) and gallops out from there, so with long
    batches it costs a handful of `enough` tests instead of log2(total); a curve after the first is searched
    only among its values below the best so far, which one test usually rules out. Same value as the plain
    binary search per curve over [1, total] it replaced (`tests/planner/_templates_reference.py`, a
    property test compares them)."""
    floor = max(curve.at(1) for curve in curves)  # every pipeline runs at least one micro-batch
    limit = total - sum(copies) + 1

    def enough(makespan: float) -> bool:
        if makespan < floor:
            return False
        return (
            sum(many * curve.count(makespan, limit) for curve, many in zip(curves, copies, strict=True))
            >= total
        )

    estimate = _estimate(curves, copies, total)
    best = math.inf
    for curve in curves:
        # Only this curve's values below the best so far can lower it: m in [1, high].
        high = limit if math.isinf(best) else curve.count(math.nextafter(best, -math.inf), limit)
        if high < 1 or not enough(curve.at(high)):
            continue
        guess = high if estimate is None else min(high, max(1, curve.count(estimate, high)))
        low, high = _bracket(curve, enough, guess, high)
        while low < high:
            middle = (low + high) // 2
            if enough(curve.at(middle)):
                high = middle
            else:
                low = middle + 1
        best = min(best, curve.at(low))
    if math.isinf(best):
        raise PlannerError("microbatches", f"the time curves cannot absorb {total} micro-batches")
    return best


def _estimate(curves: Sequence[TimeCurve], copies: Sequence[int], total: int) -> float | None:
    """Where the curves' lines (t = last + (m - K) x slope) absorb `total` together: a starting point only."""
    rate = offset = 0.0
    for curve, many in zip(curves, copies, strict=True):
        if curve.slope <= 0:
            return None
        rate += many / curve.slope
        offset += many * (curve.values[-1] / curve.slope - len(curve.values))
    estimate = (total + offset) / rate
    return estimate if math.isfinite(estimate) else None


def _bracket(curve: TimeCurve, enough: Callable[[float], bool], guess: int, high: int) -> tuple[int, int]:
    """[low, high] holding the smallest m <= high with enough(t(m)) (enough(t(high)) holds), galloping out
    from `guess`."""
    if enough(curve.at(guess)):
        step, top = 1, guess
        while True:
            below = top - step
            if below < 1:
                return 1, top
            if not enough(curve.at(below)):
                return below + 1, top
            top, step = below, 2 * step
    step, bottom = 1, guess  # enough fails at bottom
    while True:
        above = bottom + step
        if above >= high:
            return bottom + 1, high
        if enough(curve.at(above)):
            return bottom + 1, above
        bottom, step = above, 2 * step


def balance_curves(curves: Sequence[TimeCurve], copies: Sequence[int], total: int) -> tuple[float, list[int]]:
    """Min-max split of `total` micro-batches over groups of identical pipelines (`copies[g]` pipelines of
    curve g). Returns the makespan and each pipeline's count, flattened in group order. O(groups^2 x log^2
    total) curve evaluations plus a hand-back of at most one unit per pipeline and tie."""
    pipelines = sum(copies)
    if total < pipelines:
        raise PlannerError("microbatches", f"{total} micro-batches cannot feed {pipelines} pipelines")
    limit = total - pipelines + 1
    makespan = makespan_of(curves, copies, total)
    counts = [[curve.count(makespan, limit)] * many for curve, many in zip(curves, copies, strict=True)]
    # Every pipeline finishes by the makespan with these counts; hand back the surplus from the pipelines
    # whose last unit is slowest, never below one micro-batch, which keeps the maximum at the makespan.
    surplus = sum(sum(row) for row in counts) - total
    heap = [(-curves[g].at(counts[g][i]), g, i) for g in range(len(curves)) for i in range(copies[g])]
    heapq.heapify(heap)
    while surplus > 0:
        _, g, i = heapq.heappop(heap)
        if counts[g][i] <= 1:
            continue
        counts[g][i] -= 1
        surplus -= 1
        heapq.heappush(heap, (-curves[g].at(counts[g][i]), g, i))
    return makespan, [count for row in counts for count in row]
