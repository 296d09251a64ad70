"""A profile only a pod can make (`hf:<dir>` without a profile, `spec.profile.measure`), against the real
operator process, an API server over HTTP and a real Redis; node 0's agent is the agent's own code
(`agent._model_profile.wait_for_first_plan`) run here on the workload its pod carries.

- The pods come up without a plan (`WaitingForProfile`); node 0 computes the profile from the model's
  config.json; the operator keeps it in the ConfigMap `<job>-profile` and plans generation 0 with it. A
  restarted operator with an emptied Redis plans again from the ConfigMap, asking nobody.
- Node 0 cannot read the model, or reports a profile that does not fit the model: the job fails naming why.
- `hf:<family>?k=v`: node 0 computes the profile of the configuration as transformers completes it.
- `measure: true`: node 0 times the layers of the model the runtime builds.
- `rjob local`: an `hf:<dir>` job with no profile and the default synthetic data gets its profile, a plan,
  and trains to the end (real agents started by the process kubelet).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from _rjob_stack import Stack, emulator_only, eventually, job_manifest, redis_client
from _support import rjob_local, until

from resilientjob.agent._model_profile import wait_for_first_plan
from resilientjob.agent.telemetry import Telemetry
from resilientjob.operator._profile_source import NODE0_FAILURES
from resilientjob.planner.hf_profile import profile_from_hf_config
from resilientjob.planner.profile import LayerProfile, ModelProfile
from resilientjob.protocol.messages import (
    MAX_PROFILE_BYTES,
    ModelProfileReport,
    ModelProfileRequest,
    PlanAnnouncement,
    encode,
)
from resilientjob.protocol.workload import WORKLOAD_ENV, Workload, load_workload

pytestmark = pytest.mark.cluster

transformers = pytest.importorskip("transformers")


def tiny_gpt2(directory: Path) -> Path:
    """GPT-2 with 2 blocks (4 layers: embedding, 2 blocks, head), long enough for the default data (16)."""
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


@pytest.fixture(autouse=True)
def _temporary_files_of_the_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 0's agent runs in this process: what it and `_pod_workload` make with `tempfile` lives in the
    test's directory (a pod's /tmp is its own), not in the host's /tmp for good."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


async def _status_where(stack: Stack, name: str, check: Any) -> dict[str, Any] | None:
    status = await stack.kube.job_status(name)
    return status if check(status) else None


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status.get("conditions", []) if c["type"] == kind)


async def _pod_workload(stack: Stack, name: str) -> Workload:
    pod = await stack.kube.get("pods", f"{name}-node-0")
    assert pod is not None
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    workload = load_workload(env[WORKLOAD_ENV])
    # The pod's checkpoint path is an emptyDir of its own (the process kubelet makes it so): here, in this
    # process, a fresh folder, or every job of the run would claim the host's /checkpoints.
    own = workload.checkpoint.model_copy(update={"path": tempfile.mkdtemp(prefix="rjob-checkpoints-")})
    return workload.model_copy(update={"checkpoint": own})


async def _waiting(stack: Stack, name: str, reason: str = "WaitingForProfile") -> dict[str, Any]:
    def check(status: dict[str, Any]) -> bool:
        planned = [c for c in status.get("conditions", []) if c["type"] == "Planned"]
        return bool(planned) and planned[0]["reason"] == reason

    return await eventually(lambda: _status_where(stack, name, check), 20, f"{name} waiting for its profile")


async def _node0(stack: Stack, name: str, stopped: asyncio.Event) -> PlanAnnouncement | None:
    """Node 0's agent between its start and the first plan, on the workload of its pod."""
    await eventually(lambda: stack.kube.get("pods", f"{name}-node-0"), 10, "node 0's pod")
    workload = await _pod_workload(stack, name)
    client = await redis_client(stack.redis_url)
    try:
        telemetry = Telemetry(client, stack.keys(name), 0, f"{name}-node-0")
        return await wait_for_first_plan(telemetry, stopped, workload, {})
    finally:
        await client.aclose()


async def test_node_0_computes_the_profile_the_operator_keeps_it_and_plans(
    stack: Stack, tmp_path: Path
) -> None:
    kube, name = stack.kube, "hfprof"
    model_dir = tiny_gpt2(tmp_path / "gpt2")
    await kube.create_job(job_manifest(name, model=f"hf:{model_dir}", profile=None))
    status = await _waiting(stack, name)
    assert status["planGeneration"] == -1 and status.get("phase", "Pending") == "Pending"
    assert "configuration" in _condition(status, "Planned")["message"]
    pods = await eventually(lambda: _pods_at(stack, name, "-1", 4), 20, "4 pods without a plan")
    assert len(pods) == 4

    stopped = asyncio.Event()
    node0 = asyncio.create_task(_node0(stack, name, stopped))
    published = await asyncio.wait_for(node0, 60)
    assert published is not None and published.generation == 0 and published.plan.num_layers == 4
    status = await eventually(
        lambda: _status_where(stack, name, lambda s: s.get("planGeneration") == 0), 20, "generation 0"
    )
    assert _condition(status, "Planned")["reason"] == "Planned"

    # The durable record: the profile node 0 computed from config.json, owned by the job.
    configmap = await kube.get("configmaps", f"{name}-profile")
    job = await kube.get("resilientjobs", name)
    assert configmap is not None and job is not None
    assert configmap["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert configmap["data"]["source"] == "computed"
    kept = ModelProfile.model_validate_json(configmap["data"]["profile.json"])
    config = json.loads((model_dir / "config.json").read_text())
    _computed_on_this_cpu(kept, profile_from_hf_config(config, seq_len=16, microbatch_size=1))
    reasons = {e.get("reason") for e in await kube.events_of(name)}
    assert {"WaitingForProfile", "ProfileReported"} <= reasons

    # It trains a model and names no checkpoint volume: told once that its restarts start over.
    async def node_local_warnings() -> list[dict[str, Any]] | None:
        events = [e for e in await kube.events_of(name) if e.get("reason") == "CheckpointNodeLocal"]
        return events or None

    warnings = await eventually(node_local_warnings, 10, "the CheckpointNodeLocal event")
    assert len(warnings) == 1 and warnings[0]["type"] == "Warning"
    assert "spec.checkpoint.volume" in warnings[0]["message"]
    for pod in await eventually(lambda: _pods_at(stack, name, "0", 4), 20, "pods on generation 0"):
        assert pod["metadata"]["annotations"]["resilientjob.io/layout"] == status["layout"]

    # The job's store runs in a pod of its own (no worker pod is special), owned by the job, never seen as
    # a node; gone, it is created again.
    store = await kube.get("pods", f"{name}-store")
    assert store is not None and store["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert store["metadata"]["labels"]["resilientjob.io/role"] == "store"
    assert "resilientjob.io/node" not in store["metadata"]["labels"]
    assert store["spec"]["containers"][0]["command"][-1] == "resilientjob.agent.store_host"
    await kube.delete("pods", f"{name}-store")

    async def recreated() -> dict[str, Any] | None:
        pod = await kube.get("pods", f"{name}-store")
        return pod if pod is not None and pod["metadata"]["uid"] != store["metadata"]["uid"] else None

    await eventually(recreated, 20, "the store pod created again")

    # A restarted operator and an emptied Redis: generation 0 again from the ConfigMap, nobody asked.
    stack.operator.kill()
    client = await redis_client(stack.redis_url)
    try:
        await client.flushall()
        stack.operator.start()
        keys = stack.keys(name)
        plan = await eventually(lambda: client.get(keys.plan), 30, "the plan re-published from the ConfigMap")
        assert PlanAnnouncement.model_validate_json(plan).plan.num_layers == 4
        assert await client.get(keys.profile_request) is None
    finally:
        await client.aclose()


async def _pods_at(stack: Stack, name: str, generation: str, count: int) -> list[dict[str, Any]] | None:
    pods = await stack.kube.job_pods(name)
    at = [p for p in pods if p["metadata"]["annotations"]["resilientjob.io/generation"] == generation]
    return at if len(at) == count else None


async def _failed(stack: Stack, name: str) -> dict[str, Any]:
    return await eventually(
        lambda: _status_where(stack, name, lambda s: s.get("phase") == "Failed"), 30, f"{name} failed"
    )


async def test_a_model_node_0_cannot_read_fails_the_job_naming_it(stack: Stack, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    await stack.kube.create_job(job_manifest("hfmissing", model=f"hf:{missing}", profile=None))
    await _waiting(stack, "hfmissing")
    stopped = asyncio.Event()
    node0 = asyncio.create_task(_node0(stack, "hfmissing", stopped))
    try:
        status = await _failed(stack, "hfmissing")
    finally:
        stopped.set()
        assert await asyncio.wait_for(node0, 10) is None  # no plan ever came: it stopped waiting
    valid = _condition(status, "Valid")
    assert valid["status"] == "False" and valid["reason"] == "InvalidWorkload", valid
    assert valid["message"].startswith("spec.model: ") and str(missing) in valid["message"]
    # The Reason column of `kubectl get rjob` says it too: no worker runs, and why.
    ready = _condition(status, "WorkersReady")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidWorkload"), ready
    assert ready["message"].startswith("no worker runs: the job failed: spec.model: "), ready
    assert await stack.kube.get("configmaps", "hfmissing-profile") is None
    assert await eventually(lambda: _no_pods(stack, "hfmissing"), 10, "the pods deleted")


async def _no_pods(stack: Stack, name: str) -> bool:
    return not await stack.kube.job_pods(name)


async def _failed_after_node0(stack: Stack, name: str) -> dict[str, Any]:
    """The job's status once it failed, with node 0's agent checking its workload meanwhile (it never
    sees a plan)."""
    stopped = asyncio.Event()
    node0 = asyncio.create_task(_node0(stack, name, stopped))
    try:
        return await _failed(stack, name)
    finally:
        stopped.set()
        assert await asyncio.wait_for(node0, 10) is None


async def test_data_node_0_finds_unusable_fails_the_job_before_any_plan(stack: Stack, tmp_path: Path) -> None:
    """A model with a profile (no profile to make) is still checked with its data: a token file shorter than
    one sample fails the job naming `spec.data.path`, nothing is planned and the pods go away."""
    name, short = "shortdata", tmp_path / "short.bin"
    np.arange(5, dtype=np.uint16).tofile(short)
    data = {"path": str(short), "format": "tokens", "dtype": "uint16", "seqLen": 16}
    await stack.kube.create_job(job_manifest(name, model="gpt", data=data))
    await eventually(lambda: _pods_at(stack, name, "-1", 4), 20, "4 pods without a plan")
    await _waiting(stack, name, "CheckingWorkload")
    status = await _failed_after_node0(stack, name)
    valid = _condition(status, "Valid")
    assert valid["reason"] == "InvalidWorkload" and valid["message"].startswith("spec.data.path: "), valid
    assert "short.bin" in valid["message"] and "\n" not in valid["message"]
    assert status["planGeneration"] == -1
    client = await redis_client(stack.redis_url)
    try:
        assert await client.get(stack.keys(name).plan) is None
    finally:
        await client.aclose()
    assert await eventually(lambda: _no_pods(stack, name), 10, "the pods deleted")
    assert "InvalidWorkload" in {e.get("reason") for e in await stack.kube.events_of(name)}


async def test_a_checked_workload_no_layout_can_run_fails_and_its_pods_go(stack: Stack) -> None:
    """Node 0 finds the model and data usable, then no layout fits `deviceMemory`: the job fails naming the
    field (Planned=False, PlanInfeasible) and the pods of the check are deleted, as a rejected workload's
    are (they held devices while the job could never train)."""
    name = "nomemory"
    await stack.kube.create_job(job_manifest(name, model="gpt", deviceMemory="1Ki"))
    await _waiting(stack, name, "CheckingWorkload")
    status = await _failed_after_node0(stack, name)
    planned = _condition(status, "Planned")
    assert planned["reason"] == "PlanInfeasible", planned
    assert planned["message"].startswith("spec.deviceMemory: the model does not fit"), planned["message"]
    assert _condition(status, "WorkersReady")["reason"] == "PlanInfeasible"
    assert _condition(status, "Valid")["status"] == "True" and status["planGeneration"] == -1
    assert await eventually(lambda: _no_pods(stack, name), 10, "the pods deleted")


async def test_garbage_is_dropped_and_a_profile_that_does_not_fit_fails_the_job(
    stack: Stack, tmp_path: Path
) -> None:
    name = "hfbad"
    model = f"hf:{tmp_path / 'm'}"
    await stack.kube.create_job(job_manifest(name, model=model, profile=None, microBatchSize=2))
    await _waiting(stack, name)
    keys = stack.keys(name)
    client = await redis_client(stack.redis_url)
    try:
        raw = await eventually(lambda: client.get(keys.profile_request), 10, "the profile request")
        request = ModelProfileRequest.model_validate_json(raw)
        manifest = job_manifest(name, model=model, profile=None, microBatchSize=2)["spec"]
        assert request == ModelProfileRequest(
            model=model, seq_len=16, microbatch_size=2, global_batch=manifest["globalBatchSize"]
        )
        # Garbage, and a report to another request: dropped, the job waits on (the operator counts drops in
        # its own process; its status tells).
        stale = request.model_copy(update={"seq_len": 8})
        layer = LayerProfile(
            forward_s=0.1, backward_s=0.2, param_bytes=1, optimizer_bytes=2, activation_bytes=1
        )
        for raw_report in (
            b"{not json",
            b"x" * (MAX_PROFILE_BYTES + 1),
            encode(
                ModelProfileReport(
                    request=stale,
                    node=0,
                    num_layers=4,
                    profile=ModelProfile(layers=(layer,) * 4),
                    sent_at=0.0,
                )
            ),
        ):
            await client.set(keys.profile_report, raw_report)
            await asyncio.sleep(1.0)
            assert _condition(await stack.kube.job_status(name), "Planned")["reason"] == "WaitingForProfile"
        report = ModelProfileReport(
            request=request,
            node=0,
            num_layers=4,
            profile=ModelProfile(layers=(layer,) * 3),
            sent_at=0.0,
        )
        await client.set(keys.profile_report, encode(report))
        status = await _failed(stack, name)
    finally:
        await client.aclose()
    planned = _condition(status, "Planned")
    assert planned["reason"] == "ProfileFailed" and "3 layers" in planned["message"]


@emulator_only("it fails node 0's pod by writing its phase; a kubelet would undo it")
async def test_node_0_failing_is_re_created_then_the_job_fails_naming_it(
    stack: Stack, tmp_path: Path
) -> None:
    name, kube = "hfcrash", stack.kube
    await kube.create_job(job_manifest(name, model=f"hf:{tmp_path / 'm'}", profile=None))
    await _waiting(stack, name)
    failed: set[str] = set()
    for _ in range(NODE0_FAILURES):

        async def fresh() -> dict[str, Any] | None:
            pod = await kube.get("pods", f"{name}-node-0")
            return pod if pod is not None and pod["metadata"]["uid"] not in failed else None

        pod = await eventually(fresh, 10, "node 0's pod (re-)created")
        failed.add(pod["metadata"]["uid"])
        await kube.api.patch(
            kube.path("pods", f"{name}-node-0", status=True),
            {"status": {"phase": "Failed", "reason": "Evicted"}},
        )
    status = await _failed(stack, name)
    planned = _condition(status, "Planned")
    assert planned["reason"] == "ProfileFailed" and planned["message"].startswith("spec.model")
    assert f"failed {NODE0_FAILURES} times" in planned["message"] and "Evicted" in planned["message"]
    recreated = [e for e in await kube.events_of(name) if "re-created" in e.get("message", "")]
    assert len(recreated) == NODE0_FAILURES - 1


async def test_an_hf_configuration_is_profiled_as_transformers_completes_it(stack: Stack) -> None:
    name, model = "hfconf", "hf:gpt2?n_layer=3&n_embd=32&n_head=2&vocab_size=64&n_positions=16"
    await stack.kube.create_job(job_manifest(name, model=model, profile=None))
    await _waiting(stack, name)
    published = await asyncio.wait_for(_node0(stack, name, asyncio.Event()), 60)
    assert published is not None and published.plan.num_layers == 5  # embedding, 3 blocks, head
    configmap = await stack.kube.get("configmaps", f"{name}-profile")
    assert configmap is not None
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=16).to_dict()
    kept = ModelProfile.model_validate_json(configmap["data"]["profile.json"])
    _computed_on_this_cpu(kept, profile_from_hf_config(config, seq_len=16))


async def test_measure_times_the_model_the_runtime_builds(stack: Stack) -> None:
    name = "measured"
    await stack.kube.create_job(job_manifest(name, model="gpt", profile={"measure": True}))
    await _waiting(stack, name)
    stopped = asyncio.Event()
    published = await asyncio.wait_for(_node0(stack, name, stopped), 120)
    assert published is not None and published.generation == 0
    configmap = await stack.kube.get("configmaps", f"{name}-profile")
    assert configmap is not None and configmap["data"]["source"] == "measured"
    measured = ModelProfile.model_validate_json(configmap["data"]["profile.json"])
    assert measured.num_layers == published.plan.num_layers
    assert all(layer.forward_s > 0 and layer.param_bytes > 0 for layer in measured.layers)


# ---- the local stack: real agents ------------------------------------------------------------------------
@pytest.fixture
def local(tmp_path: Path) -> Iterator[Path]:
    state = tmp_path / "local"
    up = rjob_local(state, "up")
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield state
    finally:
        rjob_local(state, "down")


def _api(state: Path, path: str) -> dict[str, Any] | None:
    base = json.loads((state / "state.json").read_text())["api_url"]
    try:
        with urllib.request.urlopen(f"{base}{path}", timeout=10) as response:
            return json.loads(response.read())  # type: ignore[no-any-return]
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise


@pytest.mark.torch
@pytest.mark.slow
@emulator_only("`rjob local` is the embedded stack: it starts its own emulator, Redis and kubelet")
def test_an_hf_directory_job_gets_its_profile_from_node_0_and_trains(local: Path, tmp_path: Path) -> None:
    model_dir = tiny_gpt2(tmp_path / "gpt2")
    steps = 6
    manifest = {
        "apiVersion": "resilientjob.io/v1alpha1",
        "kind": "ResilientJob",
        "metadata": {"name": "hfdir", "namespace": "default"},
        "spec": {
            "image": "resilientjob/worker:latest",
            "command": ["python", "-m", "resilientjob.agent", "--collective-timeout", "10"],
            "model": f"hf:{model_dir}",
            "nodes": 2,
            "globalBatchSize": 4,
            "microBatchSize": 1,
            "faultTolerance": 0,
            "training": {"steps": steps, "lr": 0.003},
            "failSlow": {"enabled": False},
        },
    }
    path = tmp_path / "hfdir.yaml"
    path.write_text(yaml.safe_dump(manifest))
    applied = rjob_local(local, "apply", "-f", str(path))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    job_path = "/apis/resilientjob.io/v1alpha1/namespaces/default/resilientjobs/hfdir"

    def phase() -> str | None:
        status = (_api(local, job_path) or {}).get("status") or {}
        return status.get("phase") if status.get("phase") in ("Succeeded", "Failed") else None

    assert until(phase, 240, "the job to finish") == "Succeeded", _api(local, job_path)
    status = (_api(local, job_path) or {})["status"]
    assert status["planGeneration"] == 0 and status["step"] == steps and status["loss"] > 0, status
    configmap = _api(local, "/api/v1/namespaces/default/configmaps/hfdir-profile")
    assert configmap is not None and configmap["data"]["source"] == "computed"
    assert ModelProfile.model_validate_json(configmap["data"]["profile.json"]).num_layers == 4


def _computed_on_this_cpu(kept: ModelProfile, nominal: ModelProfile) -> None:
    """`kept` is `nominal` priced at a CPU's speed: the same layers and bytes, every time scaled by one
    factor above 1 (the pods are CPU processes: not the accelerator's nominal speed)."""
    untimed = {"forward_s": 0.0, "backward_s": 0.0}
    assert [a.model_copy(update=untimed) for a in kept.layers] == [
        b.model_copy(update=untimed) for b in nominal.layers
    ]
    scale = kept.layers[0].forward_s / nominal.layers[0].forward_s
    assert scale > 1
    for a, b in zip(kept.layers, nominal.layers, strict=True):
        assert a.forward_s == pytest.approx(b.forward_s * scale) and a.backward_s == pytest.approx(
            b.backward_s * scale
        )
