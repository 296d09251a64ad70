"""`rjob simulate`: the JSON contract, determinism, plots and one-line errors (exit 2) on the real planner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resilientjob.cli import main

SMALL = [
    "simulate",
    "--nodes",
    "8",
    "--hours",
    "2",
    "--failure-rate",
    "0.1",
    "--profile",
    "gpt3-2.7b",
    "--global-batch",
    "32",
    "--planning-s",
    "0.05",
    "--seed",
    "3",
]


def _run(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, object]:
    assert main([*SMALL, *extra, "--json"]) == 0
    payload: dict[str, object] = json.loads(capsys.readouterr().out)
    return payload


def test_all_policies_report_the_contract_keys(capsys: pytest.CaptureFixture[str]) -> None:
    payload = _run(capsys, "--policy", "all")
    policies = payload["policies"]
    assert isinstance(policies, dict)
    assert set(policies) == {"adaptive", "templates", "reroute", "checkpoint", "redundant"}
    for entry in policies.values():
        assert {"avg_throughput", "samples", "active_nodes_timeline", "recoveries"} <= set(entry)
        assert entry["avg_throughput"] == pytest.approx(entry["samples"] / 7200.0)
        assert entry["active_nodes_timeline"][0] == [0.0, 8]
        assert entry["avg_throughput"] <= entry["failure_free_throughput"] + 1e-9


def test_same_seed_same_result(capsys: pytest.CaptureFixture[str]) -> None:
    first = _run(capsys, "--policy", "adaptive")
    second = _run(capsys, "--policy", "adaptive")
    other = _run(capsys, "--policy", "adaptive", "--seed", "4")
    for payload in (first, second, other):
        payload.pop("wall_s")
        payload.pop("plan_cache_hits")
        payload.pop("planner_calls")
    assert first == second
    assert first["policies"] != other["policies"]


def test_seeds_report_mean_and_spread(capsys: pytest.CaptureFixture[str]) -> None:
    payload = _run(capsys, "--policy", "reroute", "--seeds", "3")
    entry = payload["policies"]["reroute"]  # type: ignore[index]
    per_seed = entry["avg_throughput_per_seed"]
    assert len(per_seed) == 3
    assert entry["avg_throughput"] == pytest.approx(sum(per_seed) / 3)


def test_plot_writes_a_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "out.png"
    payload = _run(capsys, "--policy", "adaptive,reroute", "--plot", str(target))
    assert payload["plot"] == str(target)
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_spot_trace_replays_joins(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "simulate",
        "--nodes",
        "32",
        "--failure-rate",
        "0",
        "--profile",
        "bert-large",
        "--global-batch",
        "128",
        "--planning-s",
        "0.05",
        "--trace",
        "spot",
        "--hours",
        "2",
        "--policy",
        "dynamic",
        "--json",
    ]
    assert main(args) == 0
    entry = json.loads(capsys.readouterr().out)["policies"]["dynamic"]
    causes = [r["cause"] for r in entry["recoveries"]]
    # The shipped trace's first two hours: preemptions and at least one node coming back.
    assert "leave" in causes and "join" in causes
    nodes = [count for _, count in entry["active_nodes_timeline"]]
    assert nodes[0] == 32 and min(nodes) < 32


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--nodes", "0"], "nodes"),
        (["--failure-rate", "-1"], "--failure-rate"),
        (["--policy", "magic"], "policy"),
        (["--hours", "0"], "hours"),
        (["--trace", "/nonexistent.csv"], "trace"),
        (["--profile", "/nonexistent.json"], "profile"),
        (["--global-batch", "33", "--microbatch-size", "2"], "global_batch"),
        (["--seeds", "0"], "seeds"),
        (["--device-memory", "80 GB"], "--device-memory"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], flags: list[str], field: str
) -> None:
    assert main(["simulate", "--hours", "1", *flags, "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert field in err


def test_device_memory_is_a_quantity_as_in_the_spec(capsys: pytest.CaptureFixture[str]) -> None:
    """`80Gi` as `spec.deviceMemory`, `rjob plan` and `rjob templates` take it, and the same as its bytes."""
    quantity = _run(capsys, "--policy", "adaptive", "--device-memory", "80Gi")
    in_bytes = _run(capsys, "--policy", "adaptive", "--device-memory", str(80 * 2**30))
    assert quantity["policies"] == in_bytes["policies"]
