"""Generated files never drift from their sources: the chart's CRD copy (scripts/gen_crds.py), the raw
manifests under deploy/ (scripts/render_deploy.py, rendered from the chart) and docs/crd-reference.md
(scripts/gen_docs.py). The raw manifests are also built with kustomize and validated, and the example jobs
are validated against the CRD schema and the operator's own parser, and planned."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from _chart import ROOT, crd_schemas, load_script, tool, validate

from resilientjob.operator import api
from resilientjob.operator.planning import plan_initial, plan_next, planner_inputs, profile_from_pod
from resilientjob.planner.profile import ModelProfile

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("script", ["gen_crds", "render_deploy", "gen_docs"])
def test_generated_files_are_current(script: str) -> None:
    module = load_script(script)
    generated = module.outputs() if hasattr(module, "outputs") else {module.TARGET: module.render()}
    for path, text in generated.items():
        assert (ROOT / path).read_text() == text, f"{path} is stale: run scripts/{script}.py"


def test_check_flags_report_drift(tmp_path: Path) -> None:
    # --check really compares: a copy of the repository layout with a stale file fails it.
    module = load_script("gen_docs")
    module.ROOT = tmp_path
    (tmp_path / "docs").mkdir()
    (tmp_path / module.TARGET).write_text("stale\n")
    assert module.main(["--check"]) == 1
    assert module.main([]) == 0 and module.main(["--check"]) == 0


def _kustomize(folder: str) -> list[dict[str, object]]:
    done = subprocess.run(
        [str(tool("kubectl")), "kustomize", str(ROOT / "deploy" / folder)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def test_kustomize_builds_and_validates() -> None:
    crds = _kustomize("crds")
    assert {d["metadata"]["name"] for d in crds} == {
        f"{api.PLURAL}.{api.GROUP}",
        "kopfpeerings.kopf.dev",
        "clusterkopfpeerings.kopf.dev",
    }
    base = _kustomize("base")
    kinds = {d["kind"] for d in base}
    assert {"Namespace", "Deployment", "Role", "ClusterRole", "KopfPeering", "Service"} <= kinds
    assert "CustomResourceDefinition" not in kinds and "Secret" not in kinds
    for doc in crds + base:
        validate(doc)
    deployment = next(
        d for d in base if d["kind"] == "Deployment" and d["metadata"]["name"] == "resilientjob"
    )
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}  # type: ignore[index]
    assert env["RJOB_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "resilientjob-redis"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_are_valid_jobs(path: Path) -> None:
    manifest = yaml.safe_load(path.read_text())
    validate(manifest)  # the CRD's openAPIV3Schema
    spec = api.parse_spec(manifest["spec"])  # and the operator's parser (CEL rules included)
    referenced = None
    if profile_from_pod(spec) or (spec.profile is not None and spec.profile.config_map_ref is not None):
        # The profile node 0 computes from the example's config.json (or its ConfigMap holds) is the
        # built-in profile of the same architecture.
        referenced = ModelProfile.load(manifest["metadata"]["name"]).model_dump()
    plan_initial(spec, planner_inputs(spec, referenced))  # and the planner finds a layout for it


def test_examples_cover_cpu_gpu_and_ascend() -> None:
    devices = {yaml.safe_load(p.read_text())["spec"].get("deviceResource", "none") for p in EXAMPLES}
    assert devices >= {"none", "nvidia.com/gpu", "huawei.com/Ascend910"}
    assert (api.API_VERSION, api.KIND) in crd_schemas()


def test_schema_validation_rejects_a_bad_example() -> None:
    manifest = yaml.safe_load(EXAMPLES[0].read_text())
    manifest["spec"]["deviceResource"] = "amd.com/gpu"
    with pytest.raises(Exception, match=re.escape("amd.com/gpu")):
        validate(manifest)


def test_demo_job_is_pipelined_and_a_kill_copies_layers() -> None:
    # `rjob demo` kills worker 2: the demo is only worth watching if that leads to a peer-to-peer copy.
    manifest = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    assert manifest["spec"]["chaos"]["enabled"] is True
    spec = api.parse_spec(manifest["spec"])
    inputs = planner_inputs(spec)
    initial = plan_initial(spec, inputs)
    assert any(len(pipeline.stages) > 1 for pipeline in initial.pipelines), initial.layout
    after = plan_next(spec, inputs, initial, failed=[2])
    assert 2 not in after.nodes
    assert after.transfers and all(t.src != 2 and t.dst != 2 and t.bytes > 0 for t in after.transfers)
