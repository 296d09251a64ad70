"""`rjob detect` (fail-slow change points in an iteration-time trace) and `rjob rebalance` (Falcon S2).

Both commands live here; `register` adds both parsers (`cli/__init__.py` imports a module once for all of
its commands).
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path
from typing import Any

from resilientjob.planner.failslow import ChangeDetector, redistribute

from ._common import CliError, emit, float_list, guarded

TIME_COLUMN = "iteration_time_s"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    _register_detect(subparsers)
    _register_rebalance(subparsers)


def _register_detect(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "detect",
        help="find fail-slow change points in an iteration-time trace",
        description="BOCD + verification (Falcon 4.2) over the column iteration_time_s of a CSV file.",
    )
    parser.add_argument("--trace", required=True, help=f"CSV file with a header and a column {TIME_COLUMN}")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=guarded(_detect))


def _register_rebalance(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "rebalance",
        help="optimal micro-batch split over data-parallel groups (S2)",
        description="Minimise the slowest group's time, m_i >= 1 and sum m_i = M (exact).",
    )
    parser.add_argument("--times", required=True, help="seconds per micro-batch of each group: t1,t2,...")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches per step, M")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=guarded(_rebalance))


def read_trace(path: Path) -> list[float]:
    """Iteration times from a CSV file; every problem is a one-line CliError naming the row."""
    try:
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            columns = reader.fieldnames or []
            if TIME_COLUMN not in columns:
                found = ", ".join(columns) if columns else "none"
                raise CliError(f"trace: {path} has no column {TIME_COLUMN} (columns: {found})")
            times = []
            for row_number, row in enumerate(reader, start=2):
                text = (row.get(TIME_COLUMN) or "").strip()
                try:
                    value = float(text)
                except ValueError:
                    raise CliError(
                        f"trace: line {row_number}: {TIME_COLUMN} is not a number: {text!r}"
                    ) from None
                if not (math.isfinite(value) and value > 0):
                    raise CliError(
                        f"trace: line {row_number}: {TIME_COLUMN} must be finite and > 0, got {text}"
                    )
                times.append(value)
    except OSError as exc:
        raise CliError(f"trace: cannot read {path}: {exc.strerror or exc}") from None
    except (csv.Error, UnicodeDecodeError) as exc:
        raise CliError(f"trace: {path} is not a readable CSV file: {exc}") from None
    if not times:
        raise CliError(f"trace: {path} has no iterations")
    return times


def _detect(args: argparse.Namespace) -> int:
    times = read_trace(Path(args.trace))
    events = ChangeDetector().detect(times)
    payload: dict[str, Any] = {"events": [event.as_json() for event in events]}
    emit(
        payload,
        args.json,
        lambda p: (
            "\n".join(
                f"iteration {e['index']}: {e['kind']} {e['before_s']:.3f} s -> {e['after_s']:.3f} s "
                f"({e['after_s'] / e['before_s'] - 1:+.0%})"
                for e in p["events"]
            )
            or f"no fail-slow in {len(times)} iterations"
        ),
    )
    return 0


def _rebalance(args: argparse.Namespace) -> int:
    times = float_list(args.times, "times")
    for index, value in enumerate(times):
        if not (math.isfinite(value) and value > 0):
            raise CliError(
                f"times: group {index}: seconds per micro-batch must be finite and > 0, got {value}"
            )
    result = redistribute(times, args.microbatches)
    payload = {
        "microbatches": list(result.microbatches),
        "makespan_s": result.makespan_s,
        "solve_s": result.solve_s,
    }
    emit(
        payload,
        args.json,
        lambda p: (
            f"micro-batches {p['microbatches']}, slowest group {p['makespan_s']:.4g} s "
            f"(solved in {p['solve_s'] * 1e3:.3f} ms)"
        ),
    )
    return 0
