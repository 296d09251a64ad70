"""Falcon's job-level fail-slow trigger: BOCD + verification on the job's own step time, pure: no I/O.

The per-worker rule (`_straggler`) judges each node's compute against the others', which on a busy host is
noisy: a worker ordered 2x slower measured ~1.3x there while the job's step grew 1.5x, and nothing opened.
Falcon's detector watches the iteration time of the job itself, which is what the user pays for. This one
does the same on the operator's side: every node's `IterationRecord` feeds the step time of the job (the
median of the nodes' walls for a step, fed once the step is complete, i.e. when any node reports a later
one) to a `ChangeDetector`. A verified slowdown of at least the spec's threshold that holds for
`minDurationS` (the median step since the onset, re-checked on every step), and beyond what the job's own
step-to-step noise takes a median of that many steps to (`_beyond_noise`), is a job-level slowdown. The
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from resilientjob.planner.failslow import ChangeDetector, ChangeKind
from resilientjob.protocol.messages import IterationRecord, SlowKind, SlowReport

from ._straggler import MIN_WINDOW, beyond_noise, relative_spread

SUSPICION_FACTOR = 1.1
"""A node's compute rise must exceed the other nodes' median rise by this factor to single it out."""
EXPLAINED = 0.5
"""Share of the job's extra step time a node's extra compute must explain to be named the cause."""
MARGIN = 0.9
"""A slowdown counts when its excess is at least this share of the threshold's (1.45x for 1.5): a job
slowed by exactly the threshold measures just below it half of the time."""
NOISE_STEPS = 64
"""The job's steps before an onset whose spread is its noise (`_beyond_noise`)."""
NOISE_Z = 3.5
"""Standard errors of their median by which the steps after a verification must clear the level before
(`_straggler.beyond_noise`). Above the per-worker rule's 2.5 for margin, as the check runs again on every
step of a pending slowdown and its onset is where the detector saw the steps run high. Measured on 40 jobs
of 300 one-second steps at 17% step noise, threshold 1.2: 6 episodes without the check and with the
detector's own level before, 1 with the level of the 64 steps before alone, 0 with the check at 2.5, 3.0
or 3.5 (`test_one_second_steps_with_seventeen_percent_noise_open_no_episode_at_threshold_1_2`)."""
RISE_NODES = 3
"""Fewest nodes whose compute rise `compute_rise` takes a median of: of two, the median is their mean, and
one slow device would read as a rise of the whole job's work."""
PRIOR_STEPS = 32
"""A node's compute steps before an onset whose median is its level before."""
HISTORY = 256
"""Steps of per-node compute kept for localisation (before and after an onset)."""


def slowdown_bar(threshold: float) -> float:
    """The ratio a slowdown must reach to count for `threshold`: `MARGIN` of its excess over 1."""
    return 1.0 + MARGIN * (threshold - 1.0)


def compute_rise(
    computes: Mapping[int, Sequence[tuple[int, float]]], onset: int, through: int
) -> float | None:
    """How far the nodes' own work rose with a slowdown that began at step `onset`: the median over the
    nodes of each one's compute in steps `onset`..`through` over its median in the `PRIOR_STEPS` steps
    before (`computes`: each node's (step, compute seconds), oldest first). None where fewer than
    `RISE_NODES` nodes have `MIN_WINDOW` steps since and two before. Each node's samples are read from the
    newest back, as far as the window before the onset: a job of thousands of nodes asks it once per step."""
    rises = []
    for samples in computes.values():
        after: list[float] = []
        before: list[float] = []
        for step, seconds in reversed(samples):
            if step >= onset:
                if step <= through:
                    after.append(seconds)
            elif len(before) < PRIOR_STEPS:
                before.append(seconds)
            else:
                break
        if len(before) >= 2 and len(after) >= MIN_WINDOW:
            rises.append(statistics.median(after) / statistics.median(before))
    return statistics.median(rises) if len(rises) >= RISE_NODES else None


@dataclass(slots=True)
class JobVerdict:
    """What the trigger concluded: a report to treat as confirmed, or a dismissal (`report` None)."""

    report: SlowReport | None
    message: str


@dataclass(frozen=True, slots=True)
class _Pending:
    """A slowdown the detector verified, waiting for `minDurationS` and for steps beyond the noise."""

    onset: int
    before: float
    """The job's step time before the onset."""
    since: float
    """Wall time of the verification: `minDurationS` counts from here."""
    verified: int
    """The step that verified it: the confirming steps come after it."""
    noise: float | None
    """The job's step-to-step noise before the onset. This and the nodes' figures below are kept from the
    verification: a long `minDurationS` outlasts the history that held them."""
    prior: dict[int, float]
    """Each node's compute level before the onset."""
    node_noise: float | None
    """The nodes' typical step-to-step compute spread before the onset."""


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
    _pending: _Pending | None = None
    """The slowdown the detector verified, until it is confirmed or passes."""
    _computed: int = 0
    """Compute samples kept so far (what `_rises` is valid for)."""
    _rises: dict[tuple[int, int, int], float | None] = field(default_factory=dict)
    """`compute_rise` by (onset, through, `_computed`)."""

    @property
    def _bar(self) -> float:
        return slowdown_bar(self.threshold)

    def reset(self, generation: int) -> None:
        """A new plan (or the end of an episode): the step time has a new normal, learn it afresh."""
        self.detector = ChangeDetector(self.detector.config)
        self.generation = generation
        self._steps.clear()
        self._fed_step = -1
        self._job.clear()
        self._compute.clear()
        self._rises.clear()
        self._pending = None

    def observe(self, record: IterationRecord, now: float) -> JobVerdict | None:
        if record.generation != self.generation:
            if record.generation < self.generation:
                return None
            self.reset(record.generation)
        if record.compute_s is not None and record.compute_s > 0:
            self._compute.setdefault(record.node, deque(maxlen=HISTORY)).append(
                (record.step, record.compute_s)
            )
            self._computed += 1
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
                prior = [s for st, s in self._job if st < onset][-NOISE_STEPS:]
                noise = relative_spread(prior)
                # The detector's level before is its last run's mean, which may be a short run's: on a
                # noisy job it read 12% under the median of the 64 steps before, and noise looked a rise.
                before = max(event.before_s, statistics.median(prior)) if noise else event.before_s
                levels: dict[int, float] = {}
                spreads = []
                for node, samples in self._compute.items():
                    old = [c for st, c in samples if st < onset][-PRIOR_STEPS:]
                    if len(old) >= 2:
                        levels[node] = statistics.median(old)
                    spread = relative_spread(old)
                    if spread is not None:
                        spreads.append(spread)
                node_noise = statistics.median(spreads) if spreads else None
                self._pending = _Pending(onset, before, now, step, noise, levels, node_noise)
            elif event.kind is ChangeKind.RECOVERY:
                self._pending = None
        pending = self._pending
        if pending is None:
            return None
        onset, before = pending.onset, pending.before
        level = statistics.median(s for st, s in self._job if st >= onset)
        if level < self._bar * before:
            self._pending = None  # the job is back within the threshold: a passing slowdown
            return None
        if now - pending.since < self.min_duration_s or not self._beyond_noise(pending):
            return None
        self._pending = None
        return self._localize(step, pending, level, now)

    def behind(self, step: int) -> bool:
        """Whether most nodes' compute kept here has not reached `step` yet: their records of it are on
        their way (a reporter's own records may come first). False where fewer than `RISE_NODES` nodes
        report compute at all."""
        latest = [samples[-1][0] for samples in self._compute.values() if samples]
        if len(latest) < RISE_NODES:
            return False  # too few nodes with compute for `compute_rise`: nothing to wait for
        return 2 * sum(last >= step for last in latest) <= len(latest)

    def compute_rise(self, onset: int, through: int) -> float | None:
        """`compute_rise` on the nodes' compute kept here (outside an episode, since the generation began),
        remembered until a node's compute comes: every tick asks it for each pending communication report."""
        key = (onset, through, self._computed)
        if key not in self._rises:
            if len(self._rises) >= 64:
                self._rises.clear()
            self._rises[key] = compute_rise(self._compute, onset, through)
        return self._rises[key]

    def _beyond_noise(self, pending: _Pending) -> bool:
        """Whether the steps after the verification are above the bar and further above the level before
        than the job's own step-to-step noise takes their median, `NOISE_Z` standard errors over. Not the
        steps since the onset: the detector chose it where they ran high."""
        after = [s for step, s in self._job if step > pending.verified]
        if pending.noise is None or not after:
            return False
        ratio = statistics.median(after) / pending.before
        return ratio >= self._bar and beyond_noise(ratio, pending.noise, len(after), NOISE_Z)

    def _localize(self, step: int, pending: _Pending, level: float, now: float) -> JobVerdict:
        onset, before = pending.onset, pending.before
        rises: dict[int, tuple[float, float, float]] = {}
        counts: dict[int, int] = {}
        for node, samples in self._compute.items():
            new = [c for s, c in samples if s >= onset]
            prior = pending.prior.get(node)
            if prior is not None and prior > 0 and new:
                after = statistics.median(new)
                rises[node] = (after / prior, prior, after)
                counts[node] = len(new)
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
            # And beyond what its own noise takes a median of its steps since the onset to: on nodes of
            # 45% noise, a rise of every node by 1.4x was blamed on whichever rose most by chance.
            apart = pending.node_noise is None or beyond_noise(
                ratio / max(others, 1e-9), pending.node_noise, counts[worst], NOISE_Z
            )
            if ratio > SUSPICION_FACTOR * others and excess >= EXPLAINED * (level - before) and apart:
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
