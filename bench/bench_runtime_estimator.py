"""Estimator accuracy: the planner's predicted step time vs the step time the runtime measures, per layout.

Layers are calibrated sleeps (`models.SleepLayer`: 5 ms forward, 10 ms backward per micro-batch), so 2 CPU
cores can run up to 8 workers without compute contention distorting step times, and the `ModelProfile` the
planner predicts from is built from those calibrated times (`profiler.calibrated_profile`), bytes as
measured. Each layout is produced by the planner itself (`initial_plan` over a DP range, or `replan` after
failures for heterogeneous layouts), run for a few steps by real gloo workers, and the median of the
steps after the first is compared with the plan's `step_time_s`. The per-message cost between two workers
(`ClusterSpec.message_latency_s`) is measured once at the start (`profiler.measure_message_latency`) and
given to every layout's planner; the same model predicts all layouts. It also measures the store round
trip the atomic commit adds to every step (`_runtime_commit.CommitVote.vote`).
Usage: .venv/bin/python bench/bench_runtime_estimator.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch._C._distributed_c10d import TCPStore

from resilientjob.agent._runtime_commit import CommitVote
from resilientjob.agent.models import load_model
from resilientjob.agent.profiler import calibrated_profile, measure_message_latency
from resilientjob.agent.worker import JobConfig
from resilientjob.planner.plan import Plan, Policy
from resilientjob.testing.launcher import Launcher
from resilientjob.testing.plans import RuntimePlanner

MODEL = {"layers": 16, "hidden": 8, "seq_len": 4, "forward_sleep_s": 0.005}
GLOBAL_BATCH, MICROBATCH = 8, 1
STEPS = 4


def vote_cost_s(votes: int = 2000) -> float:
    """Seconds one commit vote costs a worker (a compare_set round trip to a TCPStore on this machine)."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    began = time.perf_counter()
    for step in range(votes):
        CommitVote(client, 0, step, 0, 8).vote([0.5, 0.0])
    return (time.perf_counter() - began) / votes


def layouts(profile_nodes: int, latency_s: float) -> list[tuple[str, RuntimePlanner, Plan]]:
    """(description, planner, plan) for every layout measured: symmetric and heterogeneous."""
    profile = calibrated_profile(load_model("sleep", **MODEL))
    out = []
    for nodes, dp in ((1, 1), (2, 1), (2, 2), (3, 1), (4, 1), (4, 2), (6, 2), (8, 2), (6, 3), (8, 4)):
        if nodes > profile_nodes:
            continue
        planner = RuntimePlanner.for_job(
            profile,
            nodes,
            GLOBAL_BATCH,
            MICROBATCH,
            fault_tolerance=0,
            dp_range=(dp, dp),
            message_latency_s=latency_s,
        )
        out.append((f"{nodes} nodes", planner, planner.initial(Policy.DYNAMIC)))
    # Heterogeneous layouts: what the planner makes of 8 and 6 nodes after one failure.
    for nodes, dp, failed in ((8, 2, 5), (6, 2, 1), (5, 2, 4)):
        planner = RuntimePlanner.for_job(
            profile, nodes, GLOBAL_BATCH, MICROBATCH, dp_range=(dp, dp), message_latency_s=latency_s
        )
        plan = planner.recover(planner.initial(Policy.DYNAMIC), [failed], Policy.DYNAMIC)
        # Run the new layout from the start: renumber nothing, just drop the transfers it needed.
        out.append((f"{nodes}-1 nodes", planner, plan.model_copy(update={"transfers": (), "generation": 0})))
    return out


def main() -> None:
    torch.set_num_threads(1)
    latency = measure_message_latency()
    vote = vote_cost_s()
    print(
        f"message latency (measured, one way): {latency * 1e3:.3f} ms; commit vote: {vote * 1e6:.1f} us/step"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, (name, planner, plan) in enumerate(layouts(8, latency)):
            config = JobConfig.plain(
                model="sleep",
                model_options=dict(MODEL),
                num_samples=64,
                steps=STEPS,
                collective_timeout_s=10.0,
            )
            result = Launcher(config, plan, planner, Path(tmp) / str(index)).run(timeout_s=300)
            measured = statistics.median(result.step_times[0][1:])
            rows.append(
                (name, plan.layout, [p.microbatches for p in plan.pipelines], plan.step_time_s, measured)
            )
    print(f"{'nodes':<11}{'layout':<24}{'micro-batches':<18}{'predicted':>10}{'measured':>10}{'error':>8}")
    errors = []
    for name, layout, shares, predicted, measured in rows:
        error = abs(predicted - measured) / measured
        errors.append(error)
        print(
            f"{name:<11}{layout:<24}{shares!s:<18}{predicted * 1e3:>8.1f}ms{measured * 1e3:>8.1f}ms"
            f"{error * 100:>7.1f}%"
        )
    print(
        f"layouts: {len(rows)}  mean error: {statistics.mean(errors) * 100:.2f}%"
        f"  max: {max(errors) * 100:.2f}%"
    )


if __name__ == "__main__":
    main()
