"""`rjob profiles`: list the built-in model profiles."""

from __future__ import annotations

import argparse

from resilientjob.planner import ModelProfile, builtin_profiles

from ._common import emit, guarded


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("profiles", help="list the built-in model profiles")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=guarded(_run))


def _run(args: argparse.Namespace) -> int:
    rows = []
    for name in builtin_profiles():
        profile = ModelProfile.load(name)
        rows.append(
            {
                "name": name,
                "layers": profile.num_layers,
                "state_gib": round(profile.state_bytes(0, profile.num_layers) / 2**30, 2),
                "step_s_per_microbatch": round(sum(profile.stage_times(0, profile.num_layers)), 4),
            }
        )
    emit(
        {"profiles": rows},
        args.json,
        lambda payload: "\n".join(
            f"{row['name']:<16} {row['layers']:>4} layers  {row['state_gib']:>8} GiB state"
            for row in payload["profiles"]
        ),
    )
    return 0
