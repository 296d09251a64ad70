"""`rjob plan`: the plan the planner would run for a job, or with `--failed`, its recovery from the initial
plan after those nodes fail (so transfers name real copies between the initial cluster's nodes 0..N-1)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from resilientjob.operator.api import quantity_bytes
from resilientjob.planner import PlannerError
from resilientjob.planner.plan import Plan, Policy
from resilientjob.planner.profile import ModelProfile
from resilientjob.planner.search import initial_plan, replan
from resilientjob.planner.spec import CheckpointState, ClusterSpec, JobSpec

from ._common import emit, guarded, int_list


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "plan", help="plan a job's layout, or its recovery after node failures (Odyssey's adaptive choice)"
    )
    parser.add_argument("--profile", required=True, help="profile file (.json/.yaml) or built-in name")
    parser.add_argument("--nodes", type=int, required=True, help="nodes at job start (ids 0..N-1)")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="accelerators per node (default 1)")
    parser.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    parser.add_argument("--microbatch-size", type=int, required=True, help="samples per micro-batch")
    parser.add_argument("--ft", type=int, required=True, help="fault tolerance f: failures to survive")
    parser.add_argument("--failed", default="", help="comma-separated node ids that fail, e.g. 3,7")
    parser.add_argument(
        "--policy",
        default=Policy.AUTO.value,
        choices=[policy.value for policy in Policy],
        help="recovery policy",
    )
    parser.add_argument(
        "--failure-rate", type=float, default=0.01, help="expected failures per node-hour (default 0.01)"
    )
    parser.add_argument(
        "--step", type=int, default=0, help="global steps done when the nodes fail (default 0)"
    )
    parser.add_argument(
        "--checkpointing", action="store_true", help="the job writes checkpoints (a restart can read them)"
    )
    parser.add_argument(
        "--last-checkpoint-step",
        type=int,
        default=None,
        help="step of the last checkpoint written (default: none; a restart then redoes every step)",
    )
    parser.add_argument(
        "--device-memory", default=None, help="memory per accelerator: a quantity (80Gi, 64G) or bytes"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=guarded(_run))


def _job(args: argparse.Namespace) -> JobSpec:
    batch, size = args.global_batch, args.microbatch_size
    if batch >= 1 and size >= 1 and batch % size:
        raise PlannerError(
            "global_batch",
            f"{batch} is not a multiple of microbatch_size {size}; try {batch - batch % size or size}",
        )
    return JobSpec(global_batch=batch, microbatch_size=size, fault_tolerance=args.ft)


def _checkpoint(args: argparse.Namespace) -> CheckpointState:
    if args.step < 0:
        raise PlannerError("step", f"must be >= 0, got {args.step}")
    last = args.last_checkpoint_step
    if last is not None and not 0 <= last <= args.step:
        raise PlannerError("last_checkpoint_step", f"must be in 0..step ({args.step}), got {last}")
    return CheckpointState(configured=args.checkpointing, step=args.step, last_step=last)


def _run(args: argparse.Namespace) -> int:
    rate = args.failure_rate
    if not (math.isfinite(rate) and rate >= 0):
        raise PlannerError("failure_rate_per_node_hour", f"must be a finite number >= 0, got {rate}")
    cluster_fields: dict[str, Any] = {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node}
    if args.device_memory is not None:
        try:
            cluster_fields["device_memory_bytes"] = quantity_bytes(args.device_memory)
        except ValueError as exc:
            raise PlannerError("device_memory_bytes", str(exc)) from None
    cluster = ClusterSpec(**cluster_fields)
    job = _job(args)
    failed = int_list(args.failed, "failed")
    for node in failed:
        if not 0 <= node < cluster.nodes:
            raise PlannerError("failed", f"node {node} is not in the cluster (nodes 0..{cluster.nodes - 1})")
    profile = ModelProfile.load(args.profile)
    policy = Policy(args.policy)
    plan = initial_plan(profile, cluster, job, policy=policy)
    if failed:
        plan = replan(
            plan,
            profile,
            cluster,
            job,
            failed=failed,
            policy=policy,
            failure_rate_per_node_hour=rate,
            checkpoint=_checkpoint(args),
        )
    emit(payload(plan), args.json, _human)
    return 0


def payload(plan: Plan) -> dict[str, Any]:
    """The plan as the `rjob plan --json` contract describes it (plus a few extra keys)."""
    pipelines = []
    for pipeline in plan.pipelines:
        stages = []
        for stage in pipeline.stages:
            entry: dict[str, Any] = {
                "layers": list(stage.layers),
                "nodes": list(stage.rerouted_to) if stage.rerouted else [stage.node],
                "gpus": list(stage.gpus),
            }
            if stage.rerouted:
                entry["rerouted_from"] = stage.node
            stages.append(entry)
        pipelines.append(
            {"nodes": list(pipeline.nodes), "stages": stages, "microbatches": pipeline.microbatches}
        )
    return {
        "policy": plan.policy.value,
        "layout": plan.layout,
        "generation": plan.generation,
        "pipelines": pipelines,
        "step_time_s": plan.step_time_s,
        "throughput": plan.throughput,
        "transition_s": plan.transition_s,
        "peak_memory_bytes": plan.peak_memory_bytes,
        "transfers": [
            {"layer": t.layer, "src": t.src, "dst": t.dst, "bytes": t.bytes} for t in plan.transfers
        ],
        "planning_s": plan.planning_s,
        "failed_nodes": list(plan.failed_nodes),
        "allreduce_rounds": [[list(segment) for segment in round_] for round_ in plan.allreduce_rounds],
        "candidates": [
            {
                "policy": c.policy.value,
                "layout": c.layout,
                "step_time_s": c.step_time_s,
                "transition_s": c.transition_s,
                "score": c.score,
                "feasible": c.feasible,
                "reason": c.reason,
            }
            for c in plan.candidates
        ],
    }


def _human(data: dict[str, Any]) -> str:
    lines = [
        f"policy {data['policy']}  layout {data['layout']}  step {data['step_time_s']:.4f} s  "
        f"transition {data['transition_s']:.2f} s  peak memory {data['peak_memory_bytes'] / 2**30:.2f} GiB",
    ]
    for index, pipeline in enumerate(data["pipelines"]):
        stages = " | ".join(
            f"{s['layers'][0]}-{s['layers'][1] - 1}@{','.join(map(str, s['nodes']))}"
            for s in pipeline["stages"]
        )
        lines.append(f"  pipeline {index}: {pipeline['microbatches']} micro-batches  {stages}")
    if data["transfers"]:
        moved = sum(t["bytes"] for t in data["transfers"])
        lines.append(f"  {len(data['transfers'])} layer copies, {moved / 2**30:.2f} GiB")
    for candidate in data["candidates"]:
        mark = "ok " if candidate["feasible"] else "n/a"
        c = candidate
        lines.append(
            f"  [{mark}] {c['policy']:<10} {c['layout']:<24} step {c['step_time_s']:.4f} s  "
            f"transition {c['transition_s']:.2f} s  score {c['score']:.2f}  {c['reason']}"
        )
    return "\n".join(lines)
