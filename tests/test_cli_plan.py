"""`rjob plan`: the JSON contract, recovery from the initial plan, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from resilientjob.cli import main

GiB = 2**30


def _profile(tmp_path: Path, layers: int = 12, forward_s: float = 0.01) -> str:
    """Layers of 1 GiB state each, so that an 8 GiB device forces pipelines of several stages."""
    layer = {
        "forward_s": forward_s,
        "backward_s": 0.02,
        "param_bytes": GiB // 4,
        "optimizer_bytes": GiB // 2,
        "activation_bytes": GiB // 16,
        "output_bytes": 2**20,
    }
    path = tmp_path / "model.json"
    path.write_text(
        json.dumps({"name": "test", "layers": [dict(layer, name=f"l{i}") for i in range(layers)]})
    )
    return str(path)


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, "--json"]) == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    return data


def _base(profile: str, nodes: int = 8, gpus: int = 1) -> list[str]:
    return [
        "--profile",
        profile,
        "--nodes",
        str(nodes),
        "--gpus-per-node",
        str(gpus),
        "--global-batch",
        "64",
        "--microbatch-size",
        "2",
        "--ft",
        "1",
        "--device-memory",
        str(8 * GiB),
    ]


def test_initial_plan_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _plan(capsys, *_base(_profile(tmp_path)))
    for key in (
        "policy",
        "layout",
        "pipelines",
        "step_time_s",
        "transition_s",
        "peak_memory_bytes",
        "transfers",
        "planning_s",
        "candidates",
    ):
        assert key in data
    assert data["policy"] == "dynamic" and data["transfers"] == [] and data["transition_s"] == 0
    assert sum(p["microbatches"] for p in data["pipelines"]) == 32
    nodes = [n for p in data["pipelines"] for s in p["stages"] for n in s["nodes"]]
    assert sorted(nodes) == list(range(8))
    assert data["peak_memory_bytes"] <= 8 * GiB
    for pipeline in data["pipelines"]:
        assert pipeline["stages"][0]["layers"][0] == 0 and pipeline["stages"][-1]["layers"][1] == 12
        assert len(pipeline["stages"]) > 1  # 12 GiB of state cannot sit on one 8 GiB device


@pytest.mark.parametrize("policy", ["dynamic", "templates"])
def test_recovery_uses_every_alive_node_once(
    policy: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _plan(capsys, *_base(_profile(tmp_path)), "--failed", "3,6", "--policy", policy)
    assert data["policy"] == policy
    alive = sorted(set(range(8)) - {3, 6})
    nodes = Counter(n for p in data["pipelines"] for s in p["stages"] for n in s["nodes"])
    assert sorted(nodes) == alive and set(nodes.values()) == {1}
    assert data["failed_nodes"] == [3, 6]
    assert data["transition_s"] > 0
    for transfer in data["transfers"]:
        assert transfer["src"] in alive and transfer["dst"] in alive and transfer["bytes"] > 0
    [candidate] = data["candidates"]
    assert candidate["policy"] == policy and candidate["feasible"]


def test_templates_with_several_gpus_per_node_use_each_alive_node_in_one_pipeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _plan(
        capsys,
        *_base(_profile(tmp_path, layers=24), nodes=6, gpus=2),
        "--failed",
        "1",
        "--policy",
        "templates",
    )
    owners: dict[int, set[int]] = {}
    for index, pipeline in enumerate(data["pipelines"]):
        for stage in pipeline["stages"]:
            for node in stage["nodes"]:
                owners.setdefault(node, set()).add(index)
    assert sorted(owners) == [0, 2, 3, 4, 5]
    assert all(len(pipelines) == 1 for pipelines in owners.values())


def test_auto_lists_every_candidate_and_the_rate_changes_the_choice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*_base(_profile(tmp_path)), "--failed", "5"]
    rare = _plan(capsys, *args, "--failure-rate", "0.0001")
    frequent = _plan(capsys, *args, "--failure-rate", "100")
    for data in (rare, frequent):
        assert [c["policy"] for c in data["candidates"]] == ["reroute", "dynamic", "templates", "checkpoint"]
        for candidate in data["candidates"]:
            assert {"layout", "step_time_s", "transition_s", "score", "feasible", "reason"} <= set(candidate)
        best = max((c for c in data["candidates"] if c["feasible"]), key=lambda c: c["score"])
        assert data["policy"] == best["policy"]
    assert rare["policy"] in ("dynamic", "templates")
    assert frequent["policy"] == "reroute"
    rerouted = [s for p in frequent["pipelines"] for s in p["stages"] if "rerouted_from" in s]
    assert [s["rerouted_from"] for s in rerouted] == [5]


def test_human_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *_base(_profile(tmp_path)), "--failed", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("policy ") and "reroute" in out and "pipeline 0:" in out


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"--nodes": "0"}, "nodes"),
        ({"--ft": "8"}, "--ft"),
        ({"--global-batch": "63"}, "--global-batch"),
        ({"--profile": "/nonexistent/profile.json"}, "profile"),
        ({"--failed": "8"}, "failed"),
        ({"--failed": "1,x"}, "failed"),
        ({"--device-memory": str(GiB // 2)}, "--device-memory"),
        ({"--device-memory": "-1"}, "--device-memory"),
        ({"--device-memory": "80 GB"}, "--device-memory"),
        ({"--failure-rate": "-0.5"}, "--failure-rate"),
        ({"--microbatch-size": "0"}, "--microbatch-size"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    change: dict[str, str], field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _base(_profile(tmp_path))
    for flag, value in change.items():
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    assert main(["plan", *args, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in captured.err


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ("{not json", "profile"),
        (
            json.dumps(
                {
                    "layers": [
                        {
                            "forward_s": -1,
                            "backward_s": 0.1,
                            "param_bytes": 1,
                            "optimizer_bytes": 1,
                            "activation_bytes": 1,
                        }
                    ]
                }
            ),
            "forward_s",
        ),
        (json.dumps({"layers": []}), "layers"),
        (json.dumps([1, 2]), "profile"),
    ],
)
def test_malformed_profiles_exit_2(
    content: str, field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert main(["plan", *_base(str(path)), "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0]


def test_the_installed_command_never_prints_a_traceback(tmp_path: Path) -> None:
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "resilientjob.cli",
            "plan",
            *_base(_profile(tmp_path)),
            "--failed",
            "0",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["generation"] == 1
    bad = subprocess.run(
        [sys.executable, "-m", "resilientjob.cli", "plan", *_base(_profile(tmp_path)), "--ft", "-1"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "--ft" in bad.stderr and "Traceback" not in bad.stderr


def test_issue_14_reproducer_keeps_the_fault_tolerance(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--profile", "bert-large", "--nodes", "6", "--global-batch", "24", "--microbatch-size", "1"]
    data = _plan(capsys, *base, "--ft", "2", "--failed", "1")
    assert data["policy"] in ("dynamic", "templates") and len(data["pipelines"]) >= 3
    by_policy = {c["policy"]: c for c in data["candidates"]}
    assert not by_policy["reroute"]["feasible"] and "can hold 3" in by_policy["reroute"]["reason"]
    assert not by_policy["checkpoint"]["feasible"]
    saved = _plan(
        capsys,
        *base,
        "--ft",
        "2",
        "--failed",
        "1",
        "--checkpointing",
        "--step",
        "100",
        "--last-checkpoint-step",
        "90",
    )
    checkpoint = next(c for c in saved["candidates"] if c["policy"] == "checkpoint")
    assert checkpoint["feasible"] and "step 90, 10 steps redone" in checkpoint["reason"]
    assert (
        main(["plan", *base, "--ft", "2", "--failed", "1", "--step", "5", "--last-checkpoint-step", "9"]) == 2
    )
    assert "--last-checkpoint-step" in capsys.readouterr().err
