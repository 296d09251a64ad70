"""Fail-slow localisation and mitigation for one job (Falcon sections 4.3 and 5), pure: no I/O.

Agents run the planner's BOCD + verification on their own iteration times and send change-point reports.
`FailSlowTracker` turns them into the events of Falcon's ski-rental controller
(`planner.failslow.MitigationController`) and feeds it the slow nodes' iteration times:

1. A report is a *candidate*, not yet an episode. A compute report must be confirmed by the job-wide rule
   of `_straggler` (the node's level against the other nodes', so noise on every node is no straggler)
   continuously for `min_duration_s` since the change's onset (`_failslow_clock`) and over two disjoint
   level windows of steps, or two shorter ones that each decide it alone (`_failslow_persist`) (with
   `min_duration_s` 0, at once). One check that finds it within the threshold
   dismisses it (its level counts only steps from its onset, so this is the evidence of the change
   itself), as does `CANDIDATE_TTL_S` without enough steps to judge; a node slower than the others by
   the threshold beyond the job's noise whose cost to the job is still short waits instead (`_rising`).
   A communication report asks for a validation pass (`validation_wanted`; `_failslow_validation`): suspects
   are the reporter and the nodes of the groups its profiles flag. The result names slow links (S3 a moves
   them off the data-parallel path) and slow devices (compute stragglers); a result that finds nothing
   dismisses the report; a result that never comes (`validation_timeout_s`) lets the episode go on with the
   reporter.
2. When the time lost pays for the next strategy, the tracker answers with a `Mitigation`, which the
   reconciler turns into a plan (`_failslow_plans`) and publishes through the same generation path as a
   fail-stop: S2 `microbatch`, S3 `topology` (links first, then stragglers), S4 `replace` (slow nodes out,
   their pods parked), and `restore` when the last slow node's recovery report ends the episode (or, for a
   drained node whose report does not come, a validation pass that times it healthy: `_failslow_revalidate`;
   for a parked one, its probe read against the training nodes' own timings of it: `_failslow_parked`);
   `revert` when the episode's first rung measurably made the job slower (`_failslow_rungs`).

Restart safety: `state()` is everything the episode needs (the controller's level, accumulated loss, causes
and slow nodes; the tracker's slow nodes, links, candidates and the outstanding validation); the reconciler
stores it in Redis whenever it changes and `restore()`s it in a restarted operator, so an episode goes on
at the level it reached and no decision is repeated. The healthy plan to restore travels in the committed
plan announcement.

Why this module is past 600 lines: it is one state machine, whose inputs, candidates, episode and stored
state share the same fields; what can be judged apart from them is apart already (`_straggler`,
`_failslow_job`, `_failslow_persist`, `_failslow_validation`, `_failslow_rungs`, `_failslow_plans`,
`_failslow_types`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from resilientjob.planner.failslow import (
    ChangeEvent,
    ChangeKind,
    MitigationController,
    MitigationCosts,
    RootCause,
    Strategy,
)
from resilientjob.protocol.messages import (
    IterationRecord,
    ProfileRecord,
    SlowKind,
    SlowReport,
    ValidationResult,
)

from . import _failslow_validation as _validation
from ._failslow_clock import NodeClocks
from ._failslow_job import JobStepTrigger, slowdown_bar
from ._failslow_parked import AGREE, ParkedRecheck
from ._failslow_persist import first_window_end, persisted
from ._failslow_plans import (
    link_plan,
    microbatch_plan,
    restored_plan,
    slowed_step_time,
    sync_time,
    topology_plan,
)
from ._failslow_revalidate import DrainedRevalidation
from ._failslow_rungs import FirstRungCheck
from ._failslow_types import Action, Candidate, Finding, FindingKind, Link, Mitigation
from ._straggler import StragglerGate, beyond_noise
from .api import FailSlowSpec

__all__ = [
    "CANDIDATE_TTL_S",
    "Action",
    "FailSlowTracker",
    "Finding",
    "FindingKind",
    "Mitigation",
    "link_plan",
    "microbatch_plan",
    "restored_plan",
    "slowed_step_time",
    "sync_time",
    "topology_plan",
]

RECENT = 8
"""Iterations whose median is the episode's current level (what a rung measured before and after)."""

CANDIDATE_TTL_S = 60.0
"""A report the job-wide rule has not confirmed this long after it came (or twice a level window of the job's
steps, if longer) is dismissed as noise."""

RECOVERED_WITHIN = 0.5
"""A compute straggler of the episode is back once its level per planned share is within this share of the
threshold's excess over the other nodes' (1.25x for a threshold of 1.5). Its speed is judged, not what it
costs the job: the mitigation that took work off it lowered that (the demo's x3 worker under S2 no longer cost
the job the threshold, so its own shorter steps counted as a recovery, and the healthy plan brought the
slowdown straight back). The margin keeps a node hovering at the threshold from flapping between plans."""

SWEPT = " (no agent reported it: the operator's sweep of the job-wide rule found it)"

_ACTIONS = {
    Strategy.MICROBATCH: Action.MICROBATCH,
    Strategy.TOPOLOGY: Action.TOPOLOGY,
    Strategy.REPLACE: Action.REPLACE,
}


@dataclass(slots=True)
class FailSlowTracker:
    """One job's fail-slow episode: reports, iteration times, profiles and validations in; mitigations out.
    Times (`now`) are wall-clock seconds, so that a restored state keeps its meaning in another process."""

    spec: FailSlowSpec
    gate: StragglerGate = field(init=False)
    job: JobStepTrigger = field(init=False)
    """Falcon's trigger on the job's own step time (`_failslow_job`), beside the per-worker rule."""
    clocks: NodeClocks = field(default_factory=NodeClocks)
    """Each node's recent step records, to date a report's onset on this clock (`_failslow_clock`)."""
    rung_check: FirstRungCheck = field(init=False)
    """Whether the episode's first rung made the job slower (`_failslow_rungs`)."""
    slow: dict[int, float] = field(default_factory=dict)
    """Nodes of the current episode, with their slowdown (new level / healthy level)."""
    links: set[Link] = field(default_factory=set)
    """Slow links (sender, receiver) that validation named in this episode."""
    devices: set[int] = field(default_factory=set)
    """Slow nodes of the episode whose own device is slow (a compute report's, or a device that validation
    timed slow): S2 balances these, also where one is the end of a slow link as well."""
    controller: MitigationController = field(init=False)
    candidates: dict[int, Candidate] = field(default_factory=dict)
    awaiting: tuple[int, float] | None = None
    """The outstanding validation request: (id, when it was sent)."""
    revalidation: DrainedRevalidation = field(init=False)
    """When drained slow nodes that sent no recovery are timed again (`_failslow_revalidate`)."""
    parked: ParkedRecheck = field(init=False)
    """Parked slow nodes' probes against the training nodes' (`_failslow_parked`)."""
    profiles: dict[int, ProfileRecord] = field(default_factory=dict)
    gone: set[int] = field(default_factory=set)
    """Nodes that failed (`forget`): never suspects again (node ids are not reused); others' profiles of an
    earlier generation still name them in their groups."""
    findings: list[Finding] = field(default_factory=list)
    changed: bool = False
    """Set by every change of `state()`; the reconciler clears it once stored."""
    _sources: dict[int, tuple[int, ...]] = field(default_factory=dict)
    _detect_s: float = 0.0
    _steps: tuple[int, int] | None = None
    """The episode's onset step and the step it was opened at (`Mitigation.steps`)."""
    _fed: dict[int, int] = field(default_factory=dict)
    _compute_episode: bool = True
    """Whether the episode was opened by a compute report (its loss is then counted in compute time)."""
    _recent: list[float] = field(default_factory=list)
    """The last `RECENT` iteration times charged to the episode (its current level)."""
    _rungs: list[tuple[str, float]] = field(default_factory=list)
    """Each rung published in this episode, with the level measured when it was decided."""
    _swept: dict[int, int] = field(default_factory=dict)
    """Each node's latest step when the sweep last made it a candidate (once per level window)."""
    idle: frozenset[int] = frozenset()
    """Nodes of the current plan that compute nothing (S2 drained their replica; set per generation)."""
    _parked_said: set[int] = field(default_factory=set)
    """Parked nodes whose probe was judged still slow in this park (said once, as an Event)."""
    _recovering: dict[int, Candidate] = field(default_factory=dict)
    """Recovery reports of the episode's sources that the job-wide rule could not judge yet (too few of the
    node's steps since the report's onset had come): judged again by `recheck`."""

    def __post_init__(self) -> None:
        self.gate = StragglerGate(self.spec.slowdown_threshold)
        self.job = JobStepTrigger(self.spec.slowdown_threshold, self.spec.min_duration_s)
        self.rung_check = FirstRungCheck(self.spec.slowdown_threshold)
        self.controller = self._fresh_controller()
        self.revalidation = DrainedRevalidation(self.spec.drained_recheck_s)
        self.parked = ParkedRecheck(self.spec.parked_recheck_s)

    def _fresh_controller(self) -> MitigationController:
        overheads = self.spec.overheads
        return MitigationController(
            MitigationCosts(
                microbatch_s=overheads.microbatch_s,
                topology_s=overheads.topology_s,
                replace_s=overheads.restart_s,
            )
        )

    @property
    def active(self) -> bool:
        return self.controller.active

    # ---- inputs ------------------------------------------------------------------------------------------
    def report(self, report: SlowReport, now: float | None = None) -> Mitigation | None:
        """A worker's change point. A slowdown becomes a candidate; the recovery of the last node of the
        episode closes it and asks for the healthy layout back."""
        if not self.spec.enabled:
            return None
        clock = time.time() if now is None else now
        if report.recovered:
            return self._recovered(report, clock, clock)
        if report.slowdown < self.spec.slowdown_threshold or report.node in self._sources:
            return None
        pending = self.candidates.get(report.node)
        if pending is not None and not pending.swept:
            return None  # a repeated report neither restarts nor extends the pending confirmation
        self.candidates[report.node] = Candidate(report, clock)
        self.changed = True
        return None

    def observe(self, record: IterationRecord, now: float | None = None) -> None:
        """Every node's steps feed the job-wide levels and, outside an episode, the job-level trigger: a
        slowdown of the job's step time by the threshold for `min_duration_s` opens an episode for the
        compute straggler it localises, or asks validation to name the slow link (a communication
        candidate), whatever the per-worker rule made of the reports."""
        clock = time.time() if now is None else now
        self.gate.observe(record)
        self.clocks.observe(record, clock)
        if not self.spec.enabled or self.controller.active:
            return
        verdict = self.job.observe(record, clock)
        if verdict is None:
            return
        report = verdict.report
        if report is None:
            self.findings.append(
                Finding(FindingKind.DISMISSED, (), f"job-level slowdown ignored: {verdict.message}")
            )
            return
        if report.node in self._sources or report.node in self.candidates:
            return  # the per-worker path has it already
        candidate = Candidate(report, report.detected_at, job_level=True)
        self.candidates[report.node] = candidate
        self.changed = True
        if report.kind is SlowKind.COMPUTE:
            self._open(report.node, candidate, why=f" (job-level trigger: {verdict.message})")

    def profile(self, record: ProfileRecord) -> None:
        self.profiles[record.node] = record

    def iteration(self, record: IterationRecord) -> Mitigation | None:
        """One step of a worker. Only the slowest node's steps count, once per step: in synchronous
        training every node waits for it, so its excess over the healthy step is the time the job loses."""
        if not self.controller.active or not self.slow:
            return None
        # A drained slow node holds nobody up: its steps are probe products, and its step's wall is the
        # job's. The slowest node that still computes is charged; with none, the job has lost only the
        # drained replicas' share of the work, which S3 and S4 could not win back: nothing is charged,
        # and only the first-rung check reads the (job's) step times.
        computing = [node for node in self.slow if node not in self.idle]
        slowest = max(computing or self.slow, key=lambda node: (self.slow[node], -node))
        if record.node != slowest or record.step <= self._fed.get(record.node, -1):
            return None
        self._fed[record.node] = record.step
        # The same quantity as the opening report's baseline: a compute detector's report compares compute
        # times (a compute straggler's excess is what every peer waits), a step detector's step times.
        compute = self._compute_episode and record.compute_s is not None and record.compute_s > 0
        seconds = record.compute_s if compute and record.compute_s is not None else record.seconds
        self.changed = True
        # Judged before the controller sees the step: a revert and a next rung decided on the same step
        # would leave the controller counting a rung that was never published.
        worse = self.rung_check.observe(record.generation, record.seconds)
        if worse is not None:
            self._recent = [*self._recent[-(RECENT - 1) :], seconds]
            return Mitigation(
                Action.REVERT,
                dict(self.slow),
                worse,
                self.controller.loss_s,
                self._detect_s,
                tuple(sorted(self.links)),
                self._measured(),
                self._steps,
                tuple(sorted(self.devices)),
            )
        if not computing:
            return None
        decision = self.controller.on_iteration(seconds)
        self._recent = [*self._recent[-(RECENT - 1) :], seconds]
        if decision is None or decision.strategy not in _ACTIONS:
            return None
        action = _ACTIONS[decision.strategy]
        measured = self._measured()
        self.rung_check.arm(str(action), record.generation)
        self._rungs.append((str(action), median(self._recent)))
        self._recent = []  # the next rung's "before" is measured on the layout this one publishes
        return Mitigation(
            action,
            self._factors(action),
            decision.reason,
            decision.loss_s,
            self._detect_s,
            tuple(sorted(self.links)),
            measured,
            self._steps,
            tuple(sorted(self.devices)),
        )

    def published(self, mitigation: Mitigation, generation: int) -> None:
        """The reconciler is committing `mitigation` as `generation` (before the commit, so that the stored
        episode has it): the first-rung check judges that generation's steps."""
        if mitigation.action in (Action.MICROBATCH, Action.TOPOLOGY, Action.REPLACE):
            self.rung_check.published(generation)
            self.changed = True

    def same_layout(self, old: int, new: int) -> None:
        """Generation `new` is generation `old`'s layout again (`FirstRungCheck.same_layout`)."""
        if self.rung_check.same_layout(old, new):
            self.changed = True

    def not_published(self, mitigation: Mitigation) -> None:
        """The decided rung was not published: the first-rung check waits for one that is."""
        if mitigation.action in (Action.MICROBATCH, Action.TOPOLOGY, Action.REPLACE):
            self.rung_check.declined()
            self.changed = True

    def _factors(self, action: Action) -> dict[int, float]:
        """The slow nodes a rung acts on, each as slow as the larger of two measures: its compute level per
        planned share now against the other nodes' since the episode's onset (where the levels have it:
        not a drained or parked node's), and the slowdown that opened the episode (its own compute against
        its own baseline). A report's slowdown is its detector's first reading, and a slowdown can grow:
        the demo's x4 worker was reported 1.9x, measured 4.2x when S2 came, and S2 left it a micro-batch
        that set the job's pace. The comparison with the others rests on the planned shares, which can
        misstate what a node computes beside its peers (CPU workers on shared cores: the demo's
        whole-model replicas compute 0.9x their planned share against the half-model stages'); a 2x order
        there read 1.0x against the others while its compute had risen 1.49x, and S2 found "the current
        split already the best" for an episode it had opened. S2 fixes compute only (Falcon Table 3): the
        ends of slow links are left out of its balance (their compute is healthy), unless the episode has
        no other slow node."""
        compute = self._compute_slow()
        since = self._steps[0] if self._steps is not None else 0
        now = self.gate.ratios(dict.fromkeys(compute, since)) if compute else {}
        factors = {node: max(1.0, now.get(node) or 0.0, factor) for node, factor in self.slow.items()}
        if action is not Action.MICROBATCH or not self.links:
            return factors
        return {node: factor for node, factor in factors.items() if node in compute} or factors

    def _compute_slow(self) -> set[int]:
        """The episode's slow nodes whose own compute is slow: its slow devices, and every slow node that
        is not a slow link's end."""
        ends = {node for link in self.links for node in link}
        return {node for node in self.slow if node not in ends or node in self.devices}

    def _measured(self) -> str:
        """The step time the episode runs at now against the healthy one, and each earlier rung's effect."""
        if not self._recent:
            return ""
        now = median(self._recent)
        healthy = self.controller.healthy_s
        what = "compute" if self._compute_episode else "step time"
        parts = [f"measured {now:.3g}s of {what} per step"]
        if healthy:
            parts[0] += f" (healthy {healthy:.3g}s)"
        parts += [f"after {action}: {before:.3g}s -> {now:.3g}s" for action, before in self._rungs]
        return ", ".join(parts)

    def tick(self, now: float | None = None) -> None:
        """Judge the candidates: open the episode for those confirmed long enough, dismiss stale ones."""
        clock = time.time() if now is None else now
        if self.spec.enabled and not self.controller.active:
            self._sweep(clock)
        compute = {
            node: candidate.report.onset_step
            for node, candidate in self.candidates.items()
            if candidate.report.kind is SlowKind.COMPUTE
        }
        verdicts = self.gate.judge(compute) if compute else {}
        ttl = self._ttl()
        for node, candidate in list(self.candidates.items()):
            report = candidate.report
            if report.kind is SlowKind.COMMUNICATION:
                if candidate.validated is None:
                    holds = self._holds(report)
                    if holds is True:
                        host = self._host_slowed(candidate)
                        if host is not None:
                            # A slow link that came with such a blip, and lasts, is the job-level trigger's:
                            # the job's step stays slower once the work is back at its level.
                            del self.candidates[node]
                            self.changed = True
                            self._dismiss(node, f"{host}: the host's load, no link (machine-wide)")
                            continue
                        if self._waits_for_records(candidate, clock):
                            continue  # for the other nodes' records of its steps (`_asked` waits too)
                    if holds is None and clock - candidate.came_at <= ttl:
                        continue  # waiting for its steps to clear their noise, then validation
                    if holds is not True:
                        del self.candidates[node]
                        self.changed = True
                        bar = slowdown_bar(self.spec.slowdown_threshold)
                        self._dismiss(
                            node,
                            f"its step time since step {report.onset_step} "
                            + (
                                f"is back under {bar:.3g}x its level before"
                                if holds is False
                                else f"did not clear its own noise within {ttl:.0f}s"
                            ),
                        )
                    continue  # waiting for validation (or its timeout)
                young = clock - candidate.came_at <= ttl
                if young and _validation.unjudged(candidate, self.links, self.gate):
                    continue  # the job-wide rule has too few steps to check validation's devices yet
                verdict: bool | None = True
            else:
                verdict = verdicts[node]
            if verdict:
                latest = self.gate.steps.get(node, report.step)
                if candidate.confirmed_since is None:
                    # The agent's detector verified the slowdown (and for a communication report
                    # validation, later, measured the named link or device slow): it has lasted since its
                    # onset, where its duration counts from, not from the detection: the detector's
                    # verifying steps are the slowdown's too (the demo's x4 episodes waited a second past
                    # the detection, five more slowed steps). On the operator's clock, as far as the
                    # node's own steps bear it out (`_failslow_clock`); never later than now.
                    # The operator's sweep, which found no onset, dates its candidates now.
                    unproven = report.kind is SlowKind.COMMUNICATION and not candidate.validated
                    since = clock if unproven or candidate.swept else self.clocks.onset(report)
                    candidate.confirmed_since = min(clock, since)
                    candidate.confirmed_step = first_window_end(self.gate, node, report.onset_step, latest)
                    self.changed = True
                decided = candidate.decisive_steps
                turned = report.kind is SlowKind.COMMUNICATION or persisted(
                    self.gate, candidate, latest, self.spec.min_duration_s
                )
                self.changed |= candidate.decisive_steps != decided
                if turned and clock - candidate.confirmed_since >= self.spec.min_duration_s:
                    self._open(node, candidate, why=SWEPT if candidate.swept else "")
            elif verdict is False and self._rising(node, candidate, clock - candidate.came_at <= ttl):
                # Over the threshold, yet its excess costs the job too little so far: wait for the
                # level's window to fill with its steps since the onset, as a dismissal would end it.
                if candidate.confirmed_since is not None:
                    candidate.confirmed_since, candidate.decisive_steps = None, 0
                    self.changed = True
            elif verdict is False:
                # The node's level since its onset is within the threshold of the others' (noise, or a
                # slowdown that every node shares: machine-wide), or its excess costs the job too little.
                del self.candidates[node]
                self.changed = True
                if not candidate.swept:  # the operator's own hypothesis, no agent's report: nothing to tell
                    self._dismiss(node, self.gate.why_not(node, report.onset_step))
                continue
            if node in self.candidates and clock - candidate.came_at > ttl:
                del self.candidates[node]
                self.changed = True
                if not candidate.swept:
                    why = f": {self.gate.why_not(node, report.onset_step)}" if verdict is False else ""
                    self._dismiss(node, f"not confirmed against the other nodes within {ttl:.0f}s{why}")

    def _ttl(self) -> float:
        """How long a candidate may wait to be confirmed: a level window of steps, so that a job of long
        steps gets as long for it."""
        return max(CANDIDATE_TTL_S, 2 * self.gate.window * self.gate.step_s)

    def _rising(self, node: int, candidate: Candidate, young: bool) -> bool:
        """Whether a compute candidate that the rule found no straggler is still worth waiting for: young,
        and slower than the other nodes by the threshold (its cost to the job fell short). Its level since
        the onset fills with slowed steps as they come: the demo's x4 worker read 2.63x five steps after
        its onset, 0.042 s of extra compute a step where 0.047 s was needed; dismissed, it waited for the
        operator's sweep, 12 steps more."""
        if not young or candidate.swept or candidate.report.kind is not SlowKind.COMPUTE:
            return False  # the sweep judges every node again on its next window
        onset = candidate.report.onset_step
        ratio = self.gate.ratios({node: onset}).get(node)
        noise = self.gate.noise
        if ratio is None or noise is None or ratio <= self.spec.slowdown_threshold:
            return False
        # Slower beyond the job's noise, or the wait is one more chance for noise to confirm it.
        steps = sum(step >= onset for step, _ in self.gate.recent(node))
        return beyond_noise(ratio, noise, steps)

    def _sweep(self, clock: float) -> None:
        """Outside an episode, every node with a full level window is judged by the job-wide rule even
        though its agent reported nothing: a straggler becomes a compute candidate, confirmed like a
        report. Agents' detectors ignore changes under `AGENT_DETECTOR.min_change` (25%) and miss drifts;
        a worker ordered 1.3x slower on the demo's GPT ran 1.36x its peers' compute for 550 steps unreported
        while the whole host drifted 1.2x. Once per level window per node."""
        skip = set(self.candidates) | set(self._sources)
        for node, (first, own, reference) in self.gate.sweep(skip).items():
            latest = self.gate.steps.get(node, first)
            if latest - self._swept.get(node, -self.gate.window) < self.gate.window:
                continue
            self._swept[node] = latest
            share = self.gate.share(node)
            report = SlowReport(
                node=node,
                generation=max(0, self.gate.generation),
                step=latest,
                onset_step=first,
                slowdown=own / reference,
                baseline_s=reference * share,
                level_s=own * share,
                kind=SlowKind.COMPUTE,
                detected_at=clock,
            )
            self.candidates[node] = Candidate(report, clock, swept=True)
            self.changed = True

    def _dismiss(self, node: int, why: str) -> None:
        self.findings.append(
            Finding(FindingKind.DISMISSED, (node,), f"node {node}: slow report ignored: {why}")
        )

    # ---- validation --------------------------------------------------------------------------------------
    def validation_wanted(self, now: float | None = None) -> list[int] | None:
        """Suspects for a validation pass, when a communication report waits for one and none is out."""
        if self.awaiting is not None:
            return None
        ready = [candidate.report.node for candidate in self.asking(now)]
        found = _validation.suspects(ready, self.profiles)
        return None if found is None else [node for node in found if node not in self.gone]

    def asking(self, now: float | None = None) -> list[Candidate]:
        """The communication candidates that wait for a pass now (`_asked`): a pass's reason names them."""
        clock = time.time() if now is None else now
        return [candidate for candidate in self.candidates.values() if self._asked(candidate, clock)]

    def _holds(self, report: SlowReport) -> bool | None:
        """`_failslow_validation.communication_holds` on the reporter's kept steps."""
        walls = self.clocks.walls(report.node)
        return _validation.communication_holds(report, walls, self.spec.slowdown_threshold)

    def _host_rule_walls(self, candidate: Candidate) -> list[tuple[int, float]] | None:
        """The reporter's kept steps, where the host-blip rule (`_host_slowed`) applies to `candidate`:
        not to the job-level trigger's reports (it judged the nodes' compute itself), nor during an episode
        or across generations (the job-level trigger keeps no compute then)."""
        report = candidate.report
        walls = self.clocks.walls(report.node)
        if candidate.job_level or self.controller.active or report.generation != self.job.generation:
            return None
        return walls or None

    def _host_slowed(self, candidate: Candidate) -> str | None:
        """`_failslow_validation.compute_explains` on the reporter's kept steps and the nodes' compute over
        the same steps, where the rule applies (`_host_rule_walls`)."""
        walls = self._host_rule_walls(candidate)
        if walls is None:
            return None
        rise = self.job.compute_rise(candidate.report.onset_step, walls[-1][0])
        return _validation.compute_explains(candidate.report, walls, rise)

    def _waits_for_records(self, candidate: Candidate, clock: float) -> bool:
        """Whether `candidate`, still young, waits for the nodes' records of its reporter's latest step
        before `_host_slowed` judges it: most nodes' compute is not there yet (and the rule applies)."""
        if clock - candidate.came_at > self._ttl():
            return False
        walls = self._host_rule_walls(candidate)
        return walls is not None and self.job.behind(walls[-1][0])

    def _asked(self, candidate: Candidate, clock: float) -> bool:
        """Whether a communication candidate waits for a pass (and a pass's answer is its answer): not
        validated yet, its own steps bear its slowdown out, and `tick` would not dismiss it as the host's
        nor wait for the other nodes' records of its steps first. One short of that waits for a pass of its
        own; another reporter's pass neither confirms nor dismisses it. The operator's pass asks before its
        `tick` judges the reports that came with it: asked on `_holds` alone, the passes of 15 healthy
        minutes at 1.2 (training held ~0.5 s each) came milliseconds before the host rule's dismissals."""
        report = candidate.report
        if report.kind is not SlowKind.COMMUNICATION or candidate.validated is not None:
            return False
        if self._holds(report) is not True or self._host_slowed(candidate) is not None:
            return False
        return not self._waits_for_records(candidate, clock)

    def validation_sent(
        self, request_id: int, now: float | None = None, revalidating: Iterable[int] = ()
    ) -> None:
        """A pass went out: for the waiting candidates, or for the drained nodes of `revalidating`
        (`revalidation_wanted`)."""
        clock = time.time() if now is None else now
        self.awaiting = (request_id, clock)
        self.revalidation.sent(revalidating, clock)
        self.changed = True

    def revalidation_wanted(self, now: float | None = None) -> list[int] | None:
        """Drained slow nodes due a pass of their own (`_failslow_revalidate`), when no pass is out."""
        clock = time.time() if now is None else now
        # Only a slow device's recovery is what a GEMM measures: a drained link's end or an unvalidated
        # communication straggler would be timed healthy and restored straight into its slowdown.
        active = self.controller.active and self.spec.enabled
        drained = [
            n for n in self.slow if active and n in self.idle and n not in self.gone and self._lone_device(n)
        ]
        due = self.revalidation.due(drained, clock)  # also forgets nodes taken back, and a closed episode's
        return due if due and self.awaiting is None else None

    def validated(self, result: ValidationResult, now: float | None = None) -> Mitigation | None:
        """A validation pass's result: slow links and devices join the waiting communication candidates
        (their episode opens once `min_duration_s` old); a pass that finds nothing dismisses them. A pass
        for drained nodes (`revalidation_wanted`) may end the episode: the restore is returned."""
        if self.awaiting is None or result.id != self.awaiting[0]:
            return None
        self.awaiting = None
        self.changed = True
        clock = time.time() if now is None else now
        if self.revalidation.asked:
            return self._revalidated(result, clock)
        links, devices, findings = _validation.named_by(result)
        self.links.update(links)
        self.findings.extend(findings)
        named = tuple(sorted({n for link in links for n in link} | set(devices)))
        for node, candidate in list(self.candidates.items()):
            if not self._asked(candidate, clock):
                continue  # still waiting for its own steps to clear their noise: a pass of its own
            if named:
                candidate.validated, candidate.devices = named, tuple(devices)
            else:
                del self.candidates[node]
                self._dismiss(node, "validation found no slow link or device")
        return None

    def _revalidated(self, result: ValidationResult, clock: float) -> Mitigation | None:
        """Drained nodes' devices timed again: one within the recovered bar of the others' median is back
        on this measurement, as on its agent's recovery report; one still slow waits for its next pass."""
        decision = None
        held = f"validation at step {result.step} (training held {result.held_s:.2f}s)"
        for node, ratio in self.revalidation.judge(result.gemm_s, slow=set(self.slow)).items():
            slowdown = self.slow.get(node)
            if slowdown is None:
                continue  # back meanwhile (its report came), or gone
            if ratio is None or ratio > self._recovered_bar:
                after = self.revalidation.next_in(node, clock)
                timed = "did not time it" if ratio is None else f"timed its device at {ratio:.2f}x the median"
                again = "" if after is None else f"; timed again in {after:.0f}s"
                self.findings.append(
                    Finding(
                        FindingKind.SLOW_DEVICE,
                        (node,),
                        f"node {node}, drained with no recovery report: {held} {timed}{again}",
                    )
                )
                continue
            report = _measured_recovery(
                node, result.generation, result.step, ratio, slowdown, result.gemm_s[node], clock
            )
            measured = f"{held} timed its device at {ratio:.2f}x the median, with no recovery report since S2"
            decision = self._recovered(report, clock, clock, measured=measured) or decision
        return decision

    def probe_step(self, record: IterationRecord, in_plan: bool) -> None:
        """A record's probe: a parked node's probe step (`in_plan` False: its compute is the product's
        time), or a training node's reference timing of it (`probe_s`)."""
        if not in_plan:
            if record.samples == 0 and record.compute_s is not None:  # a probe step trains no sample
                self.parked.probe(record.node, record.compute_s)
        elif record.probe_s is not None and record.node not in self.gone:
            self.parked.reference(record.node, record.probe_s)

    def parked_recheck(self, plan_nodes: Collection[int], now: float | None = None) -> Mitigation | None:
        """Parked slow devices (out of `plan_nodes`) that sent no recovery report `parkedRecheckS` after
        their park, judged by their probe against the training nodes' (`_failslow_parked`): one whose
        windows read within the recovered bar `AGREE` times in a row is back, on this measurement, as on
        its agent's report; the restore is returned when it was the episode's last slow node."""
        clock = time.time() if now is None else now
        active = self.controller.active and self.spec.enabled
        # Only a slow device's recovery is what the probe measures (as for a drained node's recheck).
        parked = [
            n
            for n in self.slow
            if active and n not in plan_nodes and n not in self.gone and self._lone_device(n)
        ]
        self._parked_said &= set(parked)  # a node parked again is said again
        decision = None
        training = set(plan_nodes) - self.idle
        for node in self.parked.due(parked, clock):
            reading = self.parked.judge(node, self._recovered_bar, slow=set(self.slow), among=training)
            if reading is None:
                continue
            slowdown = self.slow[node]
            waited = self.parked.parked_for(node, clock)
            read = (
                f"its probe reads {reading.ratio:.2f}x the median of {reading.references} training nodes' "
                f"timings of it ({reading.level_s:.3g}s vs {reading.reference_s:.3g}s)"
            )
            if reading.ratio > self._recovered_bar:
                if node not in self._parked_said:
                    self._parked_said.add(node)
                    self.findings.append(
                        Finding(
                            FindingKind.SLOW_DEVICE,
                            (node,),
                            f"node {node}, parked {waited:.0f}s with no recovery report: {read}; back once "
                            f"within {self._recovered_bar:.3g}x",
                        )
                    )
                continue
            if not reading.back:
                continue
            generation = self.gate.generation if self.gate.generation >= 0 else 0
            report = _measured_recovery(node, generation, 0, reading.ratio, slowdown, reading.level_s, clock)
            self.parked.taken_back(node, clock)
            self._parked_said.discard(node)
            self.changed = True
            measured = (
                f"parked {waited:.0f}s with no recovery report, {read}, within {self._recovered_bar:.3g}x "
                f"{AGREE} windows in a row"
            )
            decision = self._recovered(report, clock, clock, measured=measured) or decision
        return decision

    def validation_timeout(self, now: float | None = None) -> bool:
        """True (once) when the outstanding pass is older than the spec's timeout: the waiting
        communication candidates go on with their reporters as the suspects."""
        clock = time.time() if now is None else now
        if self.awaiting is None or clock - self.awaiting[1] < self.spec.validation_timeout_s:
            return False
        self.awaiting = None
        self.changed = True
        if self.revalidation.asked:
            # A drained node's pass: no candidate waited for it, and the node's next pass is scheduled.
            nodes, self.revalidation.asked = self.revalidation.asked, ()
            self.findings.append(
                Finding(
                    FindingKind.SLOW_DEVICE,
                    nodes,
                    f"drained nodes {list(nodes)}: no result of the pass that was to time them within "
                    f"{self.spec.validation_timeout_s:.0f}s; they are timed again later",
                )
            )
            return False
        for candidate in self.candidates.values():
            if self._asked(candidate, clock):
                candidate.validated = ()  # unvalidated: the episode goes on with the reporter alone
        return True

    def _corroborated(self, reporter: int, candidate: Candidate) -> tuple[tuple[int, ...], set[int]]:
        """The nodes a validated communication episode takes in, and which are slow devices
        (`_failslow_validation.corroborated`)."""
        named, slow, finding = _validation.corroborated(
            reporter, candidate, self.links, self.gate, self.spec.slowdown_threshold
        )
        if finding is not None:
            self.findings.append(finding)
        return named, slow

    # ---- the episode -------------------------------------------------------------------------------------
    def _open(self, reporter: int, candidate: Candidate, why: str = "") -> None:
        del self.candidates[reporter]
        report = candidate.report
        taken, devices = self._corroborated(reporter, candidate)
        if candidate.validated and not taken:
            self.changed = True
            self._dismiss(reporter, "validation named no slow link, and no device the job-wide rule confirms")
            return
        nodes = taken or (reporter,)
        latest = max(self.gate.steps.get(reporter, report.step), report.step)
        if not self.controller.active:
            self.controller.on_change(_event(report, latest))
            self._compute_episode = report.kind is SlowKind.COMPUTE
            level = report.level_s or report.baseline_s * report.slowdown
            self._detect_s = max(1, latest - report.onset_step + 1) * level
            self._steps = (report.onset_step, latest)
        # A device that validation traced a communication report to is as slow as its own compute says, not
        # as the reporter's step (of which its compute is a part): the demo's x4 worker, named so, went into
        # S2 at the peer's 1.78x, and S2 left it a micro-batch that set the job's pace.
        own = self.gate.ratios(dict.fromkeys(devices, report.onset_step)) if devices else {}
        for node in nodes:
            factor = own.get(node) or report.slowdown
            self.slow[node] = max(self.slow.get(node, 1.0), factor)
        self.devices.update(nodes if report.kind is SlowKind.COMPUTE else devices)
        self._fed[reporter] = latest
        self._sources[reporter] = nodes
        causes: set[RootCause] = set()
        if report.kind is SlowKind.COMPUTE:
            causes.add(RootCause.COMPUTE)
        elif not candidate.validated:
            causes.update(RootCause)  # validation timed out: the cause is unproven, any strategy may help
        else:
            endpoints = {n for link in self.links for n in link}
            if endpoints & set(nodes):
                causes.add(RootCause.COMMUNICATION)
            if set(nodes) & self._compute_slow():
                causes.add(RootCause.COMPUTE)  # a device that validation found slow (a link's end or not)
        self.controller.localized(tuple(sorted(causes)), nodes)
        self.changed = True
        self.findings.append(
            Finding(
                FindingKind.SLOW,
                nodes,
                f"node {reporter} is {report.slowdown:.2f}x slower ({report.kind}) than its baseline "
                f"({report.baseline_s:.3g}s/step) since step {report.onset_step}; slow nodes {list(nodes)}"
                + why,
            )
        )

    def recheck(self, now: float | None = None) -> Mitigation | None:
        """Judge the recovery reports that came before the steps to judge them by (the reconciler calls it
        each pass before the new reports, once the last pass's steps are in the levels)."""
        clock = time.time() if now is None else now
        pending, self._recovering = self._recovering, {}
        decision = None
        for recovery in pending.values():
            decision = self._recovered(recovery.report, recovery.came_at, clock) or decision
        return decision

    def _recovered(
        self, report: SlowReport, came_at: float, clock: float, measured: str | None = None
    ) -> Mitigation | None:
        """A node's recovery: its agent's report, or (`measured`: what said so) a revalidation's timing."""
        dropped = self.candidates.pop(report.node, None)
        device = report.kind is SlowKind.COMPUTE and self._lone_device(report.node)
        nodes = self._sources.get(report.node) or ((report.node,) if device else None)
        if nodes is None:
            self.changed = self.changed or dropped is not None
            return None
        if measured is None and not self._undoes_its_slowdown(report):
            self.changed = True
            return None
        # A recovery report is a node's own step getting shorter, which a mitigation (S2 moved work off
        # the straggler; the peers that waited for it wait less) or a busy host quietening also cause. A
        # compute straggler of the episode that is still slower than the others stays in it, as its own
        # source; restoring the healthy plan now would bring the slowdown straight back. Its speed is
        # judged on its steps since the report's onset, which reach the levels after the report: until
        # enough have come (or `CANDIDATE_TTL_S`), the report waits. A node without steps in the levels
        # (parked by S4: its probe steps are other work) has only its agent's word, which stands.
        ratios = self._speeds(nodes, report.onset_step)
        waiting = [n for n, ratio in ratios.items() if ratio is None and self.gate.measures(n)]
        if waiting and measured is None and clock - came_at < CANDIDATE_TTL_S:
            self._recovering[report.node] = Candidate(report, came_at)
            self.changed = True
            return None
        self._sources.pop(report.node, None)
        slower = tuple(
            n for n, ratio in sorted(ratios.items()) if ratio is not None and ratio > self._recovered_bar
        )
        # A node with no level (S2 drained it, S4 parked it) is back on its own word only: a peer that had
        # waited for it and now waits less says nothing of it (seen: the demo's drained x4 worker restored
        # by a peer's report while its order held).
        absent = tuple(
            n for n in sorted(nodes) if n in ratios and n != report.node and not self.gate.measures(n)
        )
        kept = slower + absent
        for node in kept:
            self._sources[node] = (node,)
        if device and report.node not in kept:
            self._answered(report.node)
        if slower:
            self.findings.append(
                Finding(
                    FindingKind.DISMISSED,
                    (report.node,),
                    f"node {report.node}: recovery report ignored for nodes {list(slower)}: still over "
                    f"{self._recovered_bar:.3g}x the other nodes' level per planned share",
                )
            )
        if absent:
            self.findings.append(
                Finding(
                    FindingKind.DISMISSED,
                    (report.node,),
                    f"node {report.node}: recovery report ignored for nodes {list(absent)}: out of the step "
                    "(drained or parked), they are back on their own recovery report",
                )
            )
        still = {n for led in self._sources.values() for n in led}
        back = tuple(node for node in nodes if node not in still)
        for node in back:
            self.slow.pop(node, None)
        self.links = {link for link in self.links if link[0] in self.slow or link[1] in self.slow}
        self.devices &= set(self.slow)
        self.changed = True
        if back or report.node not in kept:
            speeds = ", ".join(f"{n}: {ratios[n]:.2f}x" for n in back if ratios.get(n) is not None)
            self.findings.append(
                Finding(
                    FindingKind.RECOVERED,
                    back,
                    (measured and f"node {report.node} is back: {measured}")
                    or f"node {report.node} is back to {report.level_s:.3g}s/step at step {report.step}"
                    + (f" (level vs the other nodes' per planned share: {speeds})" if speeds else ""),
                )
            )
        if self.slow:
            return None
        self._fed.clear()
        self._recent, self._rungs = [], []
        self._recovering.clear()
        self.rung_check.reset()
        decision = self.controller.on_change(_event(report, report.step))
        if decision is None:
            return None
        return Mitigation(Action.RESTORE, {report.node: 1.0}, decision.reason, decision.loss_s, 0.0)

    def _undoes_its_slowdown(self, report: SlowReport) -> bool:
        """Whether a recovery report of a node out of the step (S2 drained it, S4 parked it: no level to
        judge it by) shows at least half its slowdown undone, in ratio terms: its probe's level fell to at
        most 1 / sqrt(slowdown) of what it was. A probe of a millisecond drifts by a quarter on a fast host:
        the demo's drained x4 worker, 4 ms -> 3 ms in 40 s on 16 cores, was restored while its order held,
        and S2 came back 3 s later. A node with a level is judged by it instead (`_speeds`)."""
        slowdown = self.slow.get(report.node, 1.0)
        if self.gate.measures(report.node) or slowdown <= 1.0:
            return True
        needed = 1.0 / math.sqrt(slowdown)
        if report.slowdown <= needed:
            return True
        self.findings.append(
            Finding(
                FindingKind.DISMISSED,
                (report.node,),
                f"node {report.node}: recovery report ignored: out of the step, its probe fell to "
                f"{report.slowdown:.2f}x of its level, short of the {needed:.2f}x that undoes half of its "
                f"{slowdown:.2f}x slowdown",
            )
        )
        return False

    def _lone_device(self, node: int) -> bool:
        """Whether `node` is a slow device of the episode and no slow link's end: its own compute recovery
        is then the whole answer for it."""
        return node in self.devices and node in self.slow and not any(node in link for link in self.links)

    def _answered(self, device: int) -> None:
        """A slow device's own compute recovery answers the peers' communication reports that validation
        traced to it: they waited for it. Their own recovery reports come only when its recovery shortens
        their step, which it does not while S2 has drained it or S4 parked it (the episode stayed open, seen
        on the local stack, until a waiting peer's detector happened to report noise as its recovery)."""
        for reporter, led in list(self._sources.items()):
            if device in led:
                rest = tuple(node for node in led if node != device)
                if rest:
                    self._sources[reporter] = rest
                else:
                    del self._sources[reporter]

    @property
    def _recovered_bar(self) -> float:
        return 1.0 + RECOVERED_WITHIN * (self.spec.slowdown_threshold - 1.0)

    def _speeds(self, nodes: Iterable[int], since: int) -> dict[int, float | None]:
        """The compute stragglers among `nodes` (slow devices, and slow nodes that are not a slow link's end)
        with their level since step `since` over the other nodes', per planned share (None: too few steps)."""
        slow = self._compute_slow()
        compute = {n: since for n in nodes if n in slow}
        return self.gate.ratios(compute) if compute else {}

    def forget(self, nodes: Iterable[int]) -> None:
        """Failed nodes leave the episode; with no slow node left it ends without a restore (the fail-stop
        replan already chose the layout)."""
        gone = set(nodes)
        self.gone |= gone
        for node in gone:
            self.profiles.pop(node, None)
            self.slow.pop(node, None)
            self.candidates.pop(node, None)
            self._sources.pop(node, None)
            self._recovering.pop(node, None)
            self.clocks.forget(node)
            self.parked.forget(node)
        self.links = {link for link in self.links if not set(link) & gone}
        self.devices -= gone
        self.gate.forget(gone)
        if not self.slow and self.controller.active:
            self.controller = self._fresh_controller()
            self._sources.clear()
            self._recovering.clear()
            self._fed.clear()
            self.links.clear()
            self.devices.clear()
            self._recent, self._rungs = [], []
            self.rung_check.reset()
        self.changed = True

    def drain_findings(self) -> list[Finding]:
        out, self.findings = self.findings, []
        return out

    # ---- persistence -------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Everything an operator restarted mid-episode needs (JSON-able)."""
        return {
            "episode": self.controller.snapshot(),
            "slow": {str(n): f for n, f in self.slow.items()},
            "links": sorted(list(link) for link in self.links),
            "devices": sorted(self.devices),
            "sources": {str(n): list(led) for n, led in self._sources.items()},
            "candidates": {str(n): c.state() for n, c in self.candidates.items()},
            "recovering": {str(n): c.state() for n, c in self._recovering.items()},
            "awaiting": None if self.awaiting is None else list(self.awaiting),
            "revalidating": list(self.revalidation.asked),
            "detect_s": self._detect_s,
            "steps": None if self._steps is None else list(self._steps),
            "fed": {str(n): s for n, s in self._fed.items()},
            "compute_episode": self._compute_episode,
            "recent": list(self._recent),
            "rungs": [[action, level] for action, level in self._rungs],
            "rung_check": self.rung_check.state(),
            "parked_trips": self.parked.state(),
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue the episode `state()` described (raises KeyError/ValueError/TypeError if malformed)."""
        controller = self._fresh_controller()
        controller.resume(state.get("episode"))
        slow = {int(n): float(f) for n, f in state["slow"].items()}
        links = {(int(a), int(b)) for a, b in state["links"]}
        sources = {int(n): tuple(int(m) for m in led) for n, led in state["sources"].items()}
        candidates = {int(n): Candidate.of(c) for n, c in state["candidates"].items()}
        awaiting = state.get("awaiting")
        self.controller, self.slow, self.links, self._sources = controller, slow, links, sources
        self.devices = {int(n) for n in state.get("devices", [])}
        self.candidates = candidates
        self._recovering = {int(n): Candidate.of(c) for n, c in state.get("recovering", {}).items()}
        self.awaiting = None if awaiting is None else (int(awaiting[0]), float(awaiting[1]))
        # Whose the outstanding pass is: a drained node's result must not be read as the candidates'.
        self.revalidation.asked = tuple(int(n) for n in state.get("revalidating", ()))
        self._detect_s = float(state.get("detect_s", 0.0))
        steps = state.get("steps")
        self._steps = None if steps is None else (int(steps[0]), int(steps[1]))
        self._fed = {int(n): int(s) for n, s in state.get("fed", {}).items()}
        self._compute_episode = bool(state.get("compute_episode", True))
        self._recent = [float(v) for v in state.get("recent", [])][-RECENT:]
        self._rungs = [(str(action), float(level)) for action, level in state.get("rungs", [])]
        self.rung_check.resume(state.get("rung_check"))
        self.parked.resume(state.get("parked_trips"))
        self.changed = False


def _measured_recovery(
    node: int, generation: int, step: int, ratio: float, slowdown: float, level_s: float, clock: float
) -> SlowReport:
    """The recovery report the operator writes for a node out of the step whose device it measured itself
    (a drained node's validation pass, a parked node's probe against the training nodes'): `ratio` its
    time over the others' median, `slowdown` what the episode charged it, `level_s` its measured time. The
    report's `slowdown` is its speed now over its slowed one, as an agent's probe recovery reads."""
    return SlowReport(
        node=node,
        generation=generation,
        step=step,
        onset_step=step,
        slowdown=min(1.0, ratio / slowdown),
        baseline_s=level_s * slowdown / ratio,
        level_s=level_s,
        kind=SlowKind.COMPUTE,
        recovered=True,
        detected_at=clock,
    )


def _event(report: SlowReport, detected_at: int) -> ChangeEvent:
    before = report.baseline_s
    after = report.level_s or before * report.slowdown
    kind = ChangeKind.RECOVERY if report.recovered else ChangeKind.SLOWDOWN
    onset = min(report.onset_step, detected_at)
    return ChangeEvent(index=onset, kind=kind, before_s=before, after_s=after, detected_at=detected_at)
