#!/usr/bin/env python3
"""The operator's fail-slow localisation rule (`operator._straggler` + `FailSlowTracker`): false alarms on
noise against the report-only rule it replaces, detection of real stragglers, and the cost of one judgement
pass when every node of a large job reports (a machine-wide slowdown).

Scenario per trial (8 nodes, 0.1 s compute per step, one step per second of tracker clock, iid Gaussian
noise per step): 20 healthy steps; then every 12 steps for 72 steps every node's detector "reports" a 1.3x
slowdown (an extreme stand-in for the noise reports of an overloaded machine; `make demo` saw six in a few
minutes). With a straggler, node 5 runs at the given factor from step 20. A trial is a false alarm when an
episode opens with no straggler, a detection when it opens on node 5 (steps from onset to opening reported).
The report-only rule (before this change) opens an episode for the first report above the threshold; it
runs on the very same trace and reports in each trial (its outcome is measured, not assumed).

Each row runs twice on the same traces: with the operator's noise-sized level window and with the fixed
16-step window it replaced.

Run: .venv/bin/python bench/bench_straggler_gate.py [--quick]
"""

from __future__ import annotations

import random
import statistics
import sys
import time

from resilientjob.operator._failslow import FailSlowTracker
from resilientjob.operator.api import FailSlowSpec
from resilientjob.protocol.messages import IterationRecord, SlowReport

NODES = 8
BASE = 0.1


def trial(
    seed: int, noise: float, straggler: float | None, window: int | None = None
) -> tuple[int | None, int | None]:
    """For the tracker (levels over `window` steps; None: sized from the noise, as the operator does) and
    for the report-only rule on the same trace: steps from the straggler's onset (step 20) to the episode
    opening; -1 for an episode on a node that is no straggler; None when none opened."""
    tracker = FailSlowTracker(FailSlowSpec(slowdown_threshold=1.1, min_duration_s=5.0))
    tracker.gate.fixed_window = window
    tracker.gate.new_generation(0, {})
    rng = random.Random(seed)
    report_only: int | None = None
    gated: int | None = None
    for step in range(1, 93):
        for node in range(NODES):
            factor = straggler if straggler is not None and node == 5 and step > 20 else 1.0
            compute = BASE * factor * max(0.2, 1 + rng.gauss(0, noise))
            tracker.observe(
                IterationRecord(
                    node=node,
                    generation=0,
                    step=step,
                    seconds=compute,
                    samples=1,
                    sent_at=0,
                    compute_s=compute,
                ),
                now=float(step),
            )
        if step > 20 and step % 12 == 9:
            for node in range(NODES):
                slowdown = straggler if straggler is not None and node == 5 else 1.3
                report = SlowReport(
                    node=node,
                    generation=0,
                    step=step,
                    onset_step=step - 4,
                    slowdown=slowdown,
                    baseline_s=BASE,
                    level_s=BASE * slowdown,
                    detected_at=0.0,
                )
                if report_only is None and slowdown >= tracker.spec.slowdown_threshold:
                    report_only = step - 20 if node == 5 and straggler is not None else -1
                tracker.report(report, now=float(step))
        tracker.tick(now=float(step))
        if gated is None and tracker.active:
            gated = step - 20 if set(tracker.slow) == {5} else -1
        if gated is not None and report_only is not None:
            break
    return gated, report_only


def judgement_cost(nodes: int, window: int | None = None) -> float:
    """Seconds for one tick when all `nodes` report a machine-wide 2x slowdown (three distinct onsets)."""
    tracker = FailSlowTracker(FailSlowSpec())
    tracker.gate.fixed_window = window
    tracker.gate.new_generation(0, {})
    rng = random.Random(0)
    for step in range(10):
        for node in range(nodes):
            seconds = 0.2 * (1 + 0.05 * rng.gauss(0, 1))
            tracker.observe(
                IterationRecord(node=node, generation=0, step=step, seconds=seconds, samples=1, sent_at=0)
            )
    for node in range(nodes):
        report = SlowReport(
            node=node,
            generation=0,
            step=9,
            onset_step=5 + node % 3,
            slowdown=2.0,
            baseline_s=0.1,
            level_s=0.2,
            detected_at=0.0,
        )
        tracker.report(report, now=0.0)
    started = time.perf_counter()
    tracker.tick(now=1.0)
    elapsed = time.perf_counter() - started
    if tracker.active:
        raise SystemExit("a machine-wide slowdown opened an episode")
    return elapsed


def main() -> None:
    trials = 50 if "--quick" in sys.argv else 200
    header = ("window", "noise", "straggler", "episodes", "report-only (on 5)", "false/found", "delay steps")
    print("{:>11} {:>6} {:>9} {:>9} {:>18} {:>11} {:>11}".format(*header))
    for noise in (0.05, 0.15, 0.25):
        for straggler in (None, 1.2, 1.5):
            for window in (None, 16):  # the operator's noise-sized window, and the fixed one it replaced
                both = [trial(seed, noise, straggler, window) for seed in range(trials)]
                outcomes = [gated for gated, _ in both]
                opened = sum(o is not None for o in outcomes)
                found = [o for o in outcomes if o is not None and o >= 0] if straggler is not None else []
                old = sum(o is not None for _, o in both)  # the report-only rule, same traces and reports
                old_right = sum(o is not None and o >= 0 for _, o in both)
                label = "-" if straggler is None else f"{straggler}x"
                delay = f"{statistics.median(found):.0f}" if found else "-"
                counted = f"{opened}/{trials} false" if straggler is None else f"{len(found)}/{trials}"
                name = "noise-sized" if window is None else f"{window} steps"
                print(
                    f"{name:>11} {noise:>6} {label:>9} {opened:>5}/{trials} {old:>11}/{trials} "
                    f"({old_right:>3}) {counted:>11} {delay:>11}"
                )
    for nodes in (512, 4096):
        sized, fixed = judgement_cost(nodes), judgement_cost(nodes, 16)
        print(
            f"one judgement pass, {nodes} nodes all reporting: {sized * 1000:.1f} ms with the noise-sized "
            f"window, {fixed * 1000:.1f} ms with a fixed 16-step one"
        )


if __name__ == "__main__":
    main()
