"""`rjob agent [runtime flags]`: the worker pod's agent (the same as `python -m resilientjob.agent`)."""

from __future__ import annotations

import argparse
import asyncio


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "agent",
        help="run the worker agent of one pod (identity from RJOB_* environment variables)",
        description="Heartbeats, telemetry and the training workers of one pod; what to train comes from "
        "RJOB_WORKLOAD (the job's spec), and every further flag (--collective-timeout S, --plan-timeout S, "
        "--model-option KEY=VALUE) goes to the training runtime.",
    )
    parser.set_defaults(handler=_run, passthrough=True)


def _run(args: argparse.Namespace) -> int:
    # Imported here: `rjob plan` and friends must not pay for the agent's imports.
    from resilientjob.agent.__main__ import main

    code: int = asyncio.run(main(list(getattr(args, "flags", []))))
    return code
