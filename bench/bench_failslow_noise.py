"""False episodes that noise alone opens through the operator's real tracker, fed by the agents' real
detector: eight synthetic workers whose compute varies by Gaussian noise, every step through each node's
`StepWatch` (its reports to the tracker) and the tracker's `tick`, as the operator's telemetry pass does.
An opened episode is counted and the tracker starts over.

Also counts the reports whose first short window decided them (`Candidate.decisive_steps`, where the code
has it): how often the second window had to undo noise.

Usage: .venv/bin/python bench/bench_failslow_noise.py [--noise 0.3 0.45] [--seeds 4] [--steps 3000]
"""

from __future__ import annotations

import argparse
import random

from resilientjob.agent.telemetry import StepWatch
from resilientjob.operator._failslow import FailSlowTracker
from resilientjob.operator.api import FailSlowSpec, StrategyOverheads
from resilientjob.protocol.messages import IterationRecord

NODES = 8


def episodes(noise: float, seed: int, steps: int, threshold: float) -> tuple[int, int]:
    """(episodes opened, first windows decided) on one synthetic job."""
    spec = FailSlowSpec(
        slowdown_threshold=threshold, min_duration_s=1.0, overheads=StrategyOverheads(microbatch_s=1000.0)
    )

    def fresh() -> FailSlowTracker:
        tracker = FailSlowTracker(spec)
        tracker.gate.new_generation(0, {})
        return tracker

    tracker = fresh()
    rng = random.Random(100 + seed)
    watches = {node: StepWatch() for node in range(NODES)}
    opened, decided = 0, set()
    for step in range(1, steps + 1):
        for node in range(NODES):
            compute = 0.05 * max(0.2, 1 + rng.gauss(0, noise))
            record = IterationRecord(
                node=node, generation=0, step=step, seconds=compute + 0.02, samples=1, sent_at=float(step),
                compute_s=compute, communication_s=0.02,
            )  # fmt: skip
            tracker.observe(record, now=float(step))
            change = watches[node].feed(step, 0, record.seconds, compute)
            if change is not None:
                tracker.report(change.report(node, 0, step, float(step)), now=float(step))
        tracker.tick(now=float(step))
        for node, candidate in tracker.candidates.items():
            if getattr(candidate, "decisive_steps", 0) != 0:
                decided.add((node, candidate.report.onset_step))
        if tracker.active:
            opened += 1
            tracker = fresh()
    return opened, len(decided)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--noise", type=float, nargs="+", default=[0.3, 0.45])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--threshold", type=float, default=1.2)
    args = parser.parse_args()
    for noise in args.noise:
        found = [episodes(noise, seed, args.steps, args.threshold) for seed in range(args.seeds)]
        opened = sum(count for count, _ in found)
        decided = sum(count for _, count in found)
        print(
            f"noise {noise:.2f}, threshold {args.threshold}: {opened} episodes in {args.seeds} x "
            f"{args.steps} steps of {NODES} nodes; {decided} reports decided on a first short window"
        )


if __name__ == "__main__":
    main()
