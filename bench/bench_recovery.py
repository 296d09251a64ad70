"""Recovery time of live reconfiguration vs checkpoint-restart of the same job, measured in one run.

Runs the tiny GPT on 8 worker processes (gloo, CPU), kills one node at step 3, and reports the recovery
split into detect, plan, rendezvous, copy and resume; then the same job and failure on the checkpoint path
(all workers restarted, layers loaded from the last checkpoint).
Usage: .venv/bin/python bench/bench_recovery.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from resilientjob.agent.models import load_model
from resilientjob.agent.profiler import measure_profile
from resilientjob.agent.worker import JobConfig
from resilientjob.testing.launcher import JobResult, Launcher
from resilientjob.testing.plans import RuntimePlanner

MODEL = {"layers": 8, "hidden": 32, "heads": 2, "vocab": 32, "seq_len": 16}


def phases(result: JobResult) -> dict[str, float]:
    recovery = result.recoveries[0]
    failed_at = min(result.events[f"fail/{node}"] for node in recovery.failed)
    generation = recovery.generation
    applied = [v for k, v in result.events.items() if k.startswith(f"applied/{generation}/")]
    resumed = [v for k, v in result.events.items() if k.startswith(f"resumed/{generation}/")]
    ready = max(entry["time"] for entry in applied)
    return {
        "detect": recovery.detected_at - failed_at,
        "plan": recovery.planned_at - recovery.detected_at,
        "rendezvous": max(entry["rendezvous_s"] for entry in applied),
        "copy": max(entry["copy_s"] for entry in applied),
        "resume": max(resumed) - ready,
        "total": max(resumed) - failed_at,
    }


def main() -> None:
    torch.set_num_threads(1)
    spec = load_model("gpt", **MODEL)
    profile = measure_profile(spec, timed=False)
    planner = RuntimePlanner.for_job(profile, nodes=8, global_batch=16, microbatch_size=2, dp_range=(2, 2))
    plan = planner.initial()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, live in (("live", True), ("checkpoint-restart", False)):
            config = JobConfig.plain(
                model="gpt",
                model_options=dict(MODEL),
                num_samples=128,
                steps=6,
                collective_timeout_s=3.0,
                checkpoint_dir=str(Path(tmp) / name / "ckpt"),
                checkpoint_interval=3,
            )
            launcher = Launcher(config, plan, planner, Path(tmp) / name, fail_at={5: 3}, live=live)
            rows[name] = phases(launcher.run(timeout_s=300))
    keys = ["detect", "plan", "rendezvous", "copy", "resume", "total"]
    print(f"{'path':<20}" + "".join(f"{key:>12}" for key in keys))
    for name, row in rows.items():
        print(f"{name:<20}" + "".join(f"{row[key]:>11.3f}s" for key in keys))
    print(
        f"checkpoint-restart / live total: {rows['checkpoint-restart']['total'] / rows['live']['total']:.2f}x"
    )


if __name__ == "__main__":
    main()
