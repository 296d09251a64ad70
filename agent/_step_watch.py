"""What an agent watches in its own steps for fail-slow, apart from Redis: two change detectors (the
planner's BOCD + verification), one on the step's compute time and one on its wall time, started over when
the worker's role changes, and the rule that turns their changes into the kind of report the operator gets.

`Telemetry` feeds it every step and sends what it returns; `bench/bench_failslow_replay.py --redetect` feeds
it recorded steps, so an offline replay judges the agents' detection exactly as a live worker runs it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

from resilientjob.planner.failslow import ChangeDetector, ChangeEvent, ChangeKind, DetectorConfig
from resilientjob.protocol.messages import SlowKind, SlowReport

AGENT_DETECTOR = DetectorConfig(min_change=0.25)
"""Detector settings of a live worker. The level check is 25%, not Falcon's 10%: on a loaded 2-core machine
every worker's compute moved 13-34% at once for tens of steps (scheduling delays stretching short sleeps
while other jobs ran), which a 10% check reports as fail-slows; 1.5x slowdowns are still confirmed within
a few steps (docs/benchmarks/failslow-e2e.md)."""

WARMUP_STEPS = 5
"""Steps not fed to the detectors after (re)starting detection: the first steps of a worker or of a new
role carry start-up costs (allocations, first collectives of new groups) that are no fail-slow."""

PARKED_ROLE = "probe"
"""The role of a parked node's probe step (`_parked`): the plan leaves the node out."""
DRAINED_ROLE = "drained"
"""The role of a step on a node whose replica fail-slow S2 drained (`_worker_probe`): the plan runs no
micro-batch there, and the step's compute is a probe product on the node's device."""
PROBE_ROLES = frozenset({PARKED_ROLE, DRAINED_ROLE})
"""Roles whose compute is a probe product on a node out of the step: their recovery is the probe's level
falling under its first level in the role (`StepWatch._probe_recovery`), not a change-point."""
PROBE_WARMUP_STEPS = 1
"""Steps of a probe role not fed to the detectors: the probe is a product timed on its own, with none of a
training step's start-up costs; the first one after a switch may still meet a cold cache."""
PROBE_FIRST = 5
"""Probes whose fastest is a probe role's first level, the node's level when it was taken out of the step.
A change-point needs `DetectorConfig.min_before` samples of the old level: a node that recovered within
that many probes of its drain (13 with the warm-up; the CI run of ec2a640 drained a x4 worker 11 s into its
15 s order) had a first level already recovered, reported nothing, and stayed out of the step for good
(until the operator's recheck of it). The fastest, not the median: a probe's CPU time only grows with what
else runs on its core, and on a loaded 2-core host it read 2x for a second at a time (0.013 -> 0.029 s
under one x4 order); the median of the first 3 taken in such a second made the next 5, no faster a device,
read as its recovery (ea3eabe's CI, the order still holding)."""
WALL_BLIND_ROLES = frozenset({DRAINED_ROLE})
"""Roles whose step wall says nothing of the node: a drained node waits out its peers' step, so only its
compute (the probe) is watched. (A change in the job's step would read as the node's recovery, and the
operator, which has no level of a drained node to weigh it against, would take its word.)"""


@dataclass(frozen=True, slots=True)
class StepChange:
    """A change one of the detectors confirmed, as the operator is told of it."""

    event: ChangeEvent
    kind: SlowKind
    onset_step: int
    """The worker's step at the change's first sample."""
    slowed_s: float = 0.0
    """Seconds the worker's steps took from the onset through the step that revealed the change."""

    def report(self, node: int, generation: int, step: int, detected_at: float) -> SlowReport:
        """The report of this change that `node`'s agent sends at `step` of `generation`."""
        event = self.event
        return SlowReport(
            node=node,
            generation=generation,
            step=step,
            onset_step=self.onset_step,
            slowdown=event.ratio,
            baseline_s=event.before_s,
            level_s=event.after_s,
            kind=self.kind,
            recovered=event.kind is ChangeKind.RECOVERY,
            detected_at=detected_at,
            slowed_s=self.slowed_s,
        )


class StepWatch:
    """One worker's detectors: `feed` each step, get a `StepChange` when one is confirmed."""

    def __init__(self, config: DetectorConfig = AGENT_DETECTOR, warmup: int = WARMUP_STEPS) -> None:
        if warmup < 0:
            raise ValueError(f"warmup: must be >= 0, got {warmup}")
        self.config = config
        self.warmup = warmup
        self.role: Hashable = None
        self._restart(0, None)

    def _restart(self, step: int, role: Hashable) -> None:
        self.wall = ChangeDetector(self.config)
        self.compute = ChangeDetector(self.config)
        self._first_computes: list[float] = []  # the role's first `baseline`: its probe's first level
        # The latest, for `_compute_moved`: bounded, as a job runs for millions of steps.
        self._computes: deque[float] = deque(maxlen=2 * self.config.history)
        self._walls: deque[tuple[int, float]] = deque(maxlen=2 * self.config.history)  # (step, seconds)
        self._fed = 0  # compute samples fed to the current detector
        self._skip = min(self.warmup, PROBE_WARMUP_STEPS) if role in PROBE_ROLES else self.warmup
        self._first_step = step + self._skip  # the step fed first to the current detectors
        self._skipped = 0
        # A probe role's first level (what a recovery is measured by) and the level a (further) recovery
        # must fall under; None until the role's first probes are in.
        self._probe: tuple[float, float] | None = None
        self.role = role

    def feed(
        self, step: int, role: Hashable, seconds: float, compute_s: float | None = None
    ) -> StepChange | None:
        """One step of `role` (what the worker computes: detection starts over when it changes, since the
        normal step time changes with it, and ignores the first `warmup` steps after).

        With `compute_s` (the step's time outside communication) both detectors run: a compute change is
        reported as `compute` (the node itself slowed: a peer waiting for it sees its communication grow,
        not its compute); a wall change as `communication` only when compute did not move at the same
        onset. Without it the wall alone is watched and a change is reported as compute."""
        if role != self.role:
            self._restart(step, role)
        self._walls.append((step, seconds))
        if self._skipped < self._skip:
            self._skipped += 1
            return None
        compute_event = None
        if compute_s is not None:
            if len(self._first_computes) < self.config.baseline:
                self._first_computes.append(compute_s)
            self._computes.append(compute_s)
            self._fed += 1
            compute_event = self.compute.feed(compute_s)
            if role in PROBE_ROLES:
                compute_event = self._probe_recovery(compute_event)
        wall_event = None if role in WALL_BLIND_ROLES else self.wall.feed(seconds)
        if compute_event is not None:
            return self._change(compute_event, SlowKind.COMPUTE)
        if wall_event is None:
            return None
        if compute_s is None:
            return self._change(wall_event, SlowKind.COMPUTE)
        if self._compute_moved(wall_event.index):
            return None  # the compute detector owns this change (reported already, or soon)
        return self._change(wall_event, SlowKind.COMMUNICATION)

    def _change(self, event: ChangeEvent, kind: SlowKind) -> StepChange:
        onset = self._first_step + event.index
        # How long the change has lasted: the operator times `minDurationS` from its onset, not from now.
        lasted = math.fsum(seconds for step, seconds in self._walls if step >= onset)
        return StepChange(event, kind, onset, lasted)

    def _probe_recovery(self, event: ChangeEvent | None) -> ChangeEvent | None:
        """A probe role's change as it counts. A slowdown of a node already out of the step changes
        nothing and goes as it is. A recovery is the probe's level (the median of the latest `min_after`
        probes) falling under its first level in the role (`PROBE_FIRST`) by the detector's margin,
        whenever it falls (the latest probes all after the first level's): a change-point missed the
        recoveries that came before it had `min_before` probes of the old level, and judged against its
        last level, so a passing bump (cache contention from the workers sharing the host's cores) read as
        a recovery when it ended (the demo's drained x4 worker was restored at its slowed level while its
        order held). Reported once per level, always against the first level: a further fall by the margin
        is reported again (the operator wants half the slowdown undone, which a recovery in steps reaches
        only counted from where it began)."""
        if event is not None and event.kind is not ChangeKind.RECOVERY:
            return event
        # The level is judged on probes after the first level's: windows that shared them read a recovery
        # from one low probe among the first three and two after it (a CI run, its order still holding).
        if self._fed < PROBE_FIRST + self.config.min_after:
            return None
        if self._probe is None:
            first = min(self._first_computes[:PROBE_FIRST])
            self._probe = (first, first / (1 + self.config.min_change))
        first, bar = self._probe
        latest = list(self._computes)[-self.config.min_after :]
        level = statistics.median(latest)
        if level > bar:
            return None
        fell = next(offset for offset, probe in enumerate(latest) if probe <= bar)
        self._probe = (first, level / (1 + self.config.min_change))
        return ChangeEvent(
            index=self._fed - len(latest) + fell,
            kind=ChangeKind.RECOVERY,
            before_s=first,
            after_s=level,
            detected_at=self._fed - 1,
        )

    def _compute_moved(self, onset: int) -> bool:
        """Whether compute time shifted at `onset` (an index into the fed samples) as much as a change."""
        kept = self._fed - len(self._computes)  # samples before these were let go
        values = list(self._computes)
        before = values[max(0, onset - self.config.baseline - kept) : max(0, onset - kept)]
        after = values[max(0, onset - kept) :]
        if not before or not after:
            return False
        ratio = statistics.median(after) / statistics.median(before)
        return abs(math.log(ratio)) >= math.log1p(self.config.min_change)
