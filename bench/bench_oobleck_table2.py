"""Section 2 of docs/results.md alone (Oobleck Table 2's shape at Oobleck's global batches): the same code
as `rjob simulate --suite paper` runs for that section (`planner/sim/suite.py` `oobleck`), 3 seeds.

Run: .venv/bin/python bench/bench_oobleck_table2.py [--out docs] [--seeds 3]

Prints the section's markdown (paste it into docs/results.md) and writes the bar charts to OUT/img/.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from resilientjob.planner.sim.engine import PlannerPool
from resilientjob.planner.sim.suite import oobleck


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs", help="folder whose img/ receives the charts")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    out = Path(args.out)
    (out / "img").mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    text, _ = oobleck(
        out, args.seeds, PlannerPool(None), lambda line: print(line, file=sys.stderr, flush=True)
    )
    print(text)
    print(f"({time.perf_counter() - began:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
