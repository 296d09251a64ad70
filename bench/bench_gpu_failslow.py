"""The fail-slow measurements on one accelerator, for a lease: what sizing the validation GEMM buys, and
whether the tracer's compute mark keeps a device's queued compute out of a wait's communication.

1. GEMM sizing (`validation._grown`, `GEMM_TARGET_S`): the sizes the pass grows through on this device, each
   size's best time and the spread of its repeats (max / min). A device is named only when 1.1x the median
   and `GEMM_FLOOR_S` slower; at a launch-bound size a throttled device times like a healthy one, so the
   question is how far from the launch the grown size is: its time against the 256 product's.
2. The compute mark (`tracing.TracedWork`, `_device_sync.compute_mark`): one rank's process group (NCCL on
   CUDA, HCCL on an NPU, gloo on a CPU), a queue of products issued, then an all-reduce waited on as the
   runtime waits (polling `is_completed`). The traced wait counts as communication only after the queued
   products: its held span should be about the all-reduce alone, against the host's whole wait (products +
   all-reduce), which the tracer counted before.
   The link payload's sizing needs two devices and is not measured here.
3. The parked probe's two sides (`operator._failslow_parked`): a parked node's agent times the probe
   product in a spawned child (`_device_work.DeviceWork`; a thread on a CPU), a training worker times the
   same product in its own process between steps (`IterationRecord.probe_s`), and the operator reads the
   first against the second with a 1.25x bar (threshold 1.5). Their medians on one device, side by side,
   in alternating rounds: their ratio should sit well inside the bar.

Everything goes to --out (default $OUT, else ./bench-gpu-failslow-out)/results.json and is printed.
Usage: python bench/bench_gpu_failslow.py --device cuda
       .venv/bin/python bench/bench_gpu_failslow.py --device cpu   (smoke run: a CPU has no backlog)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from resilientjob.agent import _parked, tracing, validation
from resilientjob.agent._device_sync import synchronize
from resilientjob.agent._device_work import DeviceWork
from resilientjob.agent._runtime_wait import until_complete


def gemm_sizing(device: str, repeats: int) -> dict[str, Any]:
    """The sizes `_grown` visits from 256 on `device`, with each size's best time and its repeats' spread."""
    visited: list[dict[str, Any]] = []

    def timed_at(size: int) -> dict[int, validation.GemmResult]:
        times = [validation.gemm_benchmark(size, 1, device, stretched=False).seconds for _ in range(repeats)]
        visited.append({"size": size, "best_s": min(times), "spread": max(times) / min(times)})
        return {0: validation.GemmResult(0, min(times), 2.0 * size**3 / min(times))}

    target = validation.GEMM_TARGET_S if device != "cpu" else 0.0
    _, size = validation._grown(timed_at, 256, target, validation.GEMM_MAX_SIZE, power=3)
    launch = visited[0]["best_s"]
    return {
        "target_s": target,
        "visited": visited,
        "grown_size": size,
        "grown_over_256": visited[-1]["best_s"] / launch,
        "floor_s": validation.GEMM_FLOOR_S,
    }


def compute_mark(device: str, backlog_s: float) -> dict[str, Any]:
    """The traced all-reduce's held span behind a backlog of products, against the host's whole wait."""
    kind = torch.device(device).type
    backend = {"cuda": "nccl", "npu": "hccl"}.get(kind, "gloo")
    with tempfile.TemporaryDirectory() as scratch:
        dist.init_process_group(backend, init_method=f"file://{scratch}/store", rank=0, world_size=1)
        try:
            dist.all_reduce(torch.ones(1, device=device))  # NCCL makes its communicator at the first call
            a = torch.randn(2048, 2048, device=device)
            synchronize(torch.device(device))
            began = time.perf_counter()
            a @ a
            synchronize(torch.device(device))
            per_product = time.perf_counter() - began
            products = max(1, round(backlog_s / max(per_product, 1e-6)))
            tracer = tracing.install(capacity=64)
            try:
                x = torch.ones(1 << 20, device=device)
                synchronize(torch.device(device))
                issued = time.perf_counter()
                for _ in range(products):
                    a @ a
                work = dist.all_reduce(x, async_op=True)
                waited = time.perf_counter()
                until_complete(work)
                done = time.perf_counter()
                (record,) = [r for r in tracer.ring.records() if r.op == "all_reduce"]
                held = record.blocked
            finally:
                tracing.uninstall()
            # The all-reduce alone, no backlog: what the held span should come to.
            synchronize(torch.device(device))
            began = time.perf_counter()
            dist.all_reduce(x, async_op=True).wait()
            synchronize(torch.device(device))
            alone = time.perf_counter() - began
        finally:
            dist.destroy_process_group()
    return {
        "backend": backend,
        "products": products,
        "issue_s": waited - issued,
        "host_wait_s": done - waited,
        "held_s": (held[1] - held[0]) if held is not None else None,
        "all_reduce_alone_s": alone,
    }


def probe_sides(device: str, rounds: int) -> dict[str, Any]:
    """The probe product timed as a training worker times it (in this process) and as a parked node's agent
    does (through `DeviceWork`), `rounds` each, alternating; the medians and their ratio."""
    work = DeviceWork(device.partition(":")[0])

    async def parked() -> float:
        return await work.run(_parked.measure, device)

    worker_s: list[float] = []
    parked_s: list[float] = []
    try:
        asyncio.run(parked())  # the child's start-up and first product are no probe
        for _ in range(rounds):
            worker_s.append(_parked.measure(device))
            parked_s.append(asyncio.run(parked()))
    finally:
        work.close()
    worker, agent = statistics.median(worker_s), statistics.median(parked_s)
    return {
        "rounds": rounds,
        "worker_median_s": worker,
        "parked_median_s": agent,
        "parked_over_worker": agent / worker,
        "worker_spread": max(worker_s) / min(worker_s),
        "parked_spread": max(parked_s) / min(parked_s),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, npu:N or cpu (default cuda)")
    parser.add_argument("--repeats", type=int, default=9, help="products timed per GEMM size (default 9)")
    parser.add_argument("--backlog-s", type=float, default=0.2, help="queued compute before the all-reduce")
    parser.add_argument("--probe-rounds", type=int, default=20, help="probes timed on each side (default 20)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "bench-gpu-failslow-out")
    args = parser.parse_args(argv)
    if args.device.startswith("npu"):
        import torch_npu  # noqa: F401  (registers the device; not a dependency of this package)
    results = {
        "device": args.device,
        "torch": torch.__version__,
        "gemm_sizing": gemm_sizing(args.device, args.repeats),
        "compute_mark": compute_mark(args.device, args.backlog_s),
        "probe_sides": probe_sides(args.device, args.probe_rounds),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    sizing, mark = results["gemm_sizing"], results["compute_mark"]
    for step in sizing["visited"]:
        best, spread = step["best_s"] * 1e6, step["spread"]
        print(f"GEMM {step['size']:5d}: best {best:9.1f} us, repeats' spread {spread:.2f}x")
    target_ms, ratio = sizing["target_s"] * 1e3, sizing["grown_over_256"]
    print(f"grown to {sizing['grown_size']} (target {target_ms:g} ms): {ratio:.0f}x the 256 product's time")
    issue_ms, wait_ms = mark["issue_s"] * 1e3, mark["host_wait_s"] * 1e3
    held_ms, alone_ms = (mark["held_s"] or 0.0) * 1e3, mark["all_reduce_alone_s"] * 1e3
    print(
        f"{mark['backend']}: {mark['products']} products issued in {issue_ms:.1f} ms, the host waited "
        f"{wait_ms:.1f} ms, traced as communication {held_ms:.1f} ms (the all-reduce alone {alone_ms:.1f} ms)"
    )
    sides = results["probe_sides"]
    worker_ms, parked_ms = sides["worker_median_s"] * 1e3, sides["parked_median_s"] * 1e3
    print(
        f"probe: a worker's {worker_ms:.3f} ms, a parked agent's {parked_ms:.3f} ms "
        f"({sides['parked_over_worker']:.2f}x; the recheck's bar 1.25x), spreads "
        f"{sides['worker_spread']:.2f}x and {sides['parked_spread']:.2f}x over {sides['rounds']} rounds"
    )


if __name__ == "__main__":
    main()
