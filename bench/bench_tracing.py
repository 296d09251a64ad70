"""Overhead of the torch.distributed tracer on a real training loop, traced vs untraced in one run.

Two gloo processes train a small MLP data-parallel (forward, backward, one all-reduce per gradient, a
point-to-point exchange of the loss, SGD). The same processes alternate blocks of steps without and with the
tracer installed (so that load on the shared machine hits both sides alike) and the script prints
the mean step time of each side and their ratio. A second measurement isolates the wrapper's own cost
per call (around a function that does nothing) and converts it into a share of the step. Finally the
trace is read back: the ACF period must equal the calls per step and the iteration time the measured step.

Usage: .venv/bin/python bench/bench_tracing.py [--steps 300] [--block 10] [--hidden 512] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from resilientjob.agent import chaos, trace_reader, tracing
from resilientjob.localstack.ports import free_port


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, rank: int) -> None:
    optimizer.zero_grad()
    loss = model(batch).square().mean()
    loss.backward()
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad)  # type: ignore[arg-type]
    peer = 1 - rank
    sent, got = loss.detach().reshape(1), torch.zeros(1)
    works = [dist.isend(sent, peer), dist.irecv(got, peer)]
    for work in works:
        work.wait()
    optimizer.step()


def _timed_block(model: Any, optimizer: Any, batch: torch.Tensor, rank: int, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        _step(model, optimizer, batch, rank)
        times.append(time.perf_counter() - began)
    return times


def _wrapper_cost_s(tracer: tracing.Tracer, calls: int) -> float:
    """The tracer's own time per call: its all_reduce wrapper around a function that does nothing, minus
    the bare function (best of 5), so that no communication noise enters the figure."""

    def nothing(
        tensor: torch.Tensor, op: object = None, group: object = None, async_op: bool = False
    ) -> None:
        return None

    wrapped = tracer._wrap("all_reduce", nothing, tracing.TRACED["all_reduce"])
    tensor = torch.ones(1)

    def best(function: Any) -> float:
        runs = []
        for _ in range(5):
            began = time.perf_counter()
            for _ in range(calls):
                function(tensor)
            runs.append((time.perf_counter() - began) / calls)
        return min(runs)

    return best(wrapped) - best(nothing)


def _split_cost_s(tracer: tracing.Tracer, calls_per_step: int, repeats: int = 2000) -> float:
    """What the worker probe does once per step: read the step's records back and sum the time the
    caller was held by communication (`trace_reader.blocked_s`)."""
    since = max(0, tracer.ring.head - calls_per_step)
    began = time.perf_counter()
    for _ in range(repeats):
        records = tracer.ring.records(since=since)
        trace_reader.blocked_s(records, records[0].start_s, records[-1].end_s)
    return (time.perf_counter() - began) / repeats


def _worker(rank: int, port: int, out: str, options: dict[str, int]) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # A TCP store rank 0 hosts, as the runtime's launcher does: over a `file://` one gloo's connect failed
    # now and then here (tests/agent/test_tracing.run_gloo).
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    hidden = options["hidden"]
    model = torch.nn.Sequential(
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU()
    )
    model.append(torch.nn.Linear(hidden, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(options["batch"], hidden)
    _timed_block(model, optimizer, batch, rank, 5)  # warm-up
    plain: list[float] = []
    traced: list[float] = []
    tracer = tracing.install()
    tracer.hook = chaos.ChaosInjector()  # as in a pod that allows chaos, with no order active
    tracer.uninstall()
    block = options["block"]
    for index in range(2 * options["steps"] // block):
        # Alternate blocks in lockstep on both ranks, so that load on the shared host hits both sides alike;
        # the first step of a block (where the ranks' phase offset moves waiting time across the switch) is
        # dropped, and installing and uninstalling happen outside the timed steps.
        if index % 2:
            tracer.install()
            traced += _timed_block(model, optimizer, batch, rank, block)[1:]
            tracer.uninstall()
        else:
            plain += _timed_block(model, optimizer, batch, rank, block)[1:]
    calls_per_step = len(tracer.ring.records()) // (options["steps"] // block * block)
    since = tracer.ring.head
    tracer.install()
    window = _timed_block(model, optimizer, batch, rank, 30)
    recent = tracer.ring.records(since=since)
    wrapper_s = _wrapper_cost_s(tracer, options["calls"])
    split_s = _split_cost_s(tracer, calls_per_step)
    tracing.uninstall()
    times = trace_reader.trace_iteration_times(recent)
    dist.destroy_process_group()
    result = {
        "plain_s": plain,
        "traced_s": traced,
        "wrapper_s": wrapper_s,
        "split_s": split_s,
        "calls_per_step": calls_per_step,
        "period": times.period,
        "acf_mean_s": times.mean_s,
        "window_mean_s": statistics.mean(window[1 : 1 + len(times.times_s)]),
    }
    Path(out, f"{rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per side")
    parser.add_argument("--block", type=int, default=10, help="steps per block before switching sides")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    options = vars(args)
    with tempfile.TemporaryDirectory() as directory:
        mp.start_processes(
            _worker, args=(free_port(), directory, options), nprocs=2, join=True, start_method="fork"
        )
        results = [json.loads(Path(directory, f"{rank}.json").read_text()) for rank in range(2)]
    print(f"2 gloo processes, MLP hidden {args.hidden}, batch {args.batch}; {args.steps} steps per side")
    header = ("rank", "untraced ms", "traced ms", "overhead", "wrapper us", "calls/step", "wrapper share")
    print("{:>4} {:>12} {:>10} {:>9} {:>11} {:>10} {:>13}".format(*header), end="")
    print(" {:>9} {:>11}".format("split us", "split share"), end="")
    print(" {:>10} {:>12} {:>13}".format("ACF period", "ACF iter ms", "timed iter ms"))
    overheads = []
    for rank, r in enumerate(results):
        plain, traced = statistics.mean(r["plain_s"]), statistics.mean(r["traced_s"])
        overheads.append(traced / plain - 1)
        share = r["wrapper_s"] * r["calls_per_step"] / plain
        print(
            f"{rank:>4} {plain * 1e3:>12.3f} {traced * 1e3:>10.3f} {overheads[-1] * 100:>8.2f}% "
            f"{r['wrapper_s'] * 1e6:>11.2f} {r['calls_per_step']:>10} {share * 100:>12.3f}% "
            f"{r['split_s'] * 1e6:>9.1f} {r['split_s'] / plain * 100:>10.3f}% "
            f"{r['period']:>10} {r['acf_mean_s'] * 1e3:>12.3f} {r['window_mean_s'] * 1e3:>13.3f}"
        )
    spread = statistics.stdev(results[0]["plain_s"]) / statistics.mean(results[0]["plain_s"])
    print(
        f"step overhead, mean of ranks: {statistics.mean(overheads) * 100:.2f}% (step time CV {spread:.0%})"
    )
    print("overhead: mean traced step / mean untraced step - 1 (blocks alternate traced/untraced)")
    print("wrapper share: the wrapper's own cost per call (around a no-op) x calls per step / untraced step")
    print("  (the tracer's hook is a chaos injector with no order, as in a pod that allows chaos)")
    print("split: reading one step's records back and splitting compute/communication, per step")
    print("ACF: period and mean iteration time found in the trace of 30 more traced steps, vs their timing")


if __name__ == "__main__":
    main()
