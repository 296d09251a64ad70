"""Fail-slow end to end on the local stack (issue 7): the real kopf operator against kmock, Redis, the process
kubelet and real gloo workers of the `sleep` model (calibrated-sleep layers, so that 2 shared cores give
stable step times), a job of 4 data-parallel groups. Chaos orders go through `rjob local chaos slow`.

Scenarios (`--scenario`):
- `compute`: node 1's compute slowed 1.5x. Prints the detection delay in iterations (first compute
  SlowReport of node 1 after the order) and the share of the slowdown the mitigation removed,
  (mitigated - slow) / (healthy - slow) in throughput.
- `link`: node 1's sends to node 2 slowed; prints the validation result and the mitigation, if the operator
  runs validation and S3 (issue 7, operator side).
- `mixed`: Falcon Fig. 17: a slow link, then a slow GPU, then both persist; writes throughput over time to
  JSON and PNG (`--out`, default docs/img/failslow-mixed.png).
- `healthy`: no order for `--minutes`; counts SlowReports and fail-slow mitigations (must be 0).

Usage: .venv/bin/python bench/bench_failslow_e2e.py --scenario compute
       .venv/bin/python bench/bench_failslow_e2e.py --scenario healthy --minutes 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import yaml

from resilientjob.agent._redis import JobKeys
from resilientjob.agent.telemetry_messages import (
    IterationRecord,
    PlanAnnouncement,
    SlowReport,
    ValidationResult,
)

ROOT = Path(__file__).resolve().parents[1]
JOB = "failslow"
LAYERS = 8
FORWARD_S = 0.002
MICROBATCHES_PER_NODE = 8
"""Sleep per layer per micro-batch forward (backward twice): 8 layers x 8 micro-batches -> ~400 ms steps.
Eight micro-batches per node give S2 room: one slow node can hand a few of its micro-batches to the others.
Sleeps of 1 ms were too short on the loaded machine (compute CV 6-9% against 2% with 3 ms sleeps)."""


def manifest(nodes: int) -> dict[str, Any]:
    layer = {
        "forwardS": FORWARD_S,
        "backwardS": 2 * FORWARD_S,
        "paramBytes": 4352,
        "optimizerBytes": 8716,
        "activationBytes": 1024,
        "outputBytes": 1024,
    }
    return {
        "apiVersion": "resilientjob.io/v1alpha1",
        "kind": "ResilientJob",
        "metadata": {"name": JOB, "namespace": "default"},
        "spec": {
            "image": "resilientjob/worker:latest",
            "command": [
                *(
                    "python",
                    "-m",
                    "resilientjob.agent",
                    "--num-samples",
                    "4096",
                    "--collective-timeout",
                    "10",
                ),
                *("--model-option", f"forward_sleep_s={FORWARD_S}", "--model-option", f"layers={LAYERS}"),
            ],
            "model": "sleep",
            "profile": {"inline": [{"name": f"layer{i}", **layer} for i in range(LAYERS)]},
            "nodes": nodes,
            "gpusPerNode": 1,
            "deviceResource": "none",
            "globalBatchSize": MICROBATCHES_PER_NODE * nodes,
            "microBatchSize": 1,
            "faultTolerance": 1,
            "policy": "auto",
            "failSlow": {"slowdownThreshold": 1.3, "minDurationS": 2},
            "chaos": {"enabled": True},
        },
    }


class Stack:
    """`rjob local` in a temporary directory, and readers of the job's Redis streams."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.rjob("up")
        state = json.loads((directory / "state.json").read_text())
        self.client = redis.Redis.from_url(state["redis_url"])
        self.keys = JobKeys("default", JOB)

    def rjob(self, *args: str) -> str:
        env = {**os.environ, "RJOB_LOCAL_DIR": str(self.directory)}
        done = subprocess.run(
            [sys.executable, "-m", "resilientjob.cli", "local", *args],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"rjob local {' '.join(args)}: {done.stdout}{done.stderr}")
        return done.stdout

    def stream(self, key: str) -> list[bytes]:
        return [fields[b"m"] for _, fields in self.client.xrange(key)]

    def iterations(self) -> list[IterationRecord]:
        return [IterationRecord.model_validate_json(raw) for raw in self.stream(self.keys.iterations)]

    def reports(self) -> list[SlowReport]:
        return [SlowReport.model_validate_json(raw) for raw in self.stream(self.keys.reports)]

    def validations(self) -> list[ValidationResult]:
        return [
            ValidationResult.model_validate_json(raw) for raw in self.stream(self.keys.validation_results)
        ]

    def plan(self) -> PlanAnnouncement | None:
        raw = self.client.get(self.keys.plan)
        return PlanAnnouncement.model_validate_json(raw) if raw else None

    def step(self, node: int = 0) -> int:
        steps = [record.step for record in self.iterations() if record.node == node]
        return max(steps, default=0)

    def down(self) -> None:
        self.rjob("down")


def wait(probe: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"{what}: not within {timeout_s} s")


def throughput(records: list[IterationRecord], node: int, first: float, last: float) -> float:
    """Samples per second of the job between two unix times, from one node's steps (all nodes of a
    synchronous job finish steps together): steps in the window x global batch / window."""
    mine = sorted((r.sent_at, r.step) for r in records if r.node == node and first <= r.sent_at <= last)
    if len(mine) < 3:
        return 0.0
    return (mine[-1][1] - mine[0][1]) / (mine[-1][0] - mine[0][0])


def timeline(records: list[IterationRecord], node: int, bucket_s: float = 5.0) -> list[tuple[float, float]]:
    """(seconds since the first step, steps/s) per bucket."""
    mine = sorted((r.sent_at, r.step) for r in records if r.node == node)
    if not mine:
        return []
    start = mine[0][0]
    buckets: dict[int, list[int]] = {}
    for at, step in mine:
        buckets.setdefault(int((at - start) // bucket_s), []).append(step)
    return [(k * bucket_s, (max(v) - min(v) + 1) / bucket_s) for k, v in sorted(buckets.items())]


def scenario_compute(stack: Stack, nodes: int) -> dict[str, Any]:
    wait(lambda: stack.step(0) >= 40, 300, "40 healthy steps")
    healthy_from = time.time()
    wait(lambda: stack.step(0) >= 70, 300, "70 healthy steps")
    healthy_to = time.time()
    generation = stack.plan().generation if stack.plan() else 0
    stack.rjob("chaos", "slow", f"{JOB}-node-1", "--factor", "1.5", "--for", "10m")
    injected = time.time()  # the order is in Redis now; the worker's watcher reads it within 0.25 s

    def detected() -> SlowReport | None:
        found = [r for r in stack.reports() if r.node == 1 and r.detected_at >= injected and not r.recovered]
        return found[0] if found else None

    report = wait(detected, 300, "a SlowReport from node 1")

    def mitigated() -> PlanAnnouncement | None:
        plan = stack.plan()
        return plan if plan is not None and plan.generation > generation else None

    try:
        new = wait(mitigated, 180, "a mitigation plan")
    except TimeoutError:
        new = None
    mitigated_at = time.time()
    slow_to = new.published_at if new is not None else mitigated_at
    after = stack.step(0)
    if new is not None:
        wait(lambda: stack.step(0) >= after + 50, 300, "50 steps after the mitigation")
    records = stack.iterations()
    # The first step of node 1 that began after the order landed (its watcher polls every 0.25 s).
    inject_step = min(r.step for r in records if r.node == 1 and r.sent_at >= injected + 0.25) - 1
    healthy = throughput(records, 0, healthy_from, healthy_to)
    slow = throughput(records, 0, injected + 0.5, slow_to)
    mitigated_rate = throughput(records, 0, mitigated_at + 5, time.time()) if new is not None else 0.0
    removed = (mitigated_rate - slow) / (healthy - slow) if new is not None and healthy > slow else None
    return {
        "healthy_steps_per_s": healthy,
        "slow_steps_per_s": slow,
        "mitigated_steps_per_s": mitigated_rate,
        "slowdown_removed": removed,
        "inject_step": inject_step,
        "detected_step": report.step,
        "detection_delay_iterations": report.step - inject_step,
        "detector_onset_step": report.onset_step,
        "slow_window_s": slow_to - injected - 0.5,
        "report": report.model_dump(mode="json"),
        "mitigation": None
        if new is None
        else {
            "generation": new.generation,
            "strategy": new.strategy,
            "layout": new.layout,
            "trigger": new.trigger,
        },
        "reports": [r.model_dump(mode="json") for r in stack.reports()],
    }


def scenario_link(stack: Stack, nodes: int) -> dict[str, Any]:
    wait(lambda: stack.step(0) >= 40, 300, "40 healthy steps")
    stack.rjob("chaos", "slow", f"{JOB}-node-1", "--factor", "20", "--for", "10m", "--link", f"{JOB}-node-2")
    try:
        results = wait(stack.validations, 180, "a validation result (operator side of issue 7)")
    except TimeoutError:
        results = []
    plan = stack.plan()
    return {
        "validations": [r.model_dump(mode="json") for r in results],
        "plan": None if plan is None else {"generation": plan.generation, "strategy": plan.strategy},
        "reports": [r.model_dump(mode="json") for r in stack.reports()],
    }


def scenario_mixed(stack: Stack, nodes: int, out: Path) -> dict[str, Any]:
    wait(lambda: stack.step(0) >= 40, 300, "40 healthy steps")
    started = time.time()
    stack.rjob("chaos", "slow", f"{JOB}-node-1", "--factor", "20", "--for", "10m", "--link", f"{JOB}-node-2")
    time.sleep(60)
    stack.rjob("chaos", "slow", f"{JOB}-node-3", "--factor", "2", "--for", "10m")
    time.sleep(120)
    records = stack.iterations()
    points = timeline(records, 0)
    result = {
        "started": started,
        "timeline": points,
        "plans": [stack.plan().model_dump(mode="json")] if stack.plan() else [],
        "reports": [r.model_dump(mode="json") for r in stack.reports()],
    }
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 3))
    axes.plot([t for t, _ in points], [v for _, v in points])
    axes.set_xlabel("seconds")
    axes.set_ylabel("steps/s")
    axes.set_title("Fail-slow mixed case: link slow, then GPU slow")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    return result


def scenario_healthy(stack: Stack, minutes: float) -> dict[str, Any]:
    wait(lambda: stack.step(0) >= 10, 300, "10 steps")
    time.sleep(minutes * 60)
    records = stack.iterations()
    computes: dict[int, list[float]] = {}
    for record in records:
        if record.compute_s is not None:
            computes.setdefault(record.node, []).append(record.compute_s)
    spread = {
        node: statistics.stdev(values) / statistics.mean(values)
        for node, values in computes.items()
        if len(values) > 2
    }
    plan = stack.plan()
    return {
        "steps": stack.step(0),
        "slow_reports": [r.model_dump(mode="json") for r in stack.reports()],
        "mitigations": 0 if plan is None or not plan.strategy else plan.generation,
        "generation": None if plan is None else plan.generation,
        "compute_cv": spread,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=("compute", "link", "mixed", "healthy"), required=True)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--minutes", type=float, default=5.0, help="healthy: how long to run")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "failslow-mixed.png")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rjob-failslow-") as directory:
        stack = Stack(Path(directory))
        try:
            path = Path(directory) / "job.yaml"
            path.write_text(yaml.safe_dump(manifest(args.nodes)))
            stack.rjob("apply", "-f", str(path))
            began = time.time()
            if args.scenario == "compute":
                result = scenario_compute(stack, args.nodes)
            elif args.scenario == "link":
                result = scenario_link(stack, args.nodes)
            elif args.scenario == "mixed":
                result = scenario_mixed(stack, args.nodes, args.out)
            else:
                result = scenario_healthy(stack, args.minutes)
            plan = stack.plan()
            result["layout"] = None if plan is None else plan.layout
            result["wall_s"] = time.time() - began
        finally:
            stack.down()
    text = json.dumps(result, indent=1, default=str)
    if args.json:
        args.json.write_text(text)
    summary = {k: v for k, v in result.items() if k not in ("reports", "slow_reports", "timeline", "report")}
    print(json.dumps(summary, indent=1, default=str))
    if "reports" in result or "slow_reports" in result:
        for report in result.get("reports", result.get("slow_reports", [])):
            print(
                f"report node {report['node']} step {report['step']} kind {report['kind']} "
                f"x{report['slowdown']:.2f} recovered={report['recovered']}"
            )


if __name__ == "__main__":
    main()
