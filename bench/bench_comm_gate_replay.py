"""Replay a recorded run's communication reports through the gate a validation pass now waits for, offline.

A communication report asks for a validation pass once the reporter's steps since its onset clear their
own noise (`operator._failslow_validation.communication_holds`); before, every one at or over the threshold
asked for one at once. This script takes the JSON that `bench_failslow_e2e.py --json F` writes (its
`iterations`: every node's steps with their walls; its `slow_reports`; its `episodes`) and, for every
communication report at or over the run's threshold, feeds the gate the reporter's steps as the operator
keeps them (its last `KEPT_STEPS`), one step at a time from the report's own step on, until the gate
decides: **asked** (a pass), **dismissed** (back under the bar), **host** (its steps bore it out, but the
nodes' compute rose with them: dismissed as the host's, `compute_explains`), or **expired** (still
undecided after `--ttl-steps`, as the candidate's time to live would end it). The episodes the run opened
on communication reports are matched to their reports (node and onset) and their outcome printed too.

The nodes' compute is each node's of the report's generation; the operator keeps none during an episode
(a report then asks for a pass as before) and none of parked or drained nodes, which this replay does not
know apart: its `host` counts are for reports outside episodes. It judges every step where the live
operator judges every pass (0.25 s, one or two steps on the demo), so a
report the live gate would ask for is asked for here as well: the asked counts are a ceiling. Pending
candidates and one pass at a time are not modelled: every report is judged on its own.

Usage: .venv/bin/python bench/bench_comm_gate_replay.py [--later STEPS] RUN.json [RUN.json ...]
"""

from __future__ import annotations

import argparse
import json
import re
from bisect import bisect_right
from collections import Counter
from pathlib import Path
from typing import Any

from resilientjob.operator._failslow_clock import KEPT_STEPS
from resilientjob.operator._failslow_job import HISTORY, compute_rise
from resilientjob.operator._failslow_validation import communication_holds, compute_explains
from resilientjob.protocol.messages import SlowKind, SlowReport

EPISODE = re.compile(r"NodeSlow: node (\d+) is [\d.]+x slower \(communication\).* since step (\d+)")


def outcome(
    report: SlowReport,
    walls: list[tuple[int, float]],
    computes: dict[int, list[tuple[int, float]]],
    threshold: float,
    ttl_steps: int,
    later: int = 0,
) -> str:
    """asked / dismissed / host / expired, judging the reporter's kept steps as each of its steps comes:
    `host` where the steps bore the report out but the nodes' compute rose with them
    (`compute_explains`, on every node's compute of the report's generation up to that step, as the
    operator keeps it)."""
    steps = [step for step, _ in walls]
    first = bisect_right(steps, report.step)
    for end in range(first, min(len(walls), first + ttl_steps) + 1):
        kept = walls[max(0, end - KEPT_STEPS) : end]
        holds = communication_holds(report, kept, threshold)
        if holds is None:
            continue
        if not holds:
            return "dismissed"
        if later:  # the host rule judged `later` steps after the gate first decided (the gate again then)
            waited = min(len(walls), end + later)
            kept = walls[max(0, waited - KEPT_STEPS) : waited]
            if not communication_holds(report, kept, threshold):
                return "dismissed"
        now = kept[-1][0] if kept else report.step
        seen = {node: _upto(samples, now) for node, samples in computes.items()}
        rise = compute_rise(seen, report.onset_step, now)
        return "host" if compute_explains(report, kept, rise) is not None else "asked"
    return "expired"


def _upto(samples: list[tuple[int, float]], step: int) -> list[tuple[int, float]]:
    """A node's compute through `step`, its last `HISTORY` (what the job-level trigger keeps)."""
    end = bisect_right([s for s, _ in samples], step)
    return samples[max(0, end - HISTORY) : end]


def replay(path: Path, ttl_steps: int, later: int = 0) -> None:
    run: dict[str, Any] = json.loads(path.read_text())
    threshold = float(run["threshold"])
    walls: dict[int, list[tuple[int, float]]] = {}
    computes: dict[int, dict[int, list[tuple[int, float]]]] = {}  # by generation, as the trigger keeps them
    for node, generation, step, seconds, compute, *_ in run["iterations"]:
        walls.setdefault(int(node), []).append((int(step), float(seconds)))
        if compute:
            computes.setdefault(int(generation), {}).setdefault(int(node), []).append(
                (int(step), float(compute))
            )
    for kept in [*walls.values(), *(samples for nodes in computes.values() for samples in nodes.values())]:
        kept.sort()
    reports = [SlowReport.model_validate(raw) for raw in run["slow_reports"]]
    wanted = [
        r for r in reports if r.kind is SlowKind.COMMUNICATION and not r.recovered and r.slowdown >= threshold
    ]
    judged = {
        (r.node, r.onset_step): outcome(
            r, walls.get(r.node, []), computes.get(r.generation, {}), threshold, ttl_steps, later
        )
        for r in wanted
    }
    counts = Counter(judged.values())
    print(f"{path.name}: threshold {threshold:g}, {run['steps']:,} steps")
    print(
        f"  communication reports at or over the threshold: {len(wanted)} (each asked for a pass before); "
        f"now asked {counts['asked']}, dismissed {counts['dismissed']} (back under the bar) and "
        f"{counts['host']} (the nodes' compute rose with it: the host), expired {counts['expired']}"
    )
    for episode in run.get("episodes", []):
        found = EPISODE.search(episode["finding"])
        if found is None:
            continue
        key = (int(found.group(1)), int(found.group(2)))
        slowed = episode.get("job_slowed_by")
        job = f"the job {slowed:.2f}x at its onset" if isinstance(slowed, float) else "the job not measured"
        print(f"  episode on node {key[0]}'s report (onset {key[1]}, {job}): {judged.get(key, 'no report')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument(
        "--ttl-steps", type=int, default=400, help="steps a report may stay undecided (60 s of 0.15 s steps)"
    )
    parser.add_argument(
        "--later",
        type=int,
        default=0,
        help="judge the host rule this many steps after the gate first decides (what waiting would win)",
    )
    args = parser.parse_args()
    for path in args.runs:
        replay(path, args.ttl_steps, args.later)


if __name__ == "__main__":
    main()
