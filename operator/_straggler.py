"""Which nodes are stragglers, judged across the job (Falcon 4.3 localisation), pure: no I/O.

An agent's change-point report says that ITS step time moved; on a loaded machine every node's time moves
with the noise, and a report alone is no proof that one node holds the others back. The operator therefore
confirms each report against the other nodes' recent levels before it counts (`StragglerGate`), and finds
suspicious communication groups from the agents' profiles (`communication_suspects`).

The rule (what `StragglerGate.straggler` decides):

- A node's **level** is the median of its last `window` compute times (`IterationRecord.compute_s`, or the
  step's `seconds` from agents that do not split compute from communication), in the current generation
  only (a new generation changes the work of every node); for the reporting node, only steps from the
  report's onset on count.
- The **window** is sized from the job's own noise (`window_for`): enough steps that noise alone keeps a
  node's median 2.5 standard errors under the threshold (`_Z`). A quiet cluster (compute varying 2% from
  step to step) judges on 4 steps, so a 1.3x straggler opens within about ten iterations; a shared,
  overloaded host (20-30% of a node's own, the local stack's real GPT) at threshold 1.2 waits 13-25. The
  noise is each node's robust spread (1.4826 x the median absolute deviation over the median) of its
  compute relative to the job's median at the same step, pooled as the median over the nodes: what the
  whole host does to every node at once cancels, as it does in the rule; one node's level shift does not
  widen the pooled value. Where a node is held against a share class smaller than the job (below), the
  median of its few peers is a noisier reference, and the noise is widened by that (`reference_widening`).
- Its **planned share** `w` is its compute per step in the published plan (forward + backward of its layers
  x its pipeline's micro-batches, rerouted stages split over the peers that run them) divided by the median
  over the plan's nodes; 1.0 for every node of a symmetric layout. Dividing by it makes a node with a
  heavier stage, or with more micro-batches after S2, comparable with the rest: its healthy level relative
  to the job's median is its planned share.
- The node is a straggler when `level / w > threshold x median(level_m / w_m)` over the OTHER nodes m with
  at least `min_samples` levels (theirs over the same steps, from the report's onset, where they have
  enough of them). The others are those of the node's **share class** when it has at least
  `MIN_CLASS_PEERS` of them with levels: the nodes whose planned shares are within `SHARE_CLASS_TOLERANCE`
  of each other do the same work, and compare directly, whatever a step costs beyond the profile's layer
  times. That cost is what the shares miss: the optimizer, the data and a step's bookkeeping do not scale
  with the layers' forward and backward, and on the demo's small GPT they are much of a step (its
  stages' compute measured 0.65-0.9x the whole replicas', planned 0.5x): across classes, the stages looked
  1.3-2x slow per share (the sweep opened episodes at start-up) and a whole replica slowed 1.5x looked
  1.14x. Only a node without enough peers of its class is judged against the whole job. A machine-wide
  slowdown raises every node's level, so the median of the others rises with it and nobody is a
  straggler. With no other node to compare with (a one-node job), the agent's own before/after ratio is
  all there is, and the report counts as it is.
- And the straggler must matter: its excess compute per step, `(level / w - median) x w` in seconds, must
  be at least `threshold - 1` times the job's median step time (wall, all nodes, this generation). A node
  whose compute is a sliver of the step (communication-bound jobs, tiny models: the demo's compute is ~5 ms
  of a 40 ms step, and its per-step variation on a loaded host reaches 50-60%) can double its compute
  without slowing the job by the threshold; Falcon's controller would only "ignore" it (S1) anyway.
- A level over fewer steps than the window can still be **decisive** (`StragglerGate.decisive`): when the
  node is as far above its peers as noise reaches on that many steps only as rarely as on a full window at
  the threshold. A 2x node on a 32%-noise host is decided on 4 steps; a report can be confirmed on two
  such disjoint windows instead of two full ones (`_failslow_persist`).
- A slowdown report opens an episode only after `min_duration_s` during which every check found the node a
  straggler (`FailSlowTracker` holds the candidates); one check that finds it back within the threshold
  dismisses the report.

Communication: the agents' `ProfileRecord.groups` give seconds per iteration inside each group's calls,
labelled with node ids ('0,1,2' a collective, '0,1@1' point-to-point with peer 1). Groups are compared only
with groups of the same kind and size (a 4-way all-reduce moves other volumes than a 2-node send); a group
above `SUSPICION_FACTOR` (1.1) x the median of its class is suspicious (`planner.failslow.suspicious_groups`),
and its nodes are the communication suspects that a validation pass tests.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from statistics import median

from resilientjob.planner.failslow import GroupProfile, suspicious_groups
from resilientjob.planner.plan import Plan
from resilientjob.planner.profile import ModelProfile
from resilientjob.protocol.messages import IterationRecord, ProfileRecord

MIN_WINDOW = 4
"""Fewest steps a level is judged on, however quiet the job (a median of 4 shrugs off one outlier)."""
MAX_WINDOW = 32
"""Most steps a level is judged on, however noisy the job: detection slows with the window, so noise beyond
this is left to the confirmation (a second, turned-over window) and the materiality rule."""
NOISE_SAMPLES = 8
"""Steps a node needs before its spread counts toward the job's noise; until nodes have them, the window is
`MAX_WINDOW`."""
NOISE_NODES = 64
"""Nodes whose spreads are pooled into the job's noise (`StragglerGate.noise`)."""
_Z = 2.5
"""Standard errors between the noise-only median and the threshold: a 0.6% chance per check that noise
alone crosses it, and confirmation asks a second, turned-over window to cross it too. Calibrated on
Gaussian noise of 2-40% at thresholds 1.1-1.5 (no false episode in 2,000 steps of 8 nodes for any), and on
the local stack's recorded healthy runs (`bench/bench_failslow_replay.py`)."""


SHARE_CLASS_TOLERANCE = 1.05
"""Planned shares within this factor of each other are one class: the same work (`StragglerGate._judge`)."""
MIN_CLASS_PEERS = 2
"""Other nodes of its share class, with levels, that a node is compared with instead of the whole job."""


def share_classes(shares: Mapping[int, float]) -> dict[int, int]:
    """node -> its class: nodes sorted by planned share, a new class wherever a share is over
    `SHARE_CLASS_TOLERANCE` times the smallest of the class being filled."""
    classes: dict[int, int] = {}
    label, first = -1, 0.0
    for node, share in sorted(shares.items(), key=lambda item: item[1]):
        if label < 0 or share > first * SHARE_CLASS_TOLERANCE:
            label, first = label + 1, share
        classes[node] = label
    return classes


def median_variance(count: int) -> float:
    """The variance of the median of `count` independent Gaussian values, relative to one value's:
    pi / (2 count + pi - 2), exact for 1, within 0.02 of the exact for 3 and beyond (0.449 for 3, 0.21 for
    7) and pi / (2 count) asymptotically; 0.61 for 2, where the exact is 0.5 (a little careful)."""
    return math.pi / (2 * count + math.pi - 2)


def reference_widening(peers: int, job_peers: int) -> float:
    """How much noisier a node's comparison with the median of `peers` other nodes is than one with the
    median of `job_peers` (the whole job's others), in the standard deviation of the ratio: the
    node's own level is as noisy either way, the reference's median over fewer nodes more. The window
    (`window_for`, `_Z`) was calibrated on whole-job references of 8-node jobs, so a class reference
    widens the noise by this factor, and a whole-job one by none (1.0)."""
    if peers < 1 or job_peers <= peers:
        return 1.0
    return math.sqrt((1 + median_variance(peers)) / (1 + median_variance(job_peers)))


def window_for(noise: float, threshold: float) -> int:
    """Steps a level needs so that noise alone (relative spread `noise` per step) keeps the median of a
    healthy node `_Z` standard errors below `threshold` times its peers' (a median's standard error is about
    1.2533 sd / sqrt(n)), within [MIN_WINDOW, MAX_WINDOW]."""
    if not threshold > 1:
        raise ValueError(f"threshold: must be > 1, got {threshold}")
    need = math.ceil((_Z * 1.2533 * max(0.0, noise) / (threshold - 1)) ** 2)
    return max(MIN_WINDOW, min(MAX_WINDOW, need))


def beyond_noise(ratio: float, noise: float, steps: int, z: float = _Z) -> bool:
    """Whether a median of `steps` steps at `ratio` times a level is further above it than noise of
    relative spread `noise` per step takes such a median but `z` standard errors' rarely."""
    return steps > 0 and ratio >= 1 + z * 1.2533 * max(0.0, noise) / math.sqrt(steps)


def relative_spread(values: Iterable[float]) -> float | None:
    """1.4826 x MAD / median: the standard deviation relative to the level, for Gaussian noise, and robust
    to the odd stalled step. None for fewer than `NOISE_SAMPLES` values or a zero median."""
    ordered = sorted(values)
    if len(ordered) < NOISE_SAMPLES:
        return None
    middle = median(ordered)
    if middle <= 0:
        return None
    return 1.4826 * median(abs(value - middle) for value in ordered) / middle


def planned_shares(plan: Plan, profile: ModelProfile) -> dict[int, float]:
    """Each node's compute per step in `plan`, relative to the median over the plan's nodes."""
    # Ratios: a plan in S2's smaller micro-batches scales every stage alike, so the profile needs no rescale.
    work: dict[int, float] = {}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            forward, backward = profile.stage_times(stage.layers[0], stage.layers[1], len(stage.gpus))
            seconds = (forward + backward) * pipeline.microbatches
            runners = stage.rerouted_to or (stage.node,)
            for node in runners:
                work[node] = work.get(node, 0.0) + seconds / len(runners)
    # A drained replica's nodes do no work: their steps are probes (`TelemetryPass` keeps them out of the
    # levels), and a share of 0 would divide by zero.
    work = {node: value for node, value in work.items() if value > 0}
    middle = median(work.values()) if work else 0.0
    if middle <= 0:
        return dict.fromkeys(work, 1.0)
    return {node: value / middle for node, value in work.items()}


@dataclass(slots=True)
class StragglerGate:
    """Recent compute levels of every node, and the rule above to judge one of them."""

    threshold: float
    fixed_window: int | None = None
    """Judge levels on this many steps; None sizes the window from the job's noise (`window_for`)."""
    min_samples: int = 4
    shares: dict[int, float] = field(default_factory=dict)
    generation: int = -1
    _levels: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)
    _step_s: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    """Recent step times (wall) of all nodes in this generation: the job's step, for the materiality rule."""
    steps: dict[int, int] = field(default_factory=dict)
    """Each node's latest step seen (any generation): the loss of a late-opened episode counts from it."""
    _window: int | None = None
    """The noise-sized window, cached until the next observation."""
    _noise: tuple[float | None] | None = None
    """The job's noise (`noise`), cached until the next observation."""
    _walls: set[int] = field(default_factory=set)
    """Nodes whose levels are step walls (agents that do not split compute from communication)."""

    def __post_init__(self) -> None:
        if not self.threshold > 1:
            raise ValueError(f"threshold: must be > 1, got {self.threshold}")
        low = self.fixed_window if self.fixed_window is not None else MIN_WINDOW
        if low < 1 or not 1 <= self.min_samples <= low:
            raise ValueError(f"window/min_samples: need 1 <= min_samples <= window, got {low}")

    @property
    def window(self) -> int:
        """Steps a level is judged on now: `fixed_window`, or sized from the job's noise."""
        if self.fixed_window is not None:
            return self.fixed_window
        if self._window is None:
            noise = self.noise
            self._window = MAX_WINDOW if noise is None else window_for(noise, self.threshold)
        return self._window

    @property
    def noise(self) -> float | None:
        """The job's step-to-step noise as the rule sees it: each node's (`_pooled_noise`), widened by the
        noise of the smallest reference a node is compared with (`reference_widening`): the demo's share
        classes of 4 nodes hold each node against the median of 3 peers, noisier than the 7 others of the
        whole job, and the window calibrated on those opened a false episode in 30 healthy minutes at
        threshold 1.2. Cached until the next step."""
        if self._noise is None:
            own = self._pooled_noise()
            self._noise = (None if own is None else own * self._widening(),)
        return self._noise[0]

    def _widening(self) -> float:
        """The largest `reference_widening` of a node measured now: the smallest share class that serves
        as some node's reference, against the whole job."""
        sizes = Counter(share_classes({node: self.share(node) for node in self._levels}).values())
        job_peers = len(self._levels) - 1
        peers = [size - 1 for size in sizes.values() if size - 1 >= MIN_CLASS_PEERS]
        return max((reference_widening(k, job_peers) for k in peers), default=1.0)

    def _pooled_noise(self) -> float | None:
        """The job's step-to-step noise as the rule sees it (None before nodes have enough steps): each
        node's robust spread of its compute relative to the job's median at the same step (a stall of the
        whole host moves every node alike, and the rule compares nodes over the same steps), pooled as
        the median over at most `NOISE_NODES` nodes, evenly picked (more adds nothing but cost on a job of
        thousands)."""
        nodes = list(self._levels.items())
        picked = nodes[:: max(1, len(nodes) // NOISE_NODES)]
        by_step: dict[int, list[float]] = {}
        for node, samples in picked:
            share = self.share(node)
            for step, level in samples:
                by_step.setdefault(step, []).append(level / share)
        typical = {step: median(values) for step, values in by_step.items() if len(values) > 1}
        spreads = []
        for node, samples in picked:
            share = self.share(node)
            ratios = [level / share / typical[step] for step, level in samples if typical.get(step, 0) > 0]
            spread = relative_spread(ratios)
            if spread is not None:
                spreads.append(spread)
        return median(spreads) if spreads else None

    def new_generation(self, generation: int, shares: Mapping[int, float]) -> None:
        """The published plan changed: levels measured under the old work no longer compare."""
        if generation != self.generation:
            self.generation = generation
            self.shares = dict(shares)
            self._levels.clear()
            self._step_s.clear()
            self._walls.clear()
            self._window = None
            self._noise = None

    def share(self, node: int) -> float:
        """The node's planned share of the work, as its levels measure it: 1.0 where a level is the step's
        wall (the synthetic loop sleeps the plan's step time on every node, whatever its stages; divided
        by a share, the nodes with lighter stages looked 1.19x slow on `examples/local-cpu.yaml` and the
        sweep opened an episode on them at start-up that nothing ended)."""
        return 1.0 if node in self._walls else self.shares.get(node, 1.0)

    @property
    def step_s(self) -> float:
        """The job's median step time (wall, all nodes) in this generation; 0 before any step."""
        return median(self._step_s) if self._step_s else 0.0

    def observe(self, record: IterationRecord) -> None:
        self.steps[record.node] = max(record.step, self.steps.get(record.node, -1))
        if record.generation != self.generation:
            return
        self._step_s.append(record.seconds)
        level = record.compute_s if record.compute_s is not None else record.seconds
        if record.compute_s is None:
            self._walls.add(record.node)
        if level <= 0:
            return  # a step that was all communication says nothing about compute speed
        samples = self._levels.get(record.node)
        if samples is None:
            samples = self._levels[record.node] = deque(maxlen=max(self.fixed_window or 0, MAX_WINDOW))
        samples.append((record.step, level))
        self._window = None
        self._noise = None

    def recent(self, node: int) -> list[tuple[int, float]]:
        """The node's last `window` (step, compute) samples of this generation."""
        samples = self._levels.get(node, ())
        window = self.window
        return list(samples)[-window:] if len(samples) > window else list(samples)

    def level(self, node: int, since_step: int = 0, until_step: int | None = None) -> float | None:
        """The node's recent level (its last `window` steps, those >= since_step) divided by its planned
        share; None with too few samples. With `until_step`, the last `window` of the steps kept in
        [since_step, until_step] instead: a level as it was then."""
        if until_step is None:
            samples = [level for step, level in self.recent(node) if step >= since_step]
        else:
            kept = [level for step, level in self._levels.get(node, ()) if since_step <= step <= until_step]
            samples = kept[-self.window :]
        if len(samples) < self.min_samples:
            return None
        return median(samples) / self.share(node)

    def straggler(self, node: int, since_step: int = 0) -> bool | None:
        """True/False by the rule; None when the node itself has too few samples to judge. `since_step`
        (a report's onset) keeps the steps from before its change out of its level."""
        return self.judge({node: since_step})[node]

    def judge(self, candidates: Mapping[int, int]) -> dict[int, bool | None]:
        """`straggler` for many nodes (node -> since_step) at once: the other nodes' levels are computed
        once per distinct onset, so a machine-wide slowdown that every node reports costs O(N log N) per
        onset, not O(N^2)."""
        return {node: None if found is None else found[0] for node, found in self._judge(candidates).items()}

    def straggler_then(self, node: int, first_step: int, last_step: int) -> bool | None:
        """`straggler` on the steps [first_step, last_step] only, the other nodes' over the same steps
        (None when the node has too few of them kept)."""
        found = self._judge({node: first_step}, until=last_step).get(node)
        return None if found is None else found[0]

    def decisive(self, node: int, first_step: int, last_step: int) -> bool:
        """Whether the node's steps in [first_step, last_step] alone find it a straggler as surely as a
        full window finds one at the threshold: at least `MIN_WINDOW` of them, the rule's verdict on them,
        and a level over the others' that noise alone reaches as rarely, i.e. `_Z` standard errors of a
        median of that many steps above 1 (`window_for` of that level is no longer than they are). A node
        twice as slow on a host of 32% noise is decided on 4 steps where a 1.2x one needs 26. Never with a
        `fixed_window` (the rule as configured) or before the job's noise is known."""
        noise = self.noise
        if self.fixed_window is not None or noise is None:
            return False
        count = sum(first_step <= step <= last_step for step, _ in self._levels.get(node, ()))
        if count < MIN_WINDOW:
            return False
        found = self._judge({node: first_step}, until=last_step).get(node)
        if found is None or not found[0] or not found[2] > 0:
            return False
        _, own, reference = found
        return beyond_noise(own / reference, noise, min(count, self.window))

    def why_not(self, node: int, since_step: int = 0) -> str:
        """Which part of the rule a node that is no straggler fails, in words for its dismissal."""
        found = self._judge({node: since_step}).get(node)
        if found is None:
            return "too few steps to judge"
        _, own, reference = found
        ratio = own / reference if reference > 0 else 1.0
        # In the user's words: a "level" is the node's compute time per planned share of the work.
        what = f"its compute per share of the work took {ratio:.2f}x the other nodes' median"
        if ratio <= self.threshold:
            return f"{what}, not over the {self.threshold:g}x threshold"
        excess = self._excess_s(node, own, reference)
        return (
            f"{what}, but the {excess:.3g} s it adds to a step is under {self.threshold - 1:g} of the job's "
            f"{self.step_s:.3g} s step"
        )

    def measures(self, node: int) -> bool:
        """Whether the node has steps in this generation's levels (parked nodes' probe steps are not fed)."""
        return bool(self._levels.get(node))

    def ratios(self, candidates: Mapping[int, int]) -> dict[int, float | None]:
        """Each node's level over the other nodes' median (both per planned share; node -> since_step as in
        `judge`): its speed against theirs, whatever its work costs the job. None with too few samples; 1.0
        with no other node to compare with."""
        return {
            node: None if found is None else found[1] / found[2]
            for node, found in self._judge(candidates).items()
        }

    def sweep(self, skip: Iterable[int] = ()) -> dict[int, tuple[int, float, float]]:
        """Stragglers by the rule over each node's whole window, without any report: node -> (the window's
        first step, its level, the other nodes' median level), levels per planned share. Only nodes with a
        full window are judged. The operator's catch-all for a slowdown that the agents' own detectors
        missed: a change inside their jitter band, or one that came as a drift."""
        skipped = set(skip)
        window = self.window
        full = {
            node: samples[-window][0]
            for node, samples in self._levels.items()
            if node not in skipped and len(samples) >= window
        }
        found = self._judge(dict.fromkeys(full, 0))
        return {
            node: (full[node], verdict[1], verdict[2])
            for node, verdict in found.items()
            if verdict is not None and verdict[0] and verdict[1] > verdict[2]  # not a lone node
        }

    def _judge(
        self, candidates: Mapping[int, int], until: int | None = None
    ) -> dict[int, tuple[bool, float, float] | None]:
        """The rule for each node: (straggler, its level, the others' median), or None with too few
        samples (`until`: on the steps up to it, as in `level`). A one-node job has no others: its
        reference is its own level and it counts as slow."""
        verdicts: dict[int, tuple[bool, float, float] | None] = {}
        by_onset: dict[int, list[int]] = {}
        for node, since in candidates.items():
            by_onset.setdefault(since, []).append(node)
        for since, nodes in by_onset.items():
            # The others over the same steps where they have them: a change that hit every node at the
            # onset (machine-wide) then shows on both sides of the comparison.
            everyone = {
                other: value
                for other in self._levels
                if (value := self._level_or_recent(other, since, until)) is not None
            }
            ordered = sorted(everyone.values())
            classes = share_classes({other: self.share(other) for other in everyone})
            by_class: dict[int, list[float]] = {}
            for other, value in everyone.items():
                by_class.setdefault(classes[other], []).append(value)
            for values in by_class.values():
                values.sort()
            step_s = self.step_s
            for node in nodes:
                own = self.level(node, since, until)
                if own is None:
                    verdicts[node] = None
                    continue
                # Its own class when it has the peers for it (see the module's docstring), else everyone.
                peers = by_class.get(classes.get(node, -1), [])
                if len(peers) - (node in everyone) < MIN_CLASS_PEERS:
                    peers = ordered
                skip = bisect_left(peers, everyone[node]) if node in everyone else None
                reference = _median_without(peers, skip)
                # Nothing to compare with (a one-node job): the agent's own before/after ratio stands.
                if reference is None:
                    verdicts[node] = (True, own, own)
                    continue
                slow = (
                    own > self.threshold * reference
                    and self._excess_s(node, own, reference) >= (self.threshold - 1) * step_s
                )
                verdicts[node] = (slow, own, reference)
        return verdicts

    def _excess_s(self, node: int, own: float, reference: float) -> float:
        """Seconds per step the node's compute exceeds the others' level by (levels are per planned share)."""
        return (own - reference) * self.share(node)

    def _level_or_recent(self, node: int, since_step: int, until_step: int | None = None) -> float | None:
        level = self.level(node, since_step, until_step)
        return level if level is not None else self.level(node)

    def forget(self, nodes: Iterable[int]) -> None:
        for node in nodes:
            self._levels.pop(node, None)
            self.steps.pop(node, None)


def _median_without(ordered: list[float], skip: int | None) -> float | None:
    """Median of a sorted list with the element at index `skip` left out (None: none left out), in O(1)."""
    size = len(ordered) - (skip is not None)
    if size <= 0:
        return None

    def at(index: int) -> float:
        return ordered[index + 1] if skip is not None and index >= skip else ordered[index]

    middle = size // 2
    return at(middle) if size % 2 else (at(middle - 1) + at(middle)) / 2


def group_nodes(label: str) -> tuple[int, ...]:
    """Node ids of a profile group label ('0,1,2' or '0,1@1'); () for a label that does not parse."""
    members = label.split("@", 1)[0]
    try:
        nodes = tuple(sorted({int(part) for part in members.split(",") if part.strip()}))
    except ValueError:
        return ()
    return nodes if all(node >= 0 for node in nodes) else ()


def communication_suspects(
    profiles: Mapping[int, ProfileRecord], factor: float | None = None
) -> dict[str, tuple[int, ...]]:
    """Suspicious groups (label -> nodes) from the latest profile of each node.

    A group's time is the median over the members that profiled it (all of them wait for a slow transfer);
    groups are compared within their class (collective or point-to-point, and size)."""
    seen: dict[str, list[float]] = {}
    for record in profiles.values():
        for label, seconds in record.groups.items():
            seen.setdefault(label, []).append(seconds)
    classes: dict[tuple[bool, int], list[tuple[str, float]]] = {}
    for label, values in seen.items():
        nodes = group_nodes(label)
        if nodes:
            classes.setdefault(("@" in label, len(nodes)), []).append((label, median(values)))
    found: dict[str, tuple[int, ...]] = {}
    for groups in classes.values():
        if len(groups) < 2:
            continue  # a group alone has no median to exceed
        profiled = [GroupProfile(index, 0.0, seconds) for index, (_, seconds) in enumerate(groups)]
        suspects = suspicious_groups(profiled) if factor is None else suspicious_groups(profiled, factor)
        for index in suspects.communication:
            label = groups[index][0]
            found[label] = group_nodes(label)
    return found
