"""The process kubelet's copies of the pod contract agree with the operator that writes it and the agent that
reads it (the local stack imports neither: `resilientjob.localstack.kubelet` repeats the names)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from resilientjob.agent import store_host
from resilientjob.localstack import kubelet
from resilientjob.localstack._warm_start import AGENT_WARM_START
from resilientjob.operator import _manifests
from resilientjob.protocol import workload


def test_the_kubelet_uses_the_operators_labels_and_env_names() -> None:
    assert kubelet.LABEL_MANAGED_BY == _manifests.LABEL_MANAGED_BY
    assert kubelet.MANAGER == _manifests.MANAGER
    assert kubelet.AGENT_METRICS_ENV == _manifests.AGENT_METRICS_ENV
    assert kubelet.STORE_PORT_ENV == store_host.STORE_PORT_ENV
    assert kubelet.WORKLOAD_ENV == workload.WORKLOAD_ENV
    assert kubelet.HOST_TMP == _manifests.SCRATCH_DIR
    # The warm interpreter imports under the scratch variables every pod gets (TMPDIR differs per pod).
    assert dict(AGENT_WARM_START.env) == {k: v for k, v in _manifests.SCRATCH_ENV.items() if k != "TMPDIR"}


def test_the_downward_api_file_is_one_quoted_line_per_key_sorted() -> None:
    text = kubelet.downward_annotations_text({"b": 'say "hi"', "a": "1"})
    assert text == 'a="1"\nb="say \\"hi\\""\n'


def _pod(uid: str, checkpoint_volume: dict[str, object]) -> dict[str, object]:
    volumes = [{"name": "scratch", "emptyDir": {}}, {"name": "checkpoint", **checkpoint_volume}]
    mounts = [{"name": "scratch", "mountPath": "/tmp"}, {"name": "checkpoint", "mountPath": "/checkpoints"}]
    return {"metadata": {"uid": uid}, "spec": {"volumes": volumes, "containers": [{"volumeMounts": mounts}]}}


def test_an_empty_dir_is_the_pods_own_and_its_workload_paths_move_into_it(tmp_path: Path) -> None:
    """Two pods (two jobs, or two nodes of one) never share an emptyDir's files, as on a cluster; a path
    under /tmp (the pod's own only as its TMPDIR) and claims stay the host's paths."""
    raw = json.dumps(
        {"model": "gpt", "checkpoint": {"path": "/checkpoints"}, "output": {"path": "/checkpoints/final"}}
    )
    first = kubelet._empty_dirs(_pod("u1", {"emptyDir": {}}), tmp_path / "a")
    assert sorted(first) == ["/checkpoints", "/tmp"] and first["/checkpoints"].is_dir()
    assert first["/tmp"].is_dir() and first["/tmp"] != first["/checkpoints"]
    moved = json.loads(kubelet._workload_in_volumes(raw, first))
    assert moved["checkpoint"]["path"] == str(first["/checkpoints"])
    assert moved["output"]["path"] == str(first["/checkpoints"] / "final")
    other = kubelet._empty_dirs(_pod("u2", {"emptyDir": {}}), tmp_path / "b")
    assert other["/checkpoints"] != first["/checkpoints"]
    # A later pod of the same name (same directory) starts with an empty volume.
    (first["/checkpoints"] / "step10").mkdir()
    again = kubelet._empty_dirs(_pod("u3", {"emptyDir": {}}), tmp_path / "a")
    assert not first["/checkpoints"].exists() and not any(again["/checkpoints"].iterdir())
    # A claim is the host's path; so is anything under /tmp.
    claimed = kubelet._empty_dirs(_pod("u4", {"persistentVolumeClaim": {"claimName": "c"}}), tmp_path / "c")
    assert list(claimed) == ["/tmp"] and kubelet._workload_in_volumes(raw, claimed) == raw
    in_tmp = json.dumps({"model": "gpt", "checkpoint": {"path": "/tmp/ckpt"}})
    assert json.loads(kubelet._workload_in_volumes(in_tmp, first))["checkpoint"]["path"] == "/tmp/ckpt"


async def test_a_deleted_pods_empty_dirs_go_with_it(tmp_path: Path) -> None:
    """Replacement pods get new names, so a dead pod's emptyDir (its checkpoints, on the local stack) was
    never removed; a kubelet removes it with the pod. Its /tmp scratch volume is its TMPDIR: what it made
    with `tempfile` (a killed agent's working directory) goes with it too."""
    import asyncio
    import sys

    import kopf
    from _rjob_stack import NAMESPACE, Kube, api_server, eventually

    from resilientjob.operator.kube import core_path

    async with api_server() as (_, url):
        kube = Kube(kopf.ConnectionInfo(server=url, insecure=True, default_namespace=NAMESPACE))
        stopped = asyncio.Event()
        runner = asyncio.create_task(kubelet.ProcessKubelet(kube.api, tmp_path / "kubelet").run(stopped))
        made_and_slept = "import tempfile, time; print(tempfile.mkdtemp(), flush=True); time.sleep(60)"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "holder", "labels": {kubelet.LABEL_MANAGED_BY: kubelet.MANAGER}},
            "spec": {
                "volumes": [{"name": "data", "emptyDir": {}}, {"name": "scratch", "emptyDir": {}}],
                "containers": [
                    {
                        "name": "c",
                        "command": [sys.executable, "-c", made_and_slept],
                        "env": [{"name": "TMPDIR", "value": "/tmp"}],  # as the operator's pods say
                        "volumeMounts": [
                            {"name": "data", "mountPath": "/data"},
                            {"name": "scratch", "mountPath": "/tmp"},
                        ],
                    }
                ],
            },
        }
        try:
            await kube.api.create(core_path(NAMESPACE, "pods"), pod)
            root = tmp_path / "kubelet" / "pods"

            async def volumes(present: bool) -> bool:
                found = any(root.glob("*/volumes/*/data"))
                return found == present

            await eventually(lambda: volumes(True), 20, "the pod's emptyDir")
            log = kubelet.pod_directory(root, NAMESPACE, "holder") / "log"

            async def made() -> bool:
                return log.exists() and log.read_text().endswith("\n")

            await eventually(made, 20, "the pod's temporary directory")
            temporary = Path(log.read_text().strip())
            assert temporary.is_dir() and temporary.is_relative_to(root), temporary
            await kube.delete("pods", "holder")
            await eventually(lambda: volumes(False), 20, "the emptyDir gone with the pod")
            assert not temporary.exists()
        finally:
            stopped.set()
            await asyncio.wait({runner}, timeout=15)
            await kube.close()


async def test_a_new_pod_under_an_old_name_has_its_own_log(tmp_path: Path) -> None:
    """A pod deleted and created again under its name (a job re-applied) is a new pod: its log holds its
    own output only, as a kubelet's would."""
    import asyncio
    import sys

    import kopf
    from _rjob_stack import NAMESPACE, Kube, api_server, eventually

    from resilientjob.operator.kube import core_path

    def pod(says: str) -> dict[str, object]:
        code = f"print({says!r}, flush=True); import time; time.sleep(60)"
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "talker", "labels": {kubelet.LABEL_MANAGED_BY: kubelet.MANAGER}},
            "spec": {"containers": [{"name": "c", "command": [sys.executable, "-c", code]}]},
        }

    async with api_server() as (_, url):
        kube = Kube(kopf.ConnectionInfo(server=url, insecure=True, default_namespace=NAMESPACE))
        stopped = asyncio.Event()
        runner = asyncio.create_task(kubelet.ProcessKubelet(kube.api, tmp_path / "kubelet").run(stopped))
        log = kubelet.pod_directory(tmp_path / "kubelet" / "pods", NAMESPACE, "talker") / "log"

        async def logged(text: str) -> bool:
            return log.exists() and text in log.read_text()

        try:
            await kube.api.create(core_path(NAMESPACE, "pods"), pod("first pod"))
            await eventually(lambda: logged("first pod"), 20, "the first pod's output")
            await kube.delete("pods", "talker")

            async def gone() -> bool:
                return await kube.get("pods", "talker") is None

            await eventually(gone, 20, "the first pod gone")
            await kube.api.create(core_path(NAMESPACE, "pods"), pod("second pod"))
            await eventually(lambda: logged("second pod"), 20, "the second pod's output")
            assert "first pod" not in log.read_text()
        finally:
            stopped.set()
            await asyncio.wait({runner}, timeout=15)
            await kube.close()


async def test_a_shell_wrapped_python_is_this_environments(tmp_path: Path) -> None:
    """An Ascend worker's command reaches `python` through a shell (`_manifests._worker_command`): the
    image's python is this environment's there too (the host's bare python, without the project, made the
    Ascend example fail `ProfileFailed` on the local stack)."""
    import asyncio
    import sys

    import kopf
    from _rjob_stack import NAMESPACE, Kube, api_server, eventually

    from resilientjob.operator import api
    from resilientjob.operator.kube import core_path

    spec = api.ResilientJobSpec.model_validate(
        {"nodes": 2, "model": "gpt", "image": "i", "globalBatchSize": 8, "microBatchSize": 1,
         "deviceResource": "huawei.com/Ascend910",
         "command": ["python", "-c", "import sys; print('prefix', sys.prefix, flush=True)"]}
    )  # fmt: skip
    command = _manifests._worker_command(spec)
    assert command[:2] == ["sh", "-c"] and "python" in command[2:]
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "wrapped", "labels": {kubelet.LABEL_MANAGED_BY: kubelet.MANAGER}},
        "spec": {"containers": [{"name": "c", "command": command}]},
    }
    async with api_server() as (_, url):
        kube = Kube(kopf.ConnectionInfo(server=url, insecure=True, default_namespace=NAMESPACE))
        stopped = asyncio.Event()
        runner = asyncio.create_task(kubelet.ProcessKubelet(kube.api, tmp_path / "kubelet").run(stopped))
        log = kubelet.pod_directory(tmp_path / "kubelet" / "pods", NAMESPACE, "wrapped") / "log"

        async def printed() -> bool:
            return log.exists() and "prefix" in log.read_text()

        try:
            await kube.api.create(core_path(NAMESPACE, "pods"), body)
            await eventually(printed, 20, "the wrapped python's output")
            assert f"prefix {sys.prefix}" in log.read_text()
        finally:
            stopped.set()
            await asyncio.wait({runner}, timeout=15)
            await kube.close()


@pytest.mark.parametrize("policy", ["FallbackToLogsOnError", "File"])
async def test_a_failure_without_last_words_is_told_by_its_logs_tail_where_the_pod_asks(
    tmp_path: Path, policy: str
) -> None:
    """A worker that dies before its agent writes a termination message (a missing module) is told by its
    log's tail, as a kubelet does under `FallbackToLogsOnError`: the operator's pods ask for it, and the
    job's failure quotes it once the pod is deleted. Under `File`, nothing."""
    import asyncio
    import sys

    import kopf
    from _rjob_stack import NAMESPACE, Kube, api_server, eventually

    from resilientjob.operator.kube import core_path

    said = "ModuleNotFoundError: no resilientjob"
    code = f"import sys; print('\\n'.join(map(str, range(200)))); sys.exit({said!r})"
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "crasher", "labels": {kubelet.LABEL_MANAGED_BY: kubelet.MANAGER}},
        "spec": {
            "containers": [
                {"name": "c", "command": [sys.executable, "-c", code], "terminationMessagePolicy": policy}
            ]
        },
    }
    async with api_server() as (_, url):
        kube = Kube(kopf.ConnectionInfo(server=url, insecure=True, default_namespace=NAMESPACE))
        stopped = asyncio.Event()
        runner = asyncio.create_task(kubelet.ProcessKubelet(kube.api, tmp_path / "kubelet").run(stopped))

        async def terminated() -> dict[str, Any] | None:
            pod = await kube.get("pods", "crasher")
            statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or [{}]
            return statuses[0].get("state", {}).get("terminated")

        try:
            await kube.api.create(core_path(NAMESPACE, "pods"), body)
            state = await eventually(terminated, 20, "the pod's container terminated")
        finally:
            stopped.set()
            await asyncio.wait({runner}, timeout=15)
            await kube.close()
    assert state["exitCode"] == 1
    if policy == "File":
        assert "message" not in state
        return
    lines = state["message"].splitlines()
    assert lines[-1] == said
    assert len(lines) == kubelet.FALLBACK_LINES and lines[0] == str(200 - kubelet.FALLBACK_LINES + 1)
