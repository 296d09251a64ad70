"""`rjob detect` and `rjob rebalance`: the JSON contract and one-line, exit-2 errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from resilientjob.cli import main


def _write_trace(path: Path, times: list[float] | np.ndarray, extra: bool = True) -> Path:
    header = "step,iteration_time_s,loss" if extra else "iteration_time_s"
    rows = [f"{i},{t},{3.0 - i / 1000}" if extra else f"{t}" for i, t in enumerate(times)]
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(args)
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_detect_reports_slowdown_and_recovery(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    times = np.random.default_rng(0).normal(0.8, 0.01, 500)
    times[200:320] *= 1.6
    times[90] *= 3.0  # a spike: not an event
    trace = _write_trace(tmp_path / "trace.csv", times)
    code, out, _ = _run(["detect", "--trace", str(trace), "--json"], capsys)
    assert code == 0
    events = json.loads(out)["events"]
    assert [(e["kind"], e["index"]) for e in events] == [("slowdown", 200), ("recovery", 320)]
    assert set(events[0]) == {"index", "kind", "before_s", "after_s"}
    assert events[0]["before_s"] == pytest.approx(0.8, rel=0.02)
    assert events[0]["after_s"] == pytest.approx(1.28, rel=0.03)
    code, out, _ = _run(["detect", "--trace", str(trace)], capsys)
    assert code == 0 and "iteration 200: slowdown" in out


def test_detect_clean_trace_has_no_events(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write_trace(tmp_path / "clean.csv", np.random.default_rng(1).normal(2.0, 0.04, 300), extra=False)
    code, out, _ = _run(["detect", "--trace", str(trace), "--json"], capsys)
    assert code == 0 and json.loads(out) == {"events": []}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("iteration_time_s\n", "no iterations"),
        ("", "no column iteration_time_s"),
        ("step,loss\n1,2.0\n", "no column iteration_time_s (columns: step, loss)"),
        ("iteration_time_s\n1.0\nfast\n", "line 3: iteration_time_s is not a number: 'fast'"),
        ("iteration_time_s\n1.0\n-0.5\n", "line 3: iteration_time_s must be finite and > 0"),
        ("iteration_time_s\n1.0\nnan\n", "must be finite and > 0"),
    ],
)
def test_detect_bad_traces_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    trace = tmp_path / "bad.csv"
    trace.write_text(content)
    code, out, err = _run(["detect", "--trace", str(trace), "--json"], capsys)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1


def test_detect_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["detect", "--trace", str(tmp_path / "nope.csv")], capsys)
    assert code == 2 and "cannot read" in err


def test_rebalance_contract(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["rebalance", "--times", "1,1,1,2", "--microbatches", "28", "--json"], capsys)
    assert code == 0
    payload = json.loads(out)
    assert payload["microbatches"] == [8, 8, 8, 4]
    assert payload["makespan_s"] == 8.0
    assert 0 <= payload["solve_s"] < 1.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--times=1,-1", "--microbatches", "8"], "times: group 1"),
        (["--times", "1,x", "--microbatches", "8"], "comma-separated numbers"),
        (["--times", "1,1,1", "--microbatches", "2"], "microbatches: 2 micro-batches cannot give each of 3"),
        (["--times", "1,1", "--microbatches", "two"], "invalid int value"),
    ],
)
def test_rebalance_errors_exit_2(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    code, out, err = _run(["rebalance", *args, "--json"], capsys)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1


def test_rjob_process_runs_rebalance() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilientjob.cli",
            "rebalance",
            "--times",
            "0.5,1.0",
            "--microbatches",
            "9",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["microbatches"] == [6, 3]
