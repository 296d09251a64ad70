"""Fail-slows inside a run, handled by the planner's own detector and Falcon controller.

- Detection: a fail-slow (or its end) is noticed as many iterations later as the real change-point detector
  (`failslow.ChangeDetector`, BOCD + verification) needs: `detection_delay` feeds it a jittered stream of
  iteration times stepping from the old to the new level and counts the iterations until it reports the
  change (`SimCosts.slow_detection_iterations` fixes the count instead). Localisation is taken as exact:
  the controller is told the slow node and the root cause.
- Decisions: `failslow.MitigationController` (Algorithm 1, multi-level ski-rental) gets the change events
  and every slow iteration's time, and answers which strategy to apply. The simulator never feeds
  iterations one event at a time for nothing: it computes how many slow iterations the next strategy's
  overhead needs, lets them pass, then feeds exactly those iterations to the controller.
- Effects: S2 re-splits micro-batches (`_slow`), S3 moves congested links onto pipeline traffic (`_slow`;
  for a compute straggler alone it changes nothing in this model), S4 hands the slow nodes to the fail-stop
  path (the planner's `replan`); the recovery change point lifts S2/S3 and lets S4's nodes join again.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Protocol

import numpy as np

from ..failslow import (
    ChangeDetector,
    ChangeEvent,
    ChangeKind,
    MitigationController,
    MitigationCosts,
    RootCause,
    Strategy,
)
from ..plan import Plan
from ._model import FailSlow, FailSlowKind, SimCosts
from ._slow import SlowState

DETECTOR_JITTER = 0.01  # coefficient of variation of the iteration times fed to the detector
_WARMUP_ITERATIONS = 60
_GIVE_UP_ITERATIONS = 400
_CAUSE = {FailSlowKind.COMPUTE: RootCause.COMPUTE, FailSlowKind.LINK: RootCause.COMMUNICATION}


@lru_cache(maxsize=1024)
def detection_delay(ratio: float) -> int | None:
    """Iterations the change-point detector needs to report a level shift of `ratio` (slow / healthy, or
    healthy / slow for a recovery), or None if it never does (a shift below its 10% verification bar)."""
    detector = ChangeDetector()
    rng = np.random.default_rng(round(ratio * 1000))  # the same stream for the same shift: deterministic
    noise = 1.0 + DETECTOR_JITTER * rng.standard_normal(_WARMUP_ITERATIONS + _GIVE_UP_ITERATIONS)
    for index in range(_WARMUP_ITERATIONS):
        detector.feed(float(noise[index]))
    for extra in range(_GIVE_UP_ITERATIONS):
        event = detector.feed(float(ratio * noise[_WARMUP_ITERATIONS + extra]))
        if event is not None and event.index >= _WARMUP_ITERATIONS - 1:
            return extra + 1
    return None


class CostsOf(Protocol):
    @property
    def costs(self) -> SimCosts: ...


class SimRun(Protocol):
    """What the mitigator reads and changes of one simulated run (the engine's run provides it)."""

    slow: SlowState
    """The fail-slow state in force; the mitigator replaces it as its strategies apply and undo."""

    @property
    def sc(self) -> CostsOf:
        """The scenario (its costs)."""

    @property
    def t(self) -> float:
        """Simulated time now."""

    @property
    def step(self) -> float:
        """Current iteration time (0 while halted)."""

    @property
    def pause_until(self) -> float: ...

    @property
    def plan(self) -> Plan | None: ...

    @property
    def slowdown(self) -> float: ...

    @property
    def alive(self) -> set[int]: ...

    def push(self, time_s: float, priority: int, payload: object) -> None: ...

    def pause(self, seconds: float) -> None: ...

    def refresh_step(self) -> None: ...

    def record_mitigation(self, strategy: str, node: int, pause: float) -> None: ...

    def lose(self, node: int, cause: str) -> None: ...

    def join(self, node: int, cause: str) -> None: ...


class Mitigator:
    """The fail-slow side of one run: detection delays and the job's mitigation controller."""

    def __init__(self, run: SimRun) -> None:
        self.run = run
        costs = run.sc.costs
        self.controller = MitigationController(
            MitigationCosts(microbatch_s=costs.rebalance_s, topology_s=costs.topology_s)
        )
        self.step_before_change = 0.0  # the step time just before the latest change
        self.handed_over: set[int] = set()  # nodes S4 took out; they join again after the recovery
        self._healthy = 0.0  # iteration time before the episode
        self._fed_until = 0.0  # iterations up to this time have been fed to the controller
        self._version = 0
        self._pending_recovery = False

    # ---- events from the run ----------------------------------------------------------------------------
    def before_change(self) -> None:
        """Called before the step time changes: feed the iterations run at the old step, remember it."""
        self.catch_up()
        self.step_before_change = self.run.step

    def started(self, event: FailSlow) -> None:
        before = self.step_before_change
        delay = self._delay(self.run.step / before if before > 0 else 1.0)
        if delay is not None:
            self.run.push(self.run.t + delay, 2, ("detect", event))

    def ended(self, event: FailSlow) -> None:
        if self.run.slow.healthy or self._all_slow_nodes_handed_over():
            before = self.step_before_change
            delay = self._delay(before / self.run.step if self.run.step > 0 else 1.0)
            # A recovery too small to verify is still noticed when the slow node's telemetry clears.
            self.run.push(self.run.t + (delay or 0.0), 2, ("recovered", event))
        self.reschedule()

    def handle(self, kind: str, payload: object) -> None:
        if kind == "detect" and isinstance(payload, FailSlow):
            self._detected(payload)
        elif kind == "recovered" and isinstance(payload, FailSlow):
            self._recovered()
        elif kind == "iterate" and payload == self._version:
            self.catch_up()
            self.reschedule()

    def replanned(self) -> None:
        self.reschedule()

    # ---- the controller ---------------------------------------------------------------------------------
    def _delay(self, ratio: float) -> float | None:
        step = self.run.step if self.run.step > 0 else 1.0
        fixed = self.run.sc.costs.slow_detection_iterations
        if fixed is not None:
            return fixed * step
        if ratio <= 0 or abs(ratio - 1.0) < 1e-9:
            return None
        iterations = detection_delay(round(max(ratio, 1.0 / ratio), 3))
        return None if iterations is None else iterations * step

    def _detected(self, event: FailSlow) -> None:
        run = self.run
        if event.node not in self._active_nodes():
            return  # it ended before anyone noticed
        self.catch_up()
        healthy = run.plan.step_time_s * run.slowdown if run.plan is not None else run.step
        iterations = max(int((run.t - event.time_s) / run.step), 1) if run.step > 0 else 1
        if not self.controller.active:
            self._healthy = healthy
            change = ChangeEvent(
                index=0, kind=ChangeKind.SLOWDOWN, before_s=healthy, after_s=run.step, detected_at=iterations
            )
            self.controller.on_change(change)
        self.controller.localized((_CAUSE[event.kind],), (event.node,))
        self._fed_until = max(self._fed_until, run.t)
        self.reschedule()

    def _recovered(self) -> None:
        run = self.run
        if not self.controller.active or not (run.slow.healthy or self._all_slow_nodes_handed_over()):
            return
        self.catch_up()
        change = ChangeEvent(
            index=0,
            kind=ChangeKind.RECOVERY,
            before_s=max(self.step_before_change, run.step),
            after_s=run.step,
            detected_at=0,
        )
        self.controller.on_change(change)
        slow = run.slow
        if slow.rebalanced or slow.link_moved:
            run.slow = SlowState(slow.compute, slow.link)  # undo S2 and S3 at the next iteration boundary
            run.refresh_step()
        for node in sorted(self.handed_over):
            run.join(node, "rejoin")
        self.handed_over.clear()
        self._version += 1

    def catch_up(self) -> None:
        """Feed the controller the iterations completed since it last heard, and act on its decision."""
        run = self.run
        if not self.controller.active or run.step <= 0:
            self._fed_until = run.t
            return
        start = max(self._fed_until, run.pause_until if run.pause_until <= run.t else run.t)
        iterations = int((run.t - start) / run.step + 1e-9) if run.t > start else 0
        if iterations <= 0:
            return
        self._fed_until = start + iterations * run.step
        for _ in range(iterations):
            decision = self.controller.on_iteration(run.step)
            if decision is not None:
                self._apply(decision.strategy, decision.nodes)
                break
        self._fed_until = max(self._fed_until, run.t)

    def reschedule(self) -> None:
        """Wake up when the controller's accumulated loss will reach the next strategy's overhead."""
        self._version += 1
        run = self.run
        if not self.controller.active or run.step <= 0:
            return
        pending = self.controller.candidates()
        excess = run.step - self._healthy
        if not pending or excess <= 0:
            return
        needed = self.controller.costs.overhead(pending[0]) - self.controller.loss_s
        iterations = max(math.ceil(needed / excess - 1e-9), 1)
        start = max(run.t, run.pause_until)
        run.push(start + iterations * run.step, 2, ("iterate", self._version))

    def _apply(self, strategy: Strategy, nodes: tuple[int, ...]) -> None:
        run = self.run
        slow = run.slow
        if strategy is Strategy.MICROBATCH:
            run.slow = SlowState(slow.compute, slow.link, True, slow.link_moved)
            pause = run.sc.costs.rebalance_s
        elif strategy is Strategy.TOPOLOGY:
            run.slow = SlowState(slow.compute, slow.link, slow.rebalanced, True)
            pause = run.sc.costs.topology_s
        elif strategy is Strategy.REPLACE:
            for node in nodes:
                if node in run.alive:
                    self.handed_over.add(node)
                    run.lose(node, "s4")
            return
        else:
            return
        run.pause(pause)
        run.refresh_step()
        run.record_mitigation(
            "s2" if strategy is Strategy.MICROBATCH else "s3", min(nodes, default=-1), pause
        )

    def _active_nodes(self) -> set[int]:
        return set(self.run.slow.compute) | set(self.run.slow.link)

    def _all_slow_nodes_handed_over(self) -> bool:
        active = self._active_nodes()
        return bool(active) and active <= self.handed_over
