"""Falcon's adaptive multi-level mitigation (Algorithm 1): a multi-level ski-rental controller.

A fail-slow's duration cannot be predicted (tens of seconds to hours), so the controller rents before it buys:
it starts with S1 (ignore), accumulates the time lost to slow iterations, sum of (t_slow - t_healthy), and
applies the next strategy when that loss reaches the strategy's one-off overhead. Candidates are the
strategies that can help with the root cause (Falcon Table 3: S2 only helps slow computation), sorted by
overhead. The loss is cumulative from the onset (ski-rental compares all rent paid so far with the price of
buying), and keeps counting after a mitigation because a mitigated fail-slow may still cost time. A recovery
change point ends the episode and returns to S1, undoing the mitigations.

S4 is ResilientJob's fail-stop path: the slow nodes are treated as failed and the adaptive planner replans
without them (peer-to-peer layer copies, no checkpoint restart). The decision names the nodes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ..errors import PlannerError
from ._events import ChangeEvent, ChangeKind, check_time
from ._localize import RootCause


class Strategy(StrEnum):
    """Falcon's four mitigation levels."""

    IGNORE = "ignore"  # S1: wait for the fail-slow to pass
    MICROBATCH = "microbatch"  # S2: move micro-batches off slow data-parallel groups
    TOPOLOGY = "topology"  # S3: swap nodes off congested links, consolidate stragglers
    REPLACE = "replace"  # S4: treat the slow nodes as failed; the fail-stop planner replans without them


EFFECTIVE: dict[Strategy, frozenset[RootCause]] = {
    Strategy.MICROBATCH: frozenset({RootCause.COMPUTE}),
    Strategy.TOPOLOGY: frozenset({RootCause.COMPUTE, RootCause.COMMUNICATION}),
    Strategy.REPLACE: frozenset({RootCause.COMPUTE, RootCause.COMMUNICATION}),
}
"""Which root causes each strategy mitigates (Falcon Table 3)."""


@dataclass(frozen=True, slots=True)
class MitigationCosts:
    """One-off overhead of each strategy in seconds of lost training, the ski-rental "purchase price"."""

    microbatch_s: float = 2.0
    """S2: solving takes < 1 ms (bench_rebalance); the cost is about one iteration run at the old split while
    the new one is broadcast, plus re-profiling; Falcon measured "a few seconds" with its QP solver."""
    topology_s: float = 45.0
    """S3: pause, swap weights peer-to-peer between moved nodes, resume. Falcon Fig. 19: under a minute."""
    replace_s: float = 120.0
    """S4: a fail-stop replan: rebuild process groups (TransitionCosts.restart_s, 15 s), copy the missing
    layers, and run on fewer nodes; Falcon's checkpoint-restart took tens of minutes."""

    def __post_init__(self) -> None:
        for name in ("microbatch_s", "topology_s", "replace_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise PlannerError(name, f"must be finite and >= 0, got {value}")

    def overhead(self, strategy: Strategy) -> float:
        return {
            Strategy.IGNORE: 0.0,
            Strategy.MICROBATCH: self.microbatch_s,
            Strategy.TOPOLOGY: self.topology_s,
            Strategy.REPLACE: self.replace_s,
        }[strategy]


@dataclass(frozen=True, slots=True)
class Decision:
    """Apply `strategy` now. `nodes` are the localised slow nodes (those S4 hands to the fail-stop path)."""

    strategy: Strategy
    loss_s: float
    overhead_s: float
    nodes: tuple[int, ...] = ()
    reason: str = ""


@dataclass(slots=True)
class _Episode:
    healthy_s: float
    causes: set[RootCause]
    nodes: tuple[int, ...]
    loss_s: float = 0.0
    applied: list[Strategy] = field(default_factory=list)


class MitigationController:
    """Algorithm 1 for one job. Each iteration: pass a change event from the detector (if any) to
    `on_change`, then the iteration's time to `on_iteration`; both may answer with a decision to apply."""

    def __init__(self, costs: MitigationCosts | None = None) -> None:
        self.costs = costs or MitigationCosts()
        self._episode: _Episode | None = None

    @property
    def active(self) -> bool:
        """Whether a fail-slow is in progress."""
        return self._episode is not None

    def snapshot(self) -> dict[str, object] | None:
        """The episode in progress as plain JSON-able data (None when healthy), for `resume` in another
        process: an operator restarted mid-episode goes on at the same strategy with the loss it had."""
        episode = self._episode
        if episode is None:
            return None
        return {
            "healthy_s": episode.healthy_s,
            "causes": sorted(str(cause) for cause in episode.causes),
            "nodes": list(episode.nodes),
            "loss_s": episode.loss_s,
            "applied": [str(strategy) for strategy in episode.applied],
        }

    def resume(self, snapshot: Mapping[str, Any] | None) -> None:
        """Continue the episode `snapshot()` described (None: healthy). Raises PlannerError if malformed."""
        if snapshot is None:
            self._episode = None
            return
        try:
            self._episode = _Episode(
                healthy_s=float(snapshot["healthy_s"]),
                causes={RootCause(cause) for cause in snapshot["causes"]},
                nodes=tuple(int(node) for node in snapshot["nodes"]),
                loss_s=float(snapshot["loss_s"]),
                applied=[Strategy(strategy) for strategy in snapshot["applied"]],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlannerError("snapshot", f"not an episode snapshot: {exc!r}") from None

    @property
    def healthy_s(self) -> float:
        """The episode's healthy iteration time (0 when healthy)."""
        return self._episode.healthy_s if self._episode else 0.0

    @property
    def loss_s(self) -> float:
        return self._episode.loss_s if self._episode else 0.0

    @property
    def applied(self) -> tuple[Strategy, ...]:
        return tuple(self._episode.applied) if self._episode else ()

    def candidates(self) -> list[Strategy]:
        """Strategies still to try, cheapest first; all of them while the root cause is unknown."""
        if self._episode is None:
            return []
        causes = self._episode.causes or set(RootCause)
        useful = [s for s, fixes in EFFECTIVE.items() if fixes & causes and s not in self._episode.applied]
        return sorted(useful, key=lambda s: (self.costs.overhead(s), list(Strategy).index(s)))

    def on_change(self, event: ChangeEvent) -> Decision | None:
        """A verified change point. A slowdown opens an episode at S1 (a further slowdown, a ladder's next
        rung, keeps it); a recovery closes it and returns to S1."""
        if event.kind is ChangeKind.RECOVERY:
            if self._episode is None:
                return None
            episode, self._episode = self._episode, None
            return Decision(
                Strategy.IGNORE, episode.loss_s, 0.0, episode.nodes, "recovered: undo mitigations, back to S1"
            )
        # Slow iterations before the detecting one; the caller feeds that one and later ones to on_iteration.
        slow_so_far = event.detected_at - event.index
        if self._episode is None:
            self._episode = _Episode(healthy_s=event.before_s, causes=set(), nodes=())
            self._episode.loss_s = slow_so_far * max(0.0, event.after_s - event.before_s)
            return Decision(Strategy.IGNORE, self._episode.loss_s, 0.0, (), "fail-slow detected: S1 first")
        return None

    def localized(self, causes: tuple[RootCause, ...], nodes: tuple[int, ...] = ()) -> None:
        """Profiling and validation found the root cause(s) and the slow nodes of the current episode.

        A slow node found after S2 was applied makes S2 pending again: the micro-batches are balanced anew
        with it, the cheapest answer, before any rung the ladder has not tried (a host's noise opened an
        episode on one node, S2 answered it, and a real x4 straggler found later got no S2 of its own: the
        next rungs declined, and the job ran slowed to the end)."""
        episode = self._episode
        if episode is None:
            raise PlannerError("episode", "no fail-slow in progress to attach a root cause to")
        episode.causes.update(causes)
        added = set(nodes) - set(episode.nodes)
        episode.nodes = tuple(sorted(set(episode.nodes) | set(nodes)))
        if added and Strategy.MICROBATCH in episode.applied:
            episode.applied.remove(Strategy.MICROBATCH)

    def on_iteration(self, seconds: float) -> Decision | None:
        """One more iteration: add its excess over the healthy time; escalate when the loss pays for it."""
        value = check_time(seconds)
        episode = self._episode
        if episode is None:
            return None
        episode.loss_s += max(0.0, value - episode.healthy_s)
        pending = self.candidates()
        if not pending or episode.loss_s < self.costs.overhead(pending[0]):
            return None
        strategy = pending[0]
        episode.applied.append(strategy)
        overhead = self.costs.overhead(strategy)
        return Decision(
            strategy,
            episode.loss_s,
            overhead,
            episode.nodes,
            f"lost {episode.loss_s:.1f} s to slow iterations >= {strategy} overhead {overhead:.1f} s",
        )
