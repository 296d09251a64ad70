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
    assert main(["agent", "--steps", "3"]) == 2
    assert "RJOB_JOB" in capsys.readouterr().err
