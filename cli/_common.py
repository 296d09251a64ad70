"""Shared plumbing for `rjob` commands: JSON output and the one-line, exit-2 error contract."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from resilientjob.planner import PlannerError
from resilientjob.planner.errors import error_from_validation

USAGE_ERROR = 2


class CliError(Exception):
    """A user error to print as one line; exits with status 2."""


def fail(message: str) -> int:
    print(f"rjob: error: {message}", file=sys.stderr)
    return USAGE_ERROR


def guarded(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Run a command handler so that bad input ends in one line on stderr and exit 2, never a traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except PlannerError as exc:
            return fail(_as_flag(str(exc), args))
        except ValidationError as exc:
            return fail(_as_flag(str(error_from_validation(exc)), args))
        except CliError as exc:
            return fail(_as_flag(str(exc), args))

    return run


DEST_OF_FIELD = {
    "fault_tolerance": "ft",
    "device_memory_bytes": "device_memory",
    "latency_s": "latency",
    "bandwidth_bps": "bandwidth",
    "failure_rate_per_node_hour": "failure_rate",
}
"""Planner fields that an option of another name sets (the others are named as their options' `dest`)."""


def _as_flag(message: str, args: argparse.Namespace) -> str:
    """An error that starts with a field the user set by an option (`fault_tolerance: must be >= 0`) names
    the option instead (`--ft: must be >= 0`); `main` puts the command's options in `args.option_flags`."""
    field, colon, rest = message.partition(":")
    flag = getattr(args, "option_flags", {}).get(DEST_OF_FIELD.get(field, field)) if colon else None
    return f"{flag}:{rest}" if flag is not None else message


def kubeconfig_missing(source: str, value: str) -> str | None:
    """The one line for a kubeconfig `value` (a path, or KUBECONFIG's list of them) of which no file is
    there, naming where it came from (`source`: the flag's field or the variable); None when one is."""
    paths = [Path(part).expanduser() for part in value.split(os.pathsep) if part]
    if paths and not any(path.is_file() for path in paths):
        return f"{source}: no such file: {value}"
    return None


def make_directory(path: Path, what: str) -> None:
    """`mkdir -p path`; CliError naming `what` (the flag or variable that gave it) when it cannot be one."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = "a file is there" if isinstance(exc, FileExistsError) else exc.strerror or str(exc)
        raise CliError(f"{what}: cannot make the folder {path}: {reason}") from None


def emit(
    payload: dict[str, Any], as_json: bool, human: Callable[[dict[str, Any]], str] | None = None
) -> None:
    """Print a result: JSON for machines, or a short human rendering."""
    if as_json or human is None:
        print(json.dumps(payload, indent=None if as_json else 2, sort_keys=False))
    else:
        print(human(payload))


def int_list(text: str, field: str) -> list[int]:
    """Parse `3,7` into [3, 7]; a clear error names the flag otherwise."""
    if not text.strip():
        return []
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CliError(f"{field}: expected comma-separated integers, got {text!r}") from None


def float_list(text: str, field: str) -> list[float]:
    """Parse `1.5,2` into [1.5, 2.0]; an empty item (`1,,2`) is refused, not skipped."""
    try:
        values = [float(part) for part in text.split(",")] if text.strip() else []
    except ValueError:
        raise CliError(f"{field}: expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise CliError(f"{field}: expected at least one number")
    return values


def device_memory_bytes(text: str) -> int:
    """`--device-memory`: a quantity (80Gi, 64G) or bytes, as `spec.deviceMemory` takes it."""
    from resilientjob.operator.api import quantity_bytes

    try:
        return quantity_bytes(text)
    except ValueError as exc:
        raise PlannerError("device_memory_bytes", str(exc)) from None
