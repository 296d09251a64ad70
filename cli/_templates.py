"""`rjob templates`: Oobleck pipeline templates for a profile and cluster, optionally instantiated."""

from __future__ import annotations

import argparse
from typing import Any

from resilientjob.planner.profile import ModelProfile
from resilientjob.planner.spec import ClusterSpec, JobSpec
from resilientjob.planner.templates import generate_templates, instantiate

from ._common import CliError, device_memory_bytes, emit, guarded


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("templates", help="generate Oobleck pipeline templates")
    parser.add_argument("--profile", required=True, help="profile file (.json/.yaml) or built-in name")
    parser.add_argument("--nodes", type=int, required=True, help="nodes at job start (N)")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="accelerators per node")
    parser.add_argument("--ft", type=int, default=1, help="fault tolerance threshold f")
    parser.add_argument(
        "--device-memory", default=None, help="memory per accelerator: a quantity (80Gi, 64G) or bytes"
    )
    parser.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="samples per step: with --microbatch-size, also instantiate the templates for the N nodes "
        "(micro-batches per pipeline)",
    )
    parser.add_argument("--microbatch-size", type=int, default=None, help="samples per micro-batch")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=guarded(_run))


def _run(args: argparse.Namespace) -> int:
    profile = ModelProfile.load(args.profile)
    cluster_fields: dict[str, Any] = {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node}
    if args.device_memory is not None:
        cluster_fields["device_memory_bytes"] = device_memory_bytes(args.device_memory)
    cluster = ClusterSpec(**cluster_fields)
    templates = generate_templates(profile, cluster, args.ft)
    payload: dict[str, Any] = {
        "n0": templates.n0,
        "fault_tolerance": templates.fault_tolerance,
        "templates": [
            {
                "nodes": template.nodes,
                "stages": [
                    {"layers": list(stage.layers), "node": stage.node, "gpus": list(stage.gpus)}
                    for stage in template.stages
                ],
                "iteration_s": template.iteration_s,
            }
            for template in templates.templates
        ],
        "planning_s": templates.planning_s,
    }
    if (args.global_batch is None) != (args.microbatch_size is None):
        raise CliError("global_batch: --global-batch and --microbatch-size go together")
    if args.global_batch is not None:
        job = JobSpec(
            global_batch=args.global_batch, microbatch_size=args.microbatch_size, fault_tolerance=args.ft
        )
        plan = instantiate(templates, list(range(cluster.nodes)), profile, cluster, job)
        payload["instantiation"] = {
            "pipelines": [
                {
                    "nodes": list(pipeline.nodes),
                    "template": pipeline.template,
                    "microbatches": pipeline.microbatches,
                }
                for pipeline in plan.pipelines
            ],
            "step_time_s": plan.step_time_s,
        }
    emit(payload, args.json, _human)
    return 0


def _human(payload: dict[str, Any]) -> str:
    lines = [f"n0 = {payload['n0']}, planned in {payload['planning_s']:.3f} s"]
    for template in payload["templates"]:
        splits = " ".join(f"{s['layers'][0]}-{s['layers'][1]}x{len(s['gpus'])}" for s in template["stages"])
        lines.append(f"{template['nodes']:>4} nodes  {template['iteration_s']:.4f} s  {splits}")
    if "instantiation" in payload:
        sizes = [p["template"] for p in payload["instantiation"]["pipelines"]]
        lines.append(f"instantiated {sizes}: step {payload['instantiation']['step_time_s']:.4f} s")
    return "\n".join(lines)
