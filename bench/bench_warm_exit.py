"""What a warm-started pod's exit costs, with and without `gc.freeze` in the warm interpreter.

The local stack's pods fork from one interpreter that imported the agent's modules (`localstack._warm_start`).
A forked child that exits normally runs the interpreter's finalization, whose collections walk every object
the imports made; each object it touches is a page the child copies from its parent. Frozen (`gc.freeze`
before the fork, as `_warm_start._serve` does), the collector leaves them alone. This forks children side by
side in one run, alternating, from the same imported interpreter, and prints the CPU each exit took.

    python bench/bench_warm_exit.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import resource
import statistics
import sys
import time

from resilientjob.localstack._warm_start import AGENT_WARM_START


def _exit_cpu(frozen: bool) -> tuple[float, float]:
    """Fork a child that exits at once through the interpreter's finalization; its (CPU s, wall s)."""
    if frozen:
        gc.freeze()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # the normal exit: atexit, then the finalization this measures
    os.waitpid(pid, 0)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if frozen:
        gc.unfreeze()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    began = time.perf_counter()
    for module in AGENT_WARM_START.preload:
        importlib.import_module(module)
    took = time.perf_counter() - began
    print(f"imported the agent's preload in {took:.1f} s: {len(gc.get_objects())} objects tracked")
    gc.collect()
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for frozen in (False, True):
            results[frozen].append(_exit_cpu(frozen))
    plain, frozen_ = (statistics.median(cpu for cpu, _ in results[f]) for f in (False, True))
    for name, key in (("plain", False), ("frozen", True)):
        cpus = ", ".join(f"{cpu:.2f}" for cpu, _ in results[key])
        walls = statistics.median(wall for _, wall in results[key])
        print(f"{name:>6}: exit CPU s per child {cpus} (median wall {walls:.2f} s)")
    print(f"frozen / plain exit CPU: {frozen_ / plain:.2f}")


if __name__ == "__main__":
    main()
