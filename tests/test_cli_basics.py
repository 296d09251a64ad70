"""`rjob` wiring: help, unknown commands, and the built-in profile listing."""

from __future__ import annotations

import json

import pytest

from resilientjob.cli import main


def test_profiles_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profiles", "--json"]) == 0
    names = {row["name"] for row in json.loads(capsys.readouterr().out)["profiles"]}
    assert "llama2-7b" in names


def test_unknown_command_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_agent_command_needs_its_pod_identity(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("RJOB_JOB", "RJOB_NODE", "RJOB_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    assert main(["agent", "--plan-timeout", "3"]) == 2
    assert "RJOB_JOB" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("workload", "field"),
    [
        ('{"model": "gpt", "training": {"precision": "bf16"}}', "training.precision"),
        ('{"model": "gpt", "data": {"format": "tokens"}}', "data"),
        ('{"model": "gpt", "training": {"stepz": 3}}', "training.stepz"),
        ('{"model": "bert-large"}', "synthetic:bert-large"),
        ("{not json", "RJOB_WORKLOAD"),
    ],
)
def test_agent_refuses_a_bad_workload_in_one_line_naming_the_field(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, workload: str, field: str
) -> None:
    monkeypatch.setenv("RJOB_JOB", "job")
    monkeypatch.setenv("RJOB_NODE", "0")
    monkeypatch.setenv("RJOB_REDIS_URL", "redis://127.0.0.1:1")  # never reached: refused before
    monkeypatch.setenv("RJOB_WORKLOAD", workload)
    assert main(["agent"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and field in err, err


def test_a_reader_that_goes_away_stops_the_command_quietly() -> None:
    """`rjob ... | head`: the pipe closes under the command, which exits as a Unix tool does (status 141,
    SIGPIPE's), with no traceback."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "resilientjob.cli", "templates", "--profile", "gpt3-2.7b"]
    command += ["--nodes", "16"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        assert process.stdout is not None and process.stderr is not None
        process.stdout.close()  # the reader is gone before the first line
        error = process.stderr.read().decode()
        status = process.wait(timeout=120)
    assert status == 141, error
    assert "Traceback" not in error and "BrokenPipeError" not in error, error


def test_measuring_a_hugging_face_model_says_so_first_and_points_at_computed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`rjob profile llama2-7b` built a 7B model for minutes, silently: it says what it does first (on
    stderr: the profile on stdout stays JSON)."""
    model = "hf:gpt2?n_layer=1&n_embd=16&n_head=2&vocab_size=32&n_positions=16"
    assert main(["profile", model, "--repeats", "1"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["layers"]
    assert captured.err.startswith(f"measuring {model}: builds and times each of its 3 layers on cpu")
    assert "--computed" in captured.err
