"""Throughput after recovery vs (N'/N) x failure-free throughput, measured in one run (Odyssey: 96.22%).

8 gloo workers train a 16-layer calibrated-sleep model (5 ms forward, 10 ms backward per layer and
micro-batch, so 2 CPU cores do not distort step times) on the planner's DP2 layout; node 5 crashes at
step 4; the planner (`auto`) recovers on 7 and training goes on. Throughput is the global batch over the
median step time of each plan (its first step excluded), measured by the workers themselves.
Usage: .venv/bin/python bench/bench_runtime_throughput.py [auto|dynamic|reroute|templates]
(the recovery policy; default auto, the planner's choice)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import torch

from resilientjob.agent.models import load_model
from resilientjob.agent.profiler import calibrated_profile
from resilientjob.agent.worker import JobConfig
from resilientjob.planner.plan import Policy
from resilientjob.testing.launcher import Launcher
from resilientjob.testing.plans import RuntimePlanner

MODEL = {"layers": 16, "hidden": 8, "seq_len": 4, "forward_sleep_s": 0.005}
NODES, FAILED, FAIL_AT, STEPS = 8, 5, 4, 9


def main() -> None:
    torch.set_num_threads(1)
    policy = Policy(sys.argv[1]) if len(sys.argv) > 1 else Policy.AUTO
    profile = calibrated_profile(load_model("sleep", **MODEL))
    planner = RuntimePlanner.for_job(profile, NODES, global_batch=16, microbatch_size=1, dp_range=(2, 2))
    plan = planner.initial()
    config = JobConfig.plain(
        model="sleep", model_options=dict(MODEL), num_samples=64, steps=STEPS, collective_timeout_s=10.0
    )
    with tempfile.TemporaryDirectory() as tmp:
        result = Launcher(config, plan, planner, Path(tmp), fail_at={FAILED: FAIL_AT}, policy=policy).run(
            timeout_s=600
        )
    before, after = result.plans[0], result.plans[-1]
    step_before = statistics.median(result.step_times[before.generation][1:])
    step_after = statistics.median(result.step_times[after.generation][1:])
    share = len(after.nodes) / len(before.nodes)
    measured = (before.global_batch / step_after) / (share * before.global_batch / step_before)
    predicted = (before.step_time_s / after.step_time_s) / share
    print(
        f"{'plan':<10}{'layout':<16}{'nodes':>6}{'predicted step':>16}{'measured step':>15}{'samples/s':>11}"
    )
    for name, p, step in (("before", before, step_before), ("after", after, step_after)):
        print(
            f"{name:<10}{p.layout:<16}{len(p.nodes):>6}{p.step_time_s * 1e3:>14.1f}ms{step * 1e3:>13.1f}ms"
            f"{p.global_batch / step:>11.2f}"
        )
    print(f"policy chosen after the failure: {after.policy}")
    print(
        f"throughput after / ({len(after.nodes)}/{len(before.nodes)} x before): "
        f"measured {measured * 100:.2f}%"
        f"  predicted {predicted * 100:.2f}%"
    )


if __name__ == "__main__":
    main()
