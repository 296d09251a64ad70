"""`rjob templates`: the JSON contract and the one-line, exit-2 error cases."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from resilientjob.cli import main


def test_templates_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["templates", "--profile", "bert-large", "--nodes", "4", "--gpus-per-node", "2", "--ft", "1"]
    assert main([*argv, "--global-batch", "16", "--microbatch-size", "2", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["n0"] == payload["templates"][0]["nodes"]
    assert [t["nodes"] for t in payload["templates"]] == list(range(payload["n0"], 4 - payload["n0"] + 1))
    for template in payload["templates"]:
        layers = [stage["layers"] for stage in template["stages"]]
        assert layers[0][0] == 0 and layers[-1][1] == 26
        assert all(a[1] == b[0] for a, b in itertools.pairwise(layers))
        used = [(s["node"], g) for s in template["stages"] for g in s["gpus"]]
        assert sorted(used) == [(n, g) for n in range(template["nodes"]) for g in range(2)]
        assert template["iteration_s"] > 0
    assert payload["planning_s"] >= 0
    pipelines = payload["instantiation"]["pipelines"]
    assert sum(p["microbatches"] for p in pipelines) == 8 and len(pipelines) >= 2


def test_device_memory_changes_n0(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["templates", "--profile", "gpt3-6.7b", "--nodes", "8", "--ft", "1", "--json"]
    assert main([*argv, "--device-memory", str(40 * 2**30)]) == 0
    tight = json.loads(capsys.readouterr().out)["n0"]
    assert main([*argv, "--device-memory", str(160 * 2**30)]) == 0
    roomy = json.loads(capsys.readouterr().out)["n0"]
    assert tight > roomy >= 1
    # A quantity, as `rjob plan` and spec.deviceMemory take it.
    assert main([*argv, "--device-memory", "40Gi"]) == 0
    assert json.loads(capsys.readouterr().out)["n0"] == tight


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (["--profile", "bert-large", "--nodes", "0", "--ft", "1"], "nodes"),
        (["--profile", "bert-large", "--nodes", "2", "--ft", "2"], "--ft"),
        (["--profile", "no-such-profile", "--nodes", "4", "--ft", "1"], "profile"),
        (
            ["--profile", "gpt3-6.7b", "--nodes", "4", "--ft", "1", "--device-memory", "1000"],
            "--device-memory",
        ),
        (
            ["--profile", "gpt3-6.7b", "--nodes", "4", "--ft", "1", "--device-memory", "40 GB"],
            "--device-memory",
        ),
        (
            [
                "--profile",
                "bert-large",
                "--nodes",
                "4",
                "--ft",
                "1",
                "--global-batch",
                "2",
                "--microbatch-size",
                "2",
            ],
            "--global-batch",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(
    extra: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["templates", *extra, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and field in captured.err and "Traceback" not in captured.err


def test_malformed_profile_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"layers": [{"forward_s": -1, "backward_s": 1}]}))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilientjob.cli",
            "templates",
            "--profile",
            str(bad),
            "--nodes",
            "2",
            "--ft",
            "0",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("rjob: error: profile.layers.0") and result.stderr.count("\n") == 1
