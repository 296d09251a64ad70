"""`rjob plan -f MANIFEST`: the operator's own plan of a ResilientJob manifest, its flags as edits of the
spec, every way of giving a profile, and one-line errors naming the file and the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from resilientjob.cli import main

LAYER = {
    "forwardS": 0.01,
    "backwardS": 0.02,
    "paramBytes": 2**28,
    "optimizerBytes": 2**29,
    "activationBytes": 2**26,
}


def _job(name: str = "planned", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "image": "resilientjob/worker:test",
        "model": "gpt",
        "profile": {"inline": [dict(LAYER, name=f"l{i}") for i in range(12)]},
        "nodes": 8,
        "globalBatchSize": 64,
        "microBatchSize": 2,
        "faultTolerance": 1,
        "deviceMemory": "8Gi",
    }
    body.update(spec)
    return {
        "apiVersion": "resilientjob.io/v1alpha1",
        "kind": "ResilientJob",
        "metadata": {"name": name},
        "spec": body,
    }


def _write(tmp_path: Path, *documents: dict[str, Any]) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump_all(documents))
    return str(path)


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, "--json"]) == 0, capsys.readouterr().err
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    return data


def _error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["plan", *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1 and "Traceback" not in captured.err, captured
    return lines[0]


def _same_job_by_flags(tmp_path: Path, **flags: str) -> list[str]:
    profile = tmp_path / "profile.json"
    layers = [
        {
            "name": f"l{i}",
            "forward_s": LAYER["forwardS"],
            "backward_s": LAYER["backwardS"],
            "param_bytes": LAYER["paramBytes"],
            "optimizer_bytes": LAYER["optimizerBytes"],
            "activation_bytes": LAYER["activationBytes"],
        }
        for i in range(12)
    ]
    profile.write_text(json.dumps({"name": "gpt", "layers": layers}))
    args = {"--profile": str(profile), "--nodes": "8", "--global-batch": "64", "--microbatch-size": "2"}
    args |= {"--ft": "1", "--device-memory": "8Gi"} | flags
    return [part for pair in args.items() for part in pair]


def test_a_manifest_plans_as_its_flags_do_and_names_the_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = _write(tmp_path, _job())
    planned = _plan(capsys, "-f", manifest)
    by_flags = _plan(capsys, *_same_job_by_flags(tmp_path))
    assert planned["job"] == {"name": "planned", "profile": "spec.profile.inline (12 layers)"}
    # 12 layers of 0.75 GiB state do not fit an 8 GiB device whole: pipelines of several stages.
    assert planned["layout"] == by_flags["layout"] and "PP[1" not in planned["layout"]
    assert planned["step_time_s"] == pytest.approx(by_flags["step_time_s"])

    recovered = _plan(capsys, "-f", manifest, "--failed", "1,5", "--step", "500")
    assert recovered["generation"] == 1 and recovered["failed_nodes"] == [1, 5]
    used = {node for p in recovered["pipelines"] for s in p["stages"] for node in s["nodes"]}
    assert used <= set(range(8)) - {1, 5}
    # No checkpoint volume: a restart is priced as starting over, all 500 steps redone.
    restart = next(c for c in recovered["candidates"] if c["policy"] == "checkpoint")
    assert "500 steps" in restart["reason"], restart


def test_the_manifests_checkpoint_volume_prices_the_restart_from_its_last_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shared = {"volume": "ckpt", "path": "/ckpt", "intervalSteps": 100}
    manifest = _write(tmp_path, _job(checkpoint=shared, policy="checkpoint"))
    recovered = _plan(capsys, "-f", manifest, "--failed", "1", "--step", "550")
    restart = next(c for c in recovered["candidates"] if c["policy"] == "checkpoint")
    assert restart["feasible"] and "50 steps" in restart["reason"], restart


def test_flags_edit_the_manifests_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = _write(tmp_path, _job())
    wider = _plan(capsys, "-f", manifest, "--nodes", "12", "--device-memory", "80Gi")
    nodes = {node for p in wider["pipelines"] for s in p["stages"] for node in s["nodes"]}
    assert nodes == set(range(12))
    rerouted = _plan(capsys, "-f", manifest, "--policy", "reroute", "--failed", "3")
    assert rerouted["policy"] == "reroute" and [c["policy"] for c in rerouted["candidates"]] == ["reroute"]
    line = _error(capsys, "-f", manifest, "--nodes", "0")
    assert line.startswith(f"rjob: error: {manifest} document 1 (resilientjob/planned): spec.nodes"), line
    line = _error(capsys, "-f", manifest, "--global-batch", "63")
    assert "spec.globalBatchSize" in line or "spec.microBatchSize" in line, line


def test_a_profile_in_a_configmap_of_the_same_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    layers = [
        {
            "forward_s": 0.01,
            "backward_s": 0.02,
            "param_bytes": 2**20,
            "optimizer_bytes": 2**21,
            "activation_bytes": 1,
        }
    ] * 6
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "gpt-profile"},
        "data": {"layers.yaml": yaml.safe_dump({"layers": layers})},
    }
    job = _job(profile={"configMapRef": {"name": "gpt-profile", "key": "layers.yaml"}})
    planned = _plan(capsys, "-f", _write(tmp_path, configmap, job))
    assert planned["job"]["profile"] == "ConfigMap gpt-profile key layers.yaml"
    assert sum(s["layers"][1] - s["layers"][0] for s in planned["pipelines"][0]["stages"]) == 6

    line = _error(capsys, "-f", _write(tmp_path, job))
    assert "spec.profile.configMapRef: ConfigMap 'gpt-profile' is not in this file" in line, line
    configmap["data"] = {"other": "x"}
    line = _error(capsys, "-f", _write(tmp_path, configmap, job))
    assert "spec.profile.configMapRef" in line and "no key 'layers.yaml'" in line, line


def test_a_measured_profile_needs_the_profile_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = _write(tmp_path, _job(profile={"measure": True}))
    line = _error(capsys, "-f", manifest)
    assert "spec.profile.measure" in line and "--profile" in line, line
    planned = _plan(capsys, "-f", manifest, "--profile", "bert-large")
    assert planned["job"]["profile"] == "--profile bert-large"
    assert sum(s["layers"][1] - s["layers"][0] for s in planned["pipelines"][0]["stages"]) == 26


def test_a_hugging_face_directory_is_profiled_from_its_config_as_node_0_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    config.save_pretrained(tmp_path / "gpt2")
    manifest = _write(tmp_path, _job(model=f"hf:{tmp_path / 'gpt2'}", profile=None, deviceMemory=None))
    planned = _plan(capsys, "-f", manifest)
    assert planned["job"]["profile"].startswith("computed from the model's config")
    assert "CPU" in planned["job"]["profile"]  # deviceResource none: the CPU's own speed
    # The runtime's layers: embedding, 3 blocks, head.
    assert all(sum(s["layers"][1] - s["layers"][0] for s in p["stages"]) == 5 for p in planned["pipelines"])

    gone = _write(tmp_path, _job(model=f"hf:{tmp_path / 'nowhere'}", profile=None))
    line = _error(capsys, "-f", gone)
    assert "spec.model" in line and "nowhere" in line and "--profile" in line, line
    # Samples longer than a configuration's 16 positions: the data's field to change, as node 0 would say.
    long = {"format": "synthetic", "seqLen": 64}
    configuration = "hf:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=64&n_positions=16"
    line = _error(capsys, "-f", _write(tmp_path, _job(model=configuration, profile=None, data=long)))
    assert "spec.data.seqLen: " in line and "--profile" not in line, line


@pytest.mark.parametrize(
    ("documents", "expected"),
    [
        ([_job("a"), _job("b")], "holds 2 ResilientJobs (a, b)"),
        (
            [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}],
            "no ResilientJob in the file",
        ),
        ([_job(nodes="many")], "spec.nodes"),
        ([_job(model="synthetic:no-such-profile", profile=None)], "no-such-profile"),
    ],
)
def test_a_manifest_it_cannot_plan_is_one_line(
    documents: list[dict[str, Any]], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert expected in _error(capsys, "-f", _write(tmp_path, *documents))


def test_checkpoint_flags_are_the_manifests_own(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _error(capsys, "-f", _write(tmp_path, _job()), "--checkpointing")
    assert line.startswith("rjob: error: --checkpointing: not with -f"), line
    line = _error(capsys, "-f", _write(tmp_path, _job()), "--last-checkpoint-step", "0")
    assert line.startswith("rjob: error: --last-checkpoint-step: not with -f"), line
    assert "--gpus-per-node" in _error(capsys, *_same_job_by_flags(tmp_path, **{"--gpus-per-node": "0"}))
    assert "--profile: required without -f" in _error(capsys, "--nodes", "3")


def test_human_output_gives_units_and_no_figures_for_candidates_that_cannot_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Six nodes in pipelines of 8 GiB stages: node 2 fails, a re-route would keep one replica of its layers
    # where the five left can hold two (f + 1): that candidate cannot run.
    assert main(["plan", "-f", _write(tmp_path, _job(nodes=6)), "--failed", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("job planned: profile spec.profile.inline")
    assert "samples/s" in out.splitlines()[1]
    marks = [line.strip()[:5] for line in out.splitlines() if line.strip().startswith("[")]
    assert "[n/a]" in marks and "[ok ]" in marks, out
    for line in out.splitlines():
        if line.strip().startswith("[n/a]"):
            assert "step" not in line and "effective" not in line, line
        if line.strip().startswith("[ok ]"):
            assert "effective" in line and "samples/s" in line, line
    assert "Odyssey eq. 8" in out.splitlines()[-1]
