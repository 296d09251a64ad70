"""Replay recorded fail-slow runs through the operator's real detection, offline: how soon each straggler
window would have opened an episode on a slowed run, and how many episodes it would have opened on a
healthy one.

Input: the JSON files `bench_failslow_e2e.py --json F` writes (their `iterations`: every node's steps with
compute times and send times, and their agents' SlowReports). Every record and report goes, in the order of
its send time and with that time as the clock, into a fresh `FailSlowTracker` of the run's threshold and
`minDurationS`, its `StragglerGate` window set to each `--windows` value (0: sized from the noise, as the
operator does); `tick()` runs after every record, as the operator's telemetry pass does. An opened episode
is counted and the tracker starts over (the live operator would mitigate, then close the episode).

The trace's first generation is replayed only (a mitigation changes every node's work). Planned shares are
the nodes' median compute over the first `--share-steps` steps relative to the median over all nodes (the
live operator computes them from the plan and the profile: a node persistently slower than its plan says
is hidden here, so the healthy counts are a floor).

`--redetect` replaces the recorded agents' reports with those the agents' detection as committed makes
on the same steps (`agent.telemetry.StepWatch`, fed each node's step and compute times in send order):
how a change in that detection would have done on the recorded runs.

Usage: .venv/bin/python bench/bench_failslow_replay.py --healthy H.json ... --slowed S.json ... [--redetect]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resilientjob.agent.telemetry import StepWatch
from resilientjob.operator._failslow import FailSlowTracker, FindingKind
from resilientjob.operator.api import FailSlowSpec
from resilientjob.protocol.messages import IterationRecord, SlowReport


@dataclass(frozen=True, slots=True)
class Opened:
    """An episode the replay opened: at which step (the reporting node's latest), on which nodes."""

    step: int
    nodes: tuple[int, ...]
    why: str


def first_generation(iterations: list[list[Any]]) -> list[IterationRecord]:
    """The records of the trace's first generation with compute times, in send order."""
    generation = min(row[1] for row in iterations)
    records = [
        IterationRecord(
            node=node, generation=0, step=step, seconds=seconds, samples=1, sent_at=sent_at, compute_s=compute
        )
        for node, g, step, seconds, compute, sent_at in iterations
        if g == generation and compute is not None
    ]
    return sorted(records, key=lambda record: record.sent_at)


def redetected_reports(records: list[IterationRecord]) -> list[SlowReport]:
    """The reports the agents' detection makes on `records` (one role per node: the first generation's)."""
    watches: dict[int, StepWatch] = {}
    reports = []
    for record in records:
        watch = watches.setdefault(record.node, StepWatch())
        change = watch.feed(record.step, 0, record.seconds, record.compute_s)
        if change is None:
            continue
        reports.append(change.report(record.node, 0, record.step, record.sent_at))
    return reports


def empirical_shares(records: list[IterationRecord], steps: int) -> dict[int, float]:
    first = min(record.step for record in records)
    by_node: dict[int, list[float]] = {}
    for record in records:
        if record.step < first + steps and record.compute_s:
            by_node.setdefault(record.node, []).append(record.compute_s)
    levels = {node: statistics.median(values) for node, values in by_node.items()}
    middle = statistics.median(levels.values())
    return {node: level / middle for node, level in levels.items()}


def replay(
    records: list[IterationRecord],
    reports: list[SlowReport],
    spec: FailSlowSpec,
    window: int,
    shares: dict[int, float],
) -> list[Opened]:
    """Every episode the operator's detection opens on `records` (and the agents' `reports`)."""

    def fresh() -> FailSlowTracker:
        tracker = FailSlowTracker(spec)
        tracker.gate.fixed_window = window or None
        tracker.gate.new_generation(0, shares)
        return tracker

    tracker = fresh()
    pending = sorted(
        (report.model_copy(update={"generation": 0}) for report in reports if not report.recovered),
        key=lambda report: report.detected_at,
    )
    opened: list[Opened] = []
    for record in records:
        while pending and pending[0].detected_at <= record.sent_at:
            report = pending.pop(0)
            tracker.report(report, now=report.detected_at)
        tracker.observe(record, now=record.sent_at)
        tracker.tick(now=record.sent_at)
        found = [f for f in tracker.findings if f.kind is FindingKind.SLOW]
        if found:
            nodes = tuple(sorted({node for finding in found for node in finding.nodes}))
            opened.append(Opened(record.step, nodes, found[0].message))
            tracker = fresh()
    return opened


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--healthy", type=Path, nargs="*", default=[])
    parser.add_argument("--slowed", type=Path, nargs="*", default=[])
    parser.add_argument(
        "--windows", type=int, nargs="+", default=[0, 4, 8, 16], help="0: sized from the noise (the default)"
    )
    parser.add_argument(
        "--threshold",
        type=float,
        help="slowdownThreshold (default: a healthy run's own; 1.2 for slowed runs)",
    )
    parser.add_argument("--min-duration", type=float, default=1.0, help="minDurationS (the demo's: 1)")
    parser.add_argument("--share-steps", type=int, default=100)
    parser.add_argument(
        "--redetect", action="store_true", help="the agents' reports from their detection as committed"
    )
    args = parser.parse_args()
    runs = [(path, "healthy", json.loads(path.read_text())) for path in args.healthy]
    runs += [(path, "slowed", json.loads(path.read_text())) for path in args.slowed]
    for path, kind, result in runs:
        records = first_generation(result["iterations"])
        span = (records[0].sent_at, records[-1].sent_at)
        raw = result.get("slow_reports") or result.get("reports") or []
        reports = [SlowReport.model_validate(r) for r in raw if span[0] <= r["detected_at"] <= span[1]]
        if args.redetect:
            reports = redetected_reports(records)
        shares = empirical_shares(records, args.share_steps)
        steps = len({record.step for record in records})
        threshold = args.threshold or (1.2 if kind == "slowed" else result.get("threshold", 1.5))
        spec = FailSlowSpec(slowdown_threshold=threshold, min_duration_s=args.min_duration)
        head = f"{path.name}: {kind}, {steps} steps, threshold {spec.slowdown_threshold}"
        if kind == "slowed":
            head += f", node {result['slow_node']} x{result['factor']} from step {result['inject_step']}"
        slow = sum(not report.recovered for report in reports)
        print(f"{head}; {slow} slow reports ({'redetected' if args.redetect else 'recorded'})")
        for window in args.windows:
            opened = replay(records, reports, spec, window, shares)
            name = f"window {window:2d}" if window else "noise-sized"
            if kind == "healthy":
                where = ", ".join(f"step {o.step} nodes {list(o.nodes)}" for o in opened)
                print(f"  {name}: {len(opened)} episodes{': ' + where if where else ''}")
                continue
            inject, node = result["inject_step"], result["slow_node"]
            hits = [o for o in opened if o.step >= inject and node in o.nodes]
            early = [o for o in opened if o not in hits]
            delay = f"{hits[0].step - inject} iterations" if hits else "not detected"
            print(f"  {name}: episode {delay} after the order; {len(early)} other episodes")


if __name__ == "__main__":
    main()
