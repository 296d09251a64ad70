"""`rjob plan`: the plan the planner would run for a job, or with `--failed`, its recovery from the initial
plan after those nodes fail (so transfers name real copies between the initial cluster's nodes 0..N-1)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from resilientjob.operator.planning import plan_initial, plan_next
from resilientjob.planner import PlannerError
from resilientjob.planner.plan import Plan, Policy
from resilientjob.planner.profile import ModelProfile
from resilientjob.planner.search import initial_plan, replan
from resilientjob.planner.spec import CheckpointState, ClusterSpec, JobSpec

from ._common import CliError, device_memory_bytes, emit, guarded, int_list
from ._plan_manifest import SPEC_FLAGS, manifest_job


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan a job's layout, or its recovery after node failures (Odyssey's adaptive choice)",
        description="The plan the operator would run for a job: from a ResilientJob manifest (-f), or from "
        "flags alone (then --profile, --nodes, --global-batch, --microbatch-size and --ft are required). "
        "With --failed, the recovery from the first plan after those nodes fail.",
    )
    parser.add_argument(
        "-f",
        "--filename",
        type=Path,
        help="a ResilientJob manifest: nodes, batch sizes, f, device memory, policy, checkpointing and the "
        "profile come from its spec; the flags below, when given, edit it",
    )
    parser.add_argument(
        "--profile",
        help="profile file (.json/.yaml) or built-in name (`rjob profiles`); with -f, in place "
        "of the manifest's",
    )
    parser.add_argument("--nodes", type=int, help="nodes at job start (ids 0..N-1)")
    parser.add_argument("--gpus-per-node", type=int, help="accelerators per node (default 1)")
    parser.add_argument("--global-batch", type=int, help="samples per optimizer step")
    parser.add_argument("--microbatch-size", type=int, help="samples per micro-batch")
    parser.add_argument("--ft", type=int, help="fault tolerance f: failures to survive")
    parser.add_argument("--failed", default="", help="comma-separated node ids that fail, e.g. 3,7")
    parser.add_argument(
        "--policy", choices=[policy.value for policy in Policy], help="recovery policy (default auto)"
    )
    parser.add_argument(
        "--failure-rate", type=float, default=0.01, help="expected failures per node-hour (default 0.01)"
    )
    parser.add_argument(
        "--step", type=int, default=0, help="global steps done when the nodes fail (default 0)"
    )
    parser.add_argument(
        "--checkpointing",
        action="store_true",
        help="without -f: the job writes checkpoints (a restart can read them)",
    )
    parser.add_argument(
        "--last-checkpoint-step",
        type=int,
        default=None,
        help="without -f: step of the last checkpoint written (default: none; a restart then redoes every "
        "step)",
    )
    parser.add_argument(
        "--device-memory", default=None, help="memory per accelerator: a quantity (80Gi, 64G) or bytes"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=guarded(_run))


_REQUIRED = ("profile", "nodes", "global_batch", "microbatch_size", "ft")
"""The flags a plan without a manifest cannot do without."""


def _job(args: argparse.Namespace) -> JobSpec:
    batch, size = args.global_batch, args.microbatch_size
    if batch >= 1 and size >= 1 and batch % size:
        raise PlannerError(
            "global_batch",
            f"{batch} is not a multiple of microbatch_size {size}; try {batch - batch % size or size}",
        )
    return JobSpec(global_batch=batch, microbatch_size=size, fault_tolerance=args.ft)


def _checkpoint(args: argparse.Namespace) -> CheckpointState:
    last = args.last_checkpoint_step
    if last is not None and not 0 <= last <= args.step:
        raise PlannerError("last_checkpoint_step", f"must be in 0..step ({args.step}), got {last}")
    return CheckpointState(configured=args.checkpointing, step=args.step, last_step=last)


def _failed(args: argparse.Namespace, nodes: int) -> list[int]:
    failed = int_list(args.failed, "failed")
    for node in failed:
        if not 0 <= node < nodes:
            raise PlannerError("failed", f"node {node} is not in the cluster (nodes 0..{nodes - 1})")
    return failed


def _run(args: argparse.Namespace) -> int:
    rate = args.failure_rate
    if not (math.isfinite(rate) and rate >= 0):
        raise PlannerError("failure_rate_per_node_hour", f"must be a finite number >= 0, got {rate}")
    if args.step < 0:
        raise PlannerError("step", f"must be >= 0, got {args.step}")
    if args.filename is not None:
        return _run_manifest(args)
    missing = [f"--{name.replace('_', '-')}" for name in _REQUIRED if getattr(args, name) is None]
    if missing:
        raise CliError(f"{missing[0]}: required without -f (a manifest); missing: {' '.join(missing)}")
    gpus = 1 if args.gpus_per_node is None else args.gpus_per_node
    cluster_fields: dict[str, Any] = {"nodes": args.nodes, "gpus_per_node": gpus}
    if args.device_memory is not None:
        cluster_fields["device_memory_bytes"] = device_memory_bytes(args.device_memory)
    cluster = ClusterSpec(**cluster_fields)
    job = _job(args)
    failed = _failed(args, cluster.nodes)
    profile = ModelProfile.load(args.profile)
    policy = Policy(args.policy or Policy.AUTO.value)
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


def _run_manifest(args: argparse.Namespace) -> int:
    """The operator's own planning (`operator.planning`) on the manifest's job: the first plan, then, with
    `--failed`, the recovery at `--step` priced with the job's own checkpointing and overheads."""
    for flag, unset in (("checkpointing", False), ("last_checkpoint_step", None)):
        if getattr(args, flag) is not unset:
            raise CliError(
                f"--{flag.replace('_', '-')}: not with -f (the manifest's spec.checkpoint says how the job "
                "checkpoints)"
            )
    edits = {
        field: getattr(args, flag) for flag, field in SPEC_FLAGS.items() if getattr(args, flag) is not None
    }
    job = manifest_job(args.filename, edits, args.profile)
    try:
        plan = plan_initial(job.spec, job.inputs)
        failed = _failed(args, job.spec.nodes)
        if failed:
            plan = plan_next(
                job.spec,
                job.inputs,
                plan,
                failed=failed,
                step=args.step,
                failure_rate_per_node_hour=args.failure_rate,
            )
    except PlannerError as exc:
        raise CliError(f"{args.filename} ({job.name}): {exc}") from None
    data = payload(plan)
    data["job"] = {"name": job.name, "profile": job.profile_source}
    emit(data, args.json, _human)
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
    lines = []
    if "job" in data:
        lines.append(f"job {data['job']['name']}: profile {data['job']['profile']}")
    lines.append(
        f"policy {data['policy']}  layout {data['layout']}  step {data['step_time_s']:.4f} s  "
        f"{data['throughput']:.1f} samples/s  transition {data['transition_s']:.2f} s  "
        f"peak memory {data['peak_memory_bytes'] / 2**30:.2f} GiB"
    )
    for index, pipeline in enumerate(data["pipelines"]):
        stages = " | ".join(
            f"{s['layers'][0]}-{s['layers'][1] - 1}@{','.join(map(str, s['nodes']))}"
            for s in pipeline["stages"]
        )
        lines.append(f"  pipeline {index}: {pipeline['microbatches']} micro-batches  {stages}")
    if data["transfers"]:
        moved = sum(t["bytes"] for t in data["transfers"])
        lines.append(f"  {len(data['transfers'])} layer copies, {moved / 2**30:.2f} GiB")
    for c in data["candidates"]:
        if c["feasible"]:
            figures = (
                f"step {c['step_time_s']:.4f} s  transition {c['transition_s']:.2f} s  "
                f"effective {c['score']:.1f} samples/s"
            )
            lines.append(f"  [ok ] {c['policy']:<10} {c['layout']:<24} {figures}  {c['reason']}")
        else:
            lines.append(f"  [n/a] {c['policy']:<10} {c['reason']}")
    if data["candidates"]:
        lines.append(
            "  effective: samples/s over the mean time between failures, less the transition's share of it "
            "(Odyssey eq. 8); auto takes the highest"
        )
    return "\n".join(lines)
