#!/usr/bin/env python3
"""Run every benchmark under bench/ in turn (`make bench`); each prints its own table of ratios.

Pass names to run a subset: `python bench/run_all.py templates replan`.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(selected: list[str]) -> int:
    scripts = sorted(HERE.glob("bench_*.py"))
    if selected:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in selected]
    failures = 0
    for script in scripts:
        print(f"\n### {script.name}", flush=True)
        started = time.perf_counter()
        result = subprocess.run([sys.executable, str(script)], check=False)
        print(f"({script.name}: exit {result.returncode}, {time.perf_counter() - started:.1f} s)", flush=True)
        failures += result.returncode != 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
