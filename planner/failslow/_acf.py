"""Iteration times without help from the training framework (Falcon 4.2, "Iteration time analysis").

The monitor sees only a stream of collective calls (operation, communication group, timestamp). Training
repeats the same calls every iteration, so the stream of call identities is periodic; the period is the first
lag whose auto-correlation reaches 0.95. The iteration time is then the time between a call and its
occurrence one period earlier.

Call identities are categorical, so the ACF is taken over their one-hot encoding, summed over categories and
normalised per overlapping pair:

    ACF_k = (P[x_t == x_{t+k}] - sum_c mu_c^2) / (1 - sum_c mu_c^2)

where mu_c is the share of calls with identity c. This is Falcon's Cov/Var ratio with the numerator averaged
over the L - k overlapping pairs rather than summed (Falcon's sum shrinks by (L - k) / L, so a perfectly
periodic stream would need L >= 20 k calls to reach 0.95 at all). A perfectly periodic stream scores exactly 1
at its period and multiples; a lag that only matches the common calls scores near or below 0.

Per iteration, the time is the median over the period's call positions of the distance to the same position
one period later: a call that swapped places with its neighbour (two groups racing) moves one position's
distance, not the median.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ..errors import PlannerError

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

PERIOD_THRESHOLD = 0.95  # Falcon's M


@dataclass(frozen=True, slots=True)
class CollectiveCall:
    """One intercepted collective call: e.g. ("allreduce", "dp0", 12.031)."""

    op: str
    group: str
    timestamp_s: float

    def __post_init__(self) -> None:
        if not self.op:
            raise PlannerError("op", "a collective call needs an operation name")
        if not math.isfinite(self.timestamp_s):
            raise PlannerError("timestamp_s", f"must be finite, got {self.timestamp_s}")


@dataclass(frozen=True, slots=True)
class IterationTimes:
    """The recurring period (calls per iteration) and the time of each complete iteration seen."""

    period: int
    times_s: FloatArray

    @property
    def mean_s(self) -> float:
        return float(self.times_s.mean())


def encode(keys: Sequence[Hashable]) -> IntArray:
    """Small integer codes for call identities, in order of first appearance."""
    codes: dict[Hashable, int] = {}
    return np.fromiter((codes.setdefault(key, len(codes)) for key in keys), dtype=np.int64, count=len(keys))


def _mean_square_share(codes: IntArray) -> float:
    shares = np.bincount(codes) / len(codes)
    return float(np.dot(shares, shares))


def acf(codes: IntArray, max_lag: int) -> FloatArray:
    """ACF_k for k = 1 .. max_lag of a categorical sequence (see the module docstring)."""
    length = len(codes)
    if not 1 <= max_lag < length:
        raise PlannerError("max_lag", f"must be in [1, {length - 1}] for {length} calls, got {max_lag}")
    square = _mean_square_share(codes)
    if square >= 1.0:  # a single identity: every lag matches
        return np.ones(max_lag)
    matches = np.array(
        [np.count_nonzero(codes[:-k] == codes[k:]) / (length - k) for k in range(1, max_lag + 1)]
    )
    return (matches - square) / (1 - square)


def recurring_period(codes: IntArray, max_lag: int | None = None, threshold: float = PERIOD_THRESHOLD) -> int:
    """The first lag with ACF >= threshold; lags are tried in order, so the cost is O(calls x period)."""
    length = len(codes)
    if length < 2:
        raise PlannerError("calls", f"need at least 2 calls to find a period, got {length}")
    limit = length // 2 if max_lag is None else max_lag
    if not 1 <= limit < length:
        raise PlannerError("max_lag", f"must be in [1, {length - 1}] for {length} calls, got {limit}")
    square = _mean_square_share(codes)
    if square >= 1.0:
        return 1
    for lag in range(1, limit + 1):
        share = np.count_nonzero(codes[:-lag] == codes[lag:]) / (length - lag)
        if (share - square) / (1 - square) >= threshold:
            return lag
    raise PlannerError(
        "calls",
        f"no recurring period with ACF >= {threshold} up to lag {limit}; record more iterations",
    )


def iteration_times(
    calls: Sequence[CollectiveCall], max_lag: int | None = None, threshold: float = PERIOD_THRESHOLD
) -> IterationTimes:
    """Find the period of a call stream and the duration of each complete iteration in it."""
    stamps = np.array([call.timestamp_s for call in calls], dtype=np.float64)
    if len(stamps) >= 2 and np.any(np.diff(stamps) < 0):
        raise PlannerError("calls", "timestamps must be non-decreasing (sort the records by time)")
    codes = encode([(call.op, call.group) for call in calls])
    period = recurring_period(codes, max_lag, threshold)
    periods = len(stamps) // period
    if periods < 2:
        raise PlannerError("calls", f"need two full periods of {period} calls, got {len(stamps)} calls")
    grid = stamps[: periods * period].reshape(periods, period)
    return IterationTimes(period=period, times_s=np.median(np.diff(grid, axis=0), axis=1))
