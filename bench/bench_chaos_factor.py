"""How closely a compute chaos order slows a worker by the factor ordered, on this host's real sleeps.

One process runs steps as a worker does under `agent.chaos`: `--intervals` spans of real CPU work (a GEMM
loop of about `--interval-ms`), each followed by the tracer's hook (where a compute order sleeps), and the
step's stretch at its end (`stretch_step`, as `_worker_probe` tops a committed step up). The measured factor
is the median step time under the order over the median without it, in alternating blocks of steps; and,
as a host can slow the worker's own work between sleeps (caches, a virtual CPU taken away while idle), the
compute spans' own factor and the injection's error net of it, step / (F x own). Many short intervals are
the fast steps of a quiet 16-core host or a GPU, where each sleep's late wake-up (60-130 us) is a visible
share of the step.

`--baseline FILE` runs another version of `agent/chaos.py` side by side in the same process (e.g.
`git show REV:agent/chaos.py > /tmp/chaos_before.py`), each block of steps alternating between the two.

Usage: python bench/bench_chaos_factor.py [--factors 1.2 1.3 1.5 2] [--baseline /tmp/chaos_before.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from resilientjob.agent import chaos


def load_baseline(path: Path) -> ModuleType:
    """`path` as a module of the agent package (its relative imports resolve there)."""
    spec = importlib.util.spec_from_file_location("resilientjob.agent._chaos_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the order's annotations there
    spec.loader.exec_module(module)
    return module


def calibrated_work(interval_s: float) -> tuple[torch.Tensor, int]:
    """A matrix and a count of products of it that take about `interval_s` here."""
    matrix = torch.randn(96, 96, generator=torch.Generator().manual_seed(0))
    began, count = time.perf_counter(), 0
    while time.perf_counter() - began < 0.2:
        matrix @ matrix
        count += 1
    return matrix, max(1, round(count * interval_s / (time.perf_counter() - began)))


def step(
    injector: chaos.ChaosInjector, matrix: torch.Tensor, products: int, intervals: int
) -> tuple[float, float]:
    """One step: `intervals` compute spans, each ended by a traced call, then the stretch. Returns its
    wall time and the time of its compute spans alone (the worker's own compute, without the delays)."""
    began, injected, own = time.perf_counter(), injector.injected_s, 0.0
    for _ in range(intervals):
        span_began = time.perf_counter()
        for _ in range(products):
            matrix @ matrix
        span = time.perf_counter() - span_began
        own += span
        injector("all_reduce", -1, 8, span)
    injector.stretch_step(time.perf_counter() - began, injector.injected_s - injected)
    return time.perf_counter() - began, own


def measure(
    versions: dict[str, ModuleType], factor: float, work: tuple[torch.Tensor, int], args: argparse.Namespace
) -> dict[str, tuple[float, float]]:
    """Each version's measured factor, and how much slower its own compute ran under the order (the
    spans alone), their blocks of steps in turn (the host's speed drifts)."""
    injectors = {name: module.ChaosInjector() for name, module in versions.items()}
    healthy: dict[str, list[tuple[float, float]]] = {name: [] for name in versions}
    slowed: dict[str, list[tuple[float, float]]] = {name: [] for name in versions}
    for _ in range(args.blocks):
        for name, module in versions.items():
            injector = injectors[name]
            injector.order = None
            healthy[name] += [step(injector, *work, args.intervals) for _ in range(args.steps)]
            injector.order = module.ChaosOrder(factor=factor, until=time.time() + 600)
            slowed[name] += [step(injector, *work, args.intervals) for _ in range(args.steps)]

    def ratio(name: str, index: int) -> float:
        under = statistics.median(s[index] for s in slowed[name])
        return under / statistics.median(h[index] for h in healthy[name])

    return {name: (ratio(name, 0), ratio(name, 1)) for name in versions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factors", type=float, nargs="+", default=[1.2, 1.3, 1.5, 2.0])
    parser.add_argument("--intervals", type=int, default=12, help="compute spans (traced calls) per step")
    parser.add_argument("--interval-ms", type=float, default=1.5)
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--blocks", type=int, default=6, help="blocks of each kind, alternating")
    parser.add_argument("--baseline", type=Path, help="another agent/chaos.py to run side by side")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a worker computes (`worker.run_from_plan`)
    work = calibrated_work(args.interval_ms / 1000)
    versions = {"current": chaos, **({"baseline": load_baseline(args.baseline)} if args.baseline else {})}
    print(
        f"{args.intervals} spans of ~{args.interval_ms:g} ms per step; "
        f"{args.blocks} x {args.steps} steps each way"
    )
    print(
        "step: the step time's factor; own: the compute spans alone, under the order against without\n"
        "it (the host slowing the worker's own work between sleeps; 1.00x on an ideal host);\n"
        "injected: step / (F x own), what the injection itself added beyond the order"
    )
    print("ordered  " + "  ".join(f"{name:>40}" for name in versions))
    for factor in args.factors:
        measured = measure(versions, factor, work, args)
        cells = [
            f"step {step:5.3f}x own {own:5.3f}x injected {(step / (factor * own) - 1) * 100:+5.1f}%"
            for step, own in measured.values()
        ]
        print(f"{factor:6.2f}x  " + "  ".join(f"{cell:>40}" for cell in cells))


if __name__ == "__main__":
    main()
