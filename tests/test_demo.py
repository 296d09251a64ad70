"""`rjob demo` as a user runs it (a subprocess, log mode): the local stack trains the small GPT for real
through a worker kill and a slowdown, the summary lists the fail-stop recovery, the PNG is written, and
everything is torn down."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _rjob_demo(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "resilientjob.cli", "demo", *args],
        cwd=ROOT,
        env={key: value for key, value in os.environ.items() if key != "RJOB_LOCAL_DIR"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_demo_rejects_a_too_short_duration(tmp_path: Path) -> None:
    done = _rjob_demo("--duration", "5", "--out", str(tmp_path), timeout=30)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "duration" in done.stderr
    assert not (tmp_path / "stack").exists()


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.cluster
def test_demo_recovers_from_a_kill_and_writes_the_plot(tmp_path: Path) -> None:
    done = _rjob_demo("--duration", "40", "--no-live", "--out", str(tmp_path), timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "kill: worker 2 (SIGKILL)" in output
    assert "training: first step committed" in output
    # The summary table's row for the fail-stop recovery: its trigger and the node that died.
    rows = [line for line in output.splitlines() if "NodeFailed" in line and "│" in line]
    assert rows and any(cell.strip() == "2" for cell in rows[0].split("│")), output
    # The demo's layout is pipelined, so the recovery moves layers: the workers copied them peer-to-peer.
    copies = re.search(r"peer-to-peer: (\d+) layer copies planned, (\d+) bytes copied", output)
    assert copies is not None and int(copies[1]) > 0 and int(copies[2]) > 0, output
    png = tmp_path / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert not (tmp_path / "stack" / "state.json").exists()  # torn down
