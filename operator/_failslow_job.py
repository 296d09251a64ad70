"""Falcon's job-level fail-slow trigger: BOCD + verification on the job's own step time, pure: no I/O.

The per-worker rule (`_straggler`) judges each node's compute against the others', which on a busy host is
noisy: a worker ordered 2x slower measured ~1.3x there while the job's step grew 1.5x, and nothing opened.
Falcon's detector watches the iteration time of the job itself, which is what the user pays for. This one
does the same on the operator's side: every node's `IterationRecord` feeds the step time of the job (the
median of the nodes' walls for a step, fed once the step is complete, i.e. when any node reports a later
one) to a `ChangeDetector`. A verified slowdown of at least the spec's threshold that holds for
`minDurationS` (the median step since the onset, re-checked on every step) is a job-level slowdown. The
duration counts from the detector's verification, on the operator's clock, so the `min_after` slowed steps
the verification needs come on top. Counting it from the onset instead (the job's time since) opened an
episode on a one-second stall of one node in a 30-minute healthy run of the demo job on two cores.

Localisation then says whose it is, from the same records, before and after the onset:
- a node whose own compute rose by more than `SUSPICION_FACTOR` x the other nodes' median rise, and whose
  extra compute beyond that rise explains at least `EXPLAINED` of the job's extra step time, is a compute
  straggler (the report names it, with its own compute levels as baseline and level, so S2 balances by its
  real factor);
- when every node's compute rose alike the slowdown is machine-wide (no node to mitigate): dismissed;
- otherwise the job waits in communication: a communication report, which asks for a validation pass to
  name the slow link(s) or device(s).
The tracker treats the report as a confirmed candidate. The per-worker rule can still open an episode
earlier; this trigger only fires while no episode is active.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from resilientjob.planner.failslow import ChangeDetector, ChangeKind
from resilientjob.protocol.messages import IterationRecord, SlowKind, SlowReport

SUSPICION_FACTOR = 1.1
"""A node's compute rise must exceed the other nodes' median rise by this factor to single it out."""
EXPLAINED = 0.5
"""Share of the job's extra step time a node's extra compute must explain to be named the cause."""
MARGIN = 0.9
"""A slowdown counts when its excess is at least this share of the threshold's (1.45x for 1.5): a job
slowed by exactly the threshold measures just below it half of the time."""
HISTORY = 256
"""Steps of per-node compute kept for localisation (before and after an onset)."""


@dataclass(slots=True)
class JobVerdict:
    """What the trigger concluded: a report to treat as confirmed, or a dismissal (`report` None)."""

    report: SlowReport | None
    message: str


@dataclass(slots=True)
class JobStepTrigger:
    """Feeds the job's step time to BOCD; `observe` returns a verdict once a slowdown is confirmed."""

    threshold: float
    min_duration_s: float
    detector: ChangeDetector = field(default_factory=ChangeDetector)
    generation: int = -1
    _steps: dict[int, list[float]] = field(default_factory=dict)
    _fed_step: int = -1
    _first_step: int = 0
    """Step number of the detector's sample 0 (its events' indices count from there)."""
    _job: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=HISTORY))
    _compute: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)
    _onset: tuple[int, float, float] | None = None
    """The pending slowdown: (onset step, job step time before, wall time it was first confirmed)."""
    _prior: dict[int, float] = field(default_factory=dict)
    """Each node's compute level before the pending onset, kept from when it was confirmed (a long
    minDurationS outlasts the history that held it)."""

    @property
    def _bar(self) -> float:
        return 1.0 + MARGIN * (self.threshold - 1.0)

    def reset(self, generation: int) -> None:
        """A new plan (or the end of an episode): the step time has a new normal, learn it afresh."""
        self.detector = ChangeDetector(self.detector.config)
        self.generation = generation
        self._steps.clear()
        self._fed_step = -1
        self._job.clear()
        self._compute.clear()
        self._onset = None
        self._prior = {}

    def observe(self, record: IterationRecord, now: float) -> JobVerdict | None:
        if record.generation != self.generation:
            if record.generation < self.generation:
                return None
            self.reset(record.generation)
        if record.compute_s is not None and record.compute_s > 0:
            self._compute.setdefault(record.node, deque(maxlen=HISTORY)).append(
                (record.step, record.compute_s)
            )
        if record.step <= self._fed_step:
            return None
        self._steps.setdefault(record.step, []).append(record.seconds)
        verdict = None
        for step in sorted(s for s in self._steps if s < record.step):
            walls = self._steps.pop(step)
            verdict = self._feed(step, statistics.median(walls), now) or verdict
        return verdict

    def _feed(self, step: int, seconds: float, now: float) -> JobVerdict | None:
        if self._fed_step < 0:
            self._first_step = step
        self._fed_step = step
        self._job.append((step, seconds))
        event = self.detector.feed(seconds)
        if event is not None:
            if event.kind is ChangeKind.SLOWDOWN and event.ratio >= self._bar:
                onset = self._first_step + event.index
                self._onset = (onset, event.before_s, now)
                # The levels before the onset are in the kept history now; a long minDurationS would
                # outlast it.
                self._prior = {}
                for node, samples in self._compute.items():
                    old = [c for st, c in samples if st < onset]
                    if len(old) >= 2:
                        self._prior[node] = statistics.median(old[-32:])
            elif event.kind is ChangeKind.RECOVERY:
                self._onset = None
        if self._onset is None:
            return None
        onset, before, since = self._onset
        level = statistics.median(s for st, s in self._job if st >= onset)
        if level < self._bar * before:
            self._onset = None  # the job is back within the threshold: a passing slowdown
            return None
        if now - since < self.min_duration_s:
            return None
        self._onset = None
        return self._localize(step, onset, before, level, now)

    def _localize(self, step: int, onset: int, before: float, level: float, now: float) -> JobVerdict:
        rises: dict[int, tuple[float, float, float]] = {}
        for node, samples in self._compute.items():
            new = [c for s, c in samples if s >= onset]
            prior = self._prior.get(node)
            if prior is not None and prior > 0 and new:
                after = statistics.median(new)
                rises[node] = (after / prior, prior, after)
        slowdown = level / before
        where = f"the job's step time rose {slowdown:.2f}x ({before:.3g}s -> {level:.3g}s) since step {onset}"
        if rises:
            worst = max(rises, key=lambda node: (rises[node][0], -node))
            ratio, prior, after = rises[worst]
            others = statistics.median([rises[node][0] for node in rises if node != worst] or [1.0])
            # Only its compute beyond the others' rise is its own: on a host that slows every node (the
            # 2-core host's step drifted 1.6x in 30 healthy minutes) every node's extra compute "explains"
            # the job's extra step, and the noisiest node would be named.
            excess = after - prior * max(others, 1.0)
            if ratio > SUSPICION_FACTOR * others and excess >= EXPLAINED * (level - before):
                report = SlowReport(
                    node=worst,
                    generation=self.generation,
                    step=step,
                    onset_step=onset,
                    slowdown=ratio,
                    baseline_s=prior,
                    level_s=after,
                    kind=SlowKind.COMPUTE,
                    detected_at=now,
                )
                return JobVerdict(report, f"{where}; node {worst}'s compute rose {ratio:.2f}x")
            if min(r for r, _, _ in rises.values()) >= 1 + EXPLAINED * (slowdown - 1):
                return JobVerdict(
                    None, f"{where}, on every node alike (machine-wide, no node to move work off)"
                )
            reporter = worst
        else:
            reporter = min(self._compute, default=0)
        report = SlowReport(
            node=reporter,
            generation=self.generation,
            step=step,
            onset_step=onset,
            slowdown=slowdown,
            baseline_s=before,
            level_s=level,
            kind=SlowKind.COMMUNICATION,
            detected_at=now,
        )
        return JobVerdict(report, f"{where}; no node's compute explains it: communication, validating")
