"""`rjob simulate`: run the event-driven cluster simulator for one or all policies, or the papers' suite."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from resilientjob.planner import ClusterSpec, JobSpec, ModelProfile
from resilientjob.planner.sim import PlannerPool, SimCosts
from resilientjob.planner.sim.runner import all_policies, random_scenario, run_policies, summarise
from resilientjob.planner.sim.suite import checkpoint_costs
from resilientjob.planner.spec import TransitionCosts

from ._common import CliError, device_memory_bytes, emit, guarded


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("simulate", help="simulate a training job under failures, per policy")
    parser.add_argument("--nodes", type=int, default=32, help="nodes at job start")
    parser.add_argument("--gpus-per-node", type=int, default=1)
    parser.add_argument("--failure-rate", type=float, default=0.1, help="fail-stops per device per hour")
    parser.add_argument("--hours", type=float, default=9.0)
    parser.add_argument(
        "--policy",
        default="all",
        help="adaptive|templates|reroute|checkpoint|redundant|dynamic|oracle, a comma-separated list, or all "
        "(the paper's five: adaptive, templates, reroute, checkpoint, redundant)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1, help="run seeds S..S+K-1 and report mean and spread")
    parser.add_argument("--profile", default="llama2-7b", help="built-in profile name or profile file")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--microbatch-size", type=int, default=1)
    parser.add_argument("--ft", type=int, default=1, help="fault tolerance f (simultaneous failures)")
    parser.add_argument(
        "--device-memory", default=None, help="memory per device: a quantity (80Gi, 64G) or bytes"
    )
    parser.add_argument(
        "--trace", default=None, help="availability trace CSV (time_s,node,up|down) or 'spot'"
    )
    parser.add_argument("--failslow-rate", type=float, default=0.0, help="fail-slows per node per hour")
    parser.add_argument("--mitigation", choices=("on", "off"), default="on", help="Falcon mitigation")
    parser.add_argument(
        "--storage-bandwidth",
        type=float,
        default=None,
        help="bytes/s of checkpoint storage: scale checkpoint save/load with the model state (as the suite "
        "does); default: fixed TransitionCosts",
    )
    parser.add_argument(
        "--planning-s",
        type=float,
        default=None,
        help="fixed planning time per replan (default: the planner's measured time)",
    )
    parser.add_argument("--plot", default=None, help="write throughput/active-devices PNG here")
    parser.add_argument(
        "--suite",
        choices=("paper",),
        default=None,
        help="run the papers' results suite and write docs/results.md and docs/img/",
    )
    parser.add_argument("--out", default="docs", help="folder for --suite output")
    parser.add_argument("--quick", action="store_true", help="--suite with fewer seeds (a smoke run)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=guarded(_run))


def _check_positive(value: float, field: str) -> None:
    if not value > 0:
        raise CliError(f"{field}: must be positive, got {value}")


def _run(args: argparse.Namespace) -> int:
    if args.suite:
        from resilientjob.planner.sim.suite import run_suite

        out = Path(args.out)
        report = run_suite(out, quick=args.quick, log=None if args.json else print)
        emit({"suite": args.suite, "results": str(out / "results.md"), **report}, args.json)
        return 0
    _check_positive(args.nodes, "nodes")
    _check_positive(args.gpus_per_node, "gpus_per_node")
    _check_positive(args.hours, "hours")
    if args.seeds < 1:
        raise CliError(f"seeds: must be >= 1, got {args.seeds}")
    if args.failure_rate < 0:
        raise CliError(f"failure_rate: must be >= 0 per device per hour, got {args.failure_rate}")
    profile = ModelProfile.load(args.profile)
    cluster_fields: dict[str, Any] = {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node}
    if args.device_memory is not None:
        cluster_fields["device_memory_bytes"] = device_memory_bytes(args.device_memory)
    cluster = ClusterSpec(**cluster_fields)
    job = JobSpec(
        global_batch=args.global_batch, microbatch_size=args.microbatch_size, fault_tolerance=args.ft
    )
    transition = TransitionCosts()
    if args.storage_bandwidth is not None:
        _check_positive(args.storage_bandwidth, "storage_bandwidth")
        transition = checkpoint_costs(profile, bytes_per_s=args.storage_bandwidth)
    costs = SimCosts(transition=transition, planning_s=args.planning_s)
    policies = all_policies(args.policy)
    pool = PlannerPool()
    started = time.perf_counter()
    runs = []
    for seed in range(args.seed, args.seed + args.seeds):
        scenario = random_scenario(
            profile,
            cluster,
            job,
            hours=args.hours,
            failure_rate=args.failure_rate,
            seed=seed,
            trace=args.trace,
            failslow_rate=args.failslow_rate,
            mitigation=args.mitigation == "on",
            costs=costs,
        )
        runs.append(run_policies(scenario, policies, pool))
    spread = summarise(runs)
    payload: dict[str, Any] = {"policies": {}}
    for name, result in runs[0].items():
        entry = result.to_json()
        entry["avg_throughput"] = spread[name].mean
        entry["avg_throughput_std"] = spread[name].std
        entry["avg_throughput_per_seed"] = [run[name].avg_throughput for run in runs]
        entry["samples"] = sum(run[name].samples for run in runs) / len(runs)
        payload["policies"][name] = entry
    payload["seeds"] = list(range(args.seed, args.seed + args.seeds))
    payload["planner_calls"] = pool.calls
    payload["plan_cache_hits"] = pool.hits
    payload["wall_s"] = time.perf_counter() - started
    if args.plot:
        from resilientjob.planner.sim.plot import plot_timelines

        title = f"{profile.name}: {args.nodes}x{args.gpus_per_node} devices, {args.failure_rate:g}/device/h"
        payload["plot"] = str(plot_timelines(runs[0], args.plot, title))
    emit(payload, args.json, _human)
    return 0


def _human(payload: dict[str, Any]) -> str:
    lines = [f"{'policy':<11} {'avg samples/s':>14} {'± std':>8} {'recoveries':>11}"]
    for name, entry in payload["policies"].items():
        note = f"  ({entry['infeasible']})" if entry["infeasible"] else ""
        lines.append(
            f"{name:<11} {entry['avg_throughput']:>14.3f} {entry['avg_throughput_std']:>8.3f} "
            f"{len(entry['recoveries']):>11}{note}"
        )
    return "\n".join(lines)
