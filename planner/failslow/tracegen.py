"""Labelled synthetic iteration-time traces modelled on Falcon section 3, and scoring detectors on them.

What a trace contains (Falcon 3.2-3.4, Table 1, Figs. 2-6):
- a base iteration time of 0.2-4 s with Gaussian jitter of coefficient of variation 0.5-5% (Table 2's
  intra-node CoVs are 1-2%, inter-node RDMA much noisier, smoothed over an iteration);
- one-iteration spikes (x1.3-3, e.g. a garbage collection or a checkpoint write): not fail-slows;
- a slow drift of up to +-3% (thermal and co-location drift): not a fail-slow;
- on slow traces, one to three fail-slows 20-150% slower that last tens to hundreds of iterations, either a
  single step or a ladder of 2-3 rungs (Fig. 5 right, each rung >= 15% above the last), some never recovering
  before the trace ends.

`score` classifies a detector's events on one trace the way Falcon's Tables 4-5 do: a slow trace is right when
every fail-slow onset and every recovery is flagged within `tolerance` iterations and nothing else is flagged;
a clean trace is right when nothing is flagged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from ..errors import PlannerError
from ._acf import CollectiveCall
from ._events import ChangeEvent, ChangeKind

FloatArray = NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Episode:
    """One fail-slow: rungs of (first iteration, slowdown factor), recovering at `end` (None: never)."""

    rungs: tuple[tuple[int, float], ...]
    end: int | None

    def __post_init__(self) -> None:
        if not self.rungs:
            raise PlannerError("rungs", "an episode needs at least one rung")
        starts = [start for start, _ in self.rungs]
        if starts != sorted(set(starts)) or starts[0] < 0:
            raise PlannerError("rungs", f"rung starts must increase from >= 0, got {starts}")
        if any(factor <= 1 for _, factor in self.rungs):
            raise PlannerError("rungs", "every rung must be slower than the base (factor > 1)")
        if self.end is not None and self.end <= starts[-1]:
            raise PlannerError("end", f"recovery at {self.end} precedes the last rung at {starts[-1]}")

    @property
    def onset(self) -> int:
        return self.rungs[0][0]

    @property
    def ladder(self) -> bool:
        return len(self.rungs) > 1


@dataclass(frozen=True, slots=True)
class LabelledTrace:
    """Iteration times and the ground truth behind them."""

    times: FloatArray
    episodes: tuple[Episode, ...]
    base_s: float
    jitter_cv: float
    spikes: tuple[int, ...] = field(default=())

    @property
    def slow(self) -> bool:
        return bool(self.episodes)


def _episodes(rng: np.random.Generator, length: int, count: int) -> list[Episode]:
    episodes: list[Episode] = []
    cursor = int(rng.integers(60, 200))
    for number in range(count):
        if cursor >= length - 40:
            break
        ladder = rng.random() < 0.35
        factor = float(rng.uniform(1.2, 2.5 if not ladder else 1.6))
        rungs = [(cursor, factor)]
        start = cursor
        if ladder:
            for _ in range(int(rng.integers(1, 3))):
                start += int(rng.integers(20, 80))
                factor = min(2.5, factor * float(rng.uniform(1.15, 1.5)))
                if start >= length - 20 or factor <= rungs[-1][1] * 1.14:
                    break
                rungs.append((start, factor))
        last = rungs[-1][0]
        duration = int(rng.integers(30, 400))
        # A quarter of final episodes never recover (Fig. 5 right runs slow to the end).
        never = number == count - 1 and rng.random() < 0.25
        end = None if never or last + duration >= length - 15 else max(last + 20, cursor + duration)
        episodes.append(Episode(rungs=tuple(rungs), end=end))
        if end is None:
            break
        cursor = end + int(rng.integers(60, 250))
    return episodes


def generate_trace(rng: np.random.Generator, length: int = 1000, fail_slows: int = 1) -> LabelledTrace:
    """One labelled trace; `fail_slows=0` gives a clean trace (spikes, jitter and drift only)."""
    if length < 200:
        raise PlannerError("length", f"traces need at least 200 iterations, got {length}")
    base = float(np.exp(rng.uniform(np.log(0.2), np.log(4.0))))
    cv = float(rng.uniform(0.005, 0.05))
    t = np.arange(length, dtype=np.float64)
    drift = 1 + rng.uniform(0, 0.03) * np.sin(2 * np.pi * t / rng.uniform(300, 3000) + rng.uniform(0, 6.3))
    level = np.ones(length)
    episodes = _episodes(rng, length, fail_slows)
    for episode in episodes:
        stop = episode.end if episode.end is not None else length
        bounds = [start for start, _ in episode.rungs[1:]] + [stop]
        for (start, factor), until in zip(episode.rungs, bounds, strict=True):
            level[start:until] = factor
    jitter = np.clip(rng.normal(1.0, cv, length), 1 - 4 * cv, 1 + 4 * cv)
    times = base * drift * level * jitter
    spikes = np.flatnonzero(rng.random(length) < 0.005)
    times[spikes] *= rng.uniform(1.3, 3.0, len(spikes))
    return LabelledTrace(
        times=times,
        episodes=tuple(episodes),
        base_s=base,
        jitter_cv=cv,
        spikes=tuple(int(s) for s in spikes),
    )


def trace_suite(seed: int, clean: int, slow: int, length: int = 1000) -> list[LabelledTrace]:
    """`clean` clean traces then `slow` traces with 1-3 fail-slows each, all from one seed."""
    rng = np.random.default_rng(seed)
    traces = [generate_trace(rng, length, 0) for _ in range(clean)]
    traces += [generate_trace(rng, length, int(rng.integers(1, 4))) for _ in range(slow)]
    return traces


@dataclass(frozen=True, slots=True)
class TraceScore:
    """How a detector did on one trace."""

    correct: bool
    false_alarms: int
    missed_onsets: int
    missed_recoveries: int
    delays: tuple[int, ...]
    """detected_at - onset for each flagged fail-slow onset."""


def score(trace: LabelledTrace, events: Sequence[ChangeEvent], tolerance: int = 10) -> TraceScore:
    """Match events to the ground truth: an event explains a true change when its index is within
    `tolerance` of it and it was raised no later than `tolerance` iterations after the change."""

    def near(event: ChangeEvent, truth: int) -> bool:
        return abs(event.index - truth) <= tolerance and event.detected_at - truth <= tolerance

    slowdowns = [e for e in events if e.kind is ChangeKind.SLOWDOWN]
    recoveries = [e for e in events if e.kind is ChangeKind.RECOVERY]
    rung_starts = [start for episode in trace.episodes for start, _ in episode.rungs]
    ends = [episode.end for episode in trace.episodes if episode.end is not None]
    false_alarms = sum(not any(near(e, s) for s in rung_starts) for e in slowdowns)
    false_alarms += sum(not any(near(e, s) for s in ends) for e in recoveries)
    delays: list[int] = []
    missed_onsets = 0
    for episode in trace.episodes:
        hits = [e.detected_at - episode.onset for e in slowdowns if near(e, episode.onset)]
        if hits:
            delays.append(min(hits))
        else:
            missed_onsets += 1
    missed_recoveries = sum(not any(near(e, end) for e in recoveries) for end in ends)
    correct = false_alarms == 0 and missed_onsets == 0 and missed_recoveries == 0
    return TraceScore(correct, false_alarms, missed_onsets, missed_recoveries, tuple(delays))


@dataclass(frozen=True, slots=True)
class CallStream:
    """Intercepted collective calls with the true duration of each iteration they span."""

    calls: tuple[CollectiveCall, ...]
    period: int
    iteration_s: FloatArray


def call_stream(
    rng: np.random.Generator,
    iterations: int = 200,
    calls_per_iteration: int = 12,
    base_s: float = 1.0,
    jitter_cv: float = 0.02,
    call_jitter: float = 0.002,
    swap_rate: float = 0.01,
) -> CallStream:
    """A hybrid-parallel job's call stream (Falcon Fig. 8): the same (op, group) calls every iteration.

    Calls sit at fixed fractions of each iteration, which lasts base_s x (1 + jitter_cv x N(0, 1)); every
    timestamp gets N(0, call_jitter x base_s) noise (never reordering calls, which one process issues in
    program order), and with probability `swap_rate` two neighbouring calls of different groups are logged in
    the opposite order (racing communicators). The stream starts mid-iteration.
    """
    if calls_per_iteration < 1 or iterations < 3:
        raise PlannerError("iterations", "need >= 3 iterations of >= 1 call")
    ops = ["allreduce", "allgather", "reducescatter", "send", "recv", "broadcast"]
    groups = ["dp", "pp", "tp"]
    # Distinct identities so that no shorter lag repeats the pattern exactly.
    pool = [(op, group) for op in ops for group in groups]
    picks = rng.permutation(len(pool))
    pattern = [pool[int(picks[i % len(pool)])] for i in range(calls_per_iteration)]
    fractions = np.sort(rng.uniform(0, 1, calls_per_iteration))
    durations = base_s * np.clip(1 + jitter_cv * rng.standard_normal(iterations), 0.5, 1.5)
    starts = np.concatenate([[0.0], np.cumsum(durations)[:-1]])
    stamps = (starts[:, None] + fractions[None, :] * durations[:, None]).ravel()
    stamps = stamps + rng.normal(0, call_jitter * base_s, stamps.size)
    keys = pattern * iterations
    for index in range(len(keys) - 1):
        if keys[index][1] != keys[index + 1][1] and rng.random() < swap_rate:
            keys[index], keys[index + 1] = keys[index + 1], keys[index]
    # One process issues its calls in program order, so timestamp noise never reorders them: only the
    # explicit swaps above do.
    stamps = np.sort(stamps)
    skip = int(rng.integers(0, calls_per_iteration))
    calls = tuple(
        CollectiveCall(op=op, group=group, timestamp_s=float(stamp))
        for (op, group), stamp in zip(keys[skip:], stamps[skip:], strict=True)
    )
    return CallStream(calls=calls, period=calls_per_iteration, iteration_s=durations)
