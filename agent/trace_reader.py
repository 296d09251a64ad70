"""The reader of a worker's trace (Falcon 4.3, "Profiling"): iteration times for the change-point detector,
each reported once (`IterationFeed`, the planner's ACF period over the call stream), the time a caller was
held by communication (`blocked_s`), and per-group communication and compute time (`profile`), combined
over the workers into the planner's `GroupProfile`s (`group_profiles`). The records come from
`tracing.Tracer`'s ring."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from resilientjob.planner.errors import PlannerError
from resilientjob.planner.failslow import (
    CollectiveCall,
    GroupProfile,
    IterationTimes,
    encode,
    iteration_times,
    recurring_period,
)

from .tracing import TraceRecord, TraceRing


def collective_calls(records: Sequence[TraceRecord]) -> list[CollectiveCall]:
    """The planner's view of the trace: (operation, group label, start), ordered by start time."""
    ordered = sorted(records, key=lambda record: (record.start_s, record.seq))
    return [CollectiveCall(op=r.op, group=r.label, timestamp_s=r.start_s) for r in ordered]


def trace_iteration_times(records: Sequence[TraceRecord], max_lag: int | None = None) -> IterationTimes:
    """Iteration times found by the planner's ACF method in the call stream alone."""
    return iteration_times(collective_calls(records), max_lag)


class IterationFeed:
    """Turns the ring into a stream of iteration times, each reported once, for the change-point detector.

    `poll()` reads the records added since the last poll into a sliding window, finds the period by ACF and
    returns the times of the iterations that completed since the last poll. The window is trimmed by whole
    periods, so iteration boundaries stay where they were and no iteration is reported twice."""

    def __init__(self, ring: TraceRing, window: int = 4096, max_lag: int | None = None) -> None:
        if window < 4:
            raise ValueError(f"window: must be >= 4 calls, got {window}")
        self.ring = ring
        self.window = window
        self.max_lag = max_lag
        self._cursor = 0
        self._records: list[TraceRecord] = []
        self._reported_until = -math.inf
        self.period: int | None = None
        """Calls per iteration found at the last successful poll."""

    def poll(self) -> list[float]:
        fresh = self.ring.records(since=self._cursor)
        if fresh:
            self._cursor = fresh[-1].seq + 1
            self._records.extend(fresh)
        if len(self._records) < 4:
            return []
        stamps = np.array([record.start_s for record in self._records])
        codes = encode([(record.op, record.label) for record in self._records])
        try:
            period = recurring_period(codes, self.max_lag)
        except PlannerError:
            return []  # no period yet (too few iterations recorded, or the pattern just changed)
        self.period = period
        rows = len(stamps) // period
        if rows < 2:
            return []
        grid = stamps[: rows * period].reshape(rows, period)
        times = np.median(np.diff(grid, axis=0), axis=1)
        ends = grid[1:, 0]  # iteration i ends where row i + 1 begins
        new = times[ends > self._reported_until]
        self._reported_until = float(ends[-1])
        excess = len(self._records) - self.window
        if excess > 0:
            del self._records[: -(-excess // period) * period]
        return [float(value) for value in new]


@dataclass(frozen=True, slots=True)
class TraceProfile:
    """One worker's time per iteration, split into traced communication and the compute between calls."""

    period: int
    """Calls per iteration (the ACF period)."""
    iterations: int
    iteration_s: float
    """Mean iteration time (over the same windows as the communication time, so the two subtract)."""
    communication_s: float
    """Mean time per iteration inside at least one traced call (overlapping calls count once)."""
    group_s: Mapping[str, float]
    """Mean time per iteration inside each communication group's calls (by `TraceRecord.label`)."""

    @property
    def compute_s(self) -> float:
        return max(0.0, self.iteration_s - self.communication_s)


def blocked_s(records: Sequence[TraceRecord], begin_s: float, end_s: float) -> float:
    """Time within [begin_s, end_s] the caller was held by communication (`TraceRecord.blocked`, overlaps
    counted once): a step's communication time, waiting for slower peers included; the rest is compute."""
    spans = []
    for record in records:
        span = record.blocked
        if span is not None and span[1] > begin_s and span[0] < end_s:
            spans.append((max(span[0], begin_s), min(span[1], end_s)))
    return _covered(spans)


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of intervals."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def profile(records: Sequence[TraceRecord], max_lag: int | None = None) -> TraceProfile:
    """Split each complete iteration of the trace into communication (per group) and compute time.

    Iterations are the ACF periods: window i runs from the start of call i*period to that of call
    (i+1)*period; calls are clipped to their window so that an operation still pending at a boundary is not
    counted twice. Communication time includes waiting for slower peers: `group_profiles` removes it."""
    ordered = sorted(records, key=lambda record: (record.start_s, record.seq))
    times = iteration_times(collective_calls(ordered), max_lag)
    period = times.period
    windows = len(times.times_s)
    communication = np.zeros(windows)
    lengths = np.zeros(windows)
    per_group: dict[str, float] = {}
    for window in range(windows):
        begin = ordered[window * period].start_s
        finish = ordered[(window + 1) * period].start_s
        lengths[window] = finish - begin
        intervals = []
        for record in ordered[window * period : (window + 1) * period]:
            span = record.blocked  # the time the caller was held, not an isend in flight behind compute
            if span is None:
                continue
            start, end = max(span[0], begin), min(span[1], finish)
            intervals.append((start, end))
            per_group[record.label] = per_group.get(record.label, 0.0) + max(0.0, end - start)
        communication[window] = _covered([(s, e) for s, e in intervals if e > s])
    return TraceProfile(
        period=period,
        iterations=windows,
        iteration_s=float(lengths.mean()),
        communication_s=float(communication.mean()),
        group_s={label: total / windows for label, total in sorted(per_group.items())},
    )


def group_profiles(profiles: Sequence[TraceProfile]) -> dict[str, GroupProfile]:
    """Per communication group, the planner's `GroupProfile` from the profiles of all workers.

    A member of a collective that arrives early waits for the others inside the call, so the group's data
    transfer time is the smallest time any member spent in its calls (the last to arrive hardly waits);
    its compute time is the largest compute time among its members (the slowest sets the group's pace).
    Groups are numbered in label order; `GroupProfile.group` indexes the returned mapping's keys."""
    members: dict[str, list[TraceProfile]] = {}
    for worker in profiles:
        for label in worker.group_s:
            members.setdefault(label, []).append(worker)
    result = {}
    for index, label in enumerate(sorted(members)):
        workers = members[label]
        result[label] = GroupProfile(
            group=index,
            compute_s=max(worker.compute_s for worker in workers),
            transfer_s=min(worker.group_s[label] for worker in workers),
        )
    return result
