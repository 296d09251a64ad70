#!/usr/bin/env python3
"""Start-up import cost, side by side with what was loaded before 2026-12-06:
- a pod's agent, before its first heartbeat (`_bridge.preload`, which its forked workers inherit), against
  the same plus the tensor-parallel and checkpoint modules (`torch.distributed.checkpoint`, which loads
  `torch.distributed.tensor`) and `scipy.optimize`, which a job without checkpoints or tensor parallelism
  no longer loads;
- an `rjob` command's imports (`rjob local logs` and the like: the planner package), against the same plus
  `scipy.optimize`, now loaded at a replan's matching or the operator's warm-up.

Each sample is a fresh interpreter (as a pod's is), alternating the two sides; the figure is the median
CPU time (user + system) of the child, and the wall time beside it. Every replacement pod pays this before
it can join, on its node's cores.

Run: .venv/bin/python bench/bench_agent_startup.py [--repeats N]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

AGENT = "from resilientjob.agent import _bridge; _bridge.preload()"
COMMAND = "import resilientjob.cli._chaos, resilientjob.cli._local"
PAIRS = {
    "pod agent": (AGENT, AGENT + "; import torch.distributed.checkpoint, scipy.optimize"),
    "rjob local command": (COMMAND, COMMAND + "; import scipy.optimize"),
}


def _sample(code: str) -> tuple[float, float]:
    """(CPU s, wall s) of one fresh interpreter running `code`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    for name, (now, before) in PAIRS.items():
        _sample(before)  # warm the page cache for both sides
        runs: dict[str, list[tuple[float, float]]] = {"now": [], "before": []}
        for _ in range(args.repeats):  # alternating, so that a busy moment of the host hits both sides
            runs["now"].append(_sample(now))
            runs["before"].append(_sample(before))
        cpu = {side: statistics.median(c for c, _ in samples) for side, samples in runs.items()}
        wall = {side: statistics.median(w for _, w in samples) for side, samples in runs.items()}
        print(
            f"{name:20s} CPU {cpu['now']:.2f} s now, {cpu['before']:.2f} s before "
            f"({cpu['now'] / cpu['before']:.2f}x); "
            f"wall {wall['now']:.2f} s, {wall['before']:.2f} s (medians of {args.repeats})"
        )


if __name__ == "__main__":
    main()
