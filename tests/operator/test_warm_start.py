"""The process kubelet's warm starts (`localstack._warm_start`): a pod forked from the warm interpreter sees
what a cold start gives it (its arguments, environment, working directory, TMPDIR, own session, output, exit
code), a pod whose environment the imports may have read differently starts cold, a deleted pod's process
stops, and the warm interpreter's death takes its pods with it, as a tethered process's parent's does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kopf
import pytest
from _rjob_stack import NAMESPACE, Kube, Operator, Stack, api_server, emulator_only, eventually
from _support import operator_starter

from resilientjob.localstack import kubelet
from resilientjob.localstack._warm_start import WarmProcess, WarmServer, WarmStart
from resilientjob.operator.kube import core_path

pytestmark = emulator_only("these run the process kubelet itself")

PROBE = """\
import gc, json, os, subprocess, sys, tempfile, time
code = int(sys.argv[1])
child = subprocess.Popen(["sleep", "120"]).pid if code < 0 else None  # a sleeper's, in its group
print(json.dumps({
    "argv": sys.argv[1:], "name": __name__, "cwd": os.getcwd(), "tmp": tempfile.gettempdir(),
    "said": os.environ.get("SAID"), "pod": os.environ.get("POD_NAME"), "parent": os.getppid(),
    "leader": os.getsid(0) == os.getpgid(0) == os.getpid(), "preloaded": "colorsys" in sys.modules,
    "frozen": gc.get_freeze_count() > 0, "child": child,
}), flush=True)
if code < 0:
    time.sleep(120)
sys.exit(code)
"""


def _pod(name: str, code: int, said: str = "hello") -> dict[str, Any]:
    env = [
        {"name": "SAID", "value": said},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "TMPDIR", "value": "/tmp"},
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {kubelet.LABEL_MANAGED_BY: kubelet.MANAGER}},
        "spec": {
            "volumes": [{"name": "scratch", "emptyDir": {}}],
            "containers": [
                {
                    "name": "c",
                    "command": ["python", "-m", "podprobe", str(code)],
                    "env": env,
                    "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}],
                }
            ],
        },
    }


@contextlib.asynccontextmanager
async def _running(
    tmp_path: Path, warm: WarmStart | None, pods: list[dict[str, Any]], server: WarmServer | None = None
) -> AsyncIterator[Ran]:
    """A kubelet running `pods` until each has ended (or spoken, for the sleepers): what each said, its phase
    and its container's state. With `server`, the kubelet uses that shared warm interpreter."""
    async with api_server() as (_, url):
        kube = Kube(kopf.ConnectionInfo(server=url, insecure=True, default_namespace=NAMESPACE))
        stopped = asyncio.Event()
        shared = str(server.path) if server is not None else None
        node = kubelet.ProcessKubelet(kube.api, tmp_path / "kubelet", warm_start=warm, warm_server=shared)
        runner = asyncio.create_task(node.run(stopped))
        root = tmp_path / "kubelet" / "pods"
        names = [pod["metadata"]["name"] for pod in pods]

        async def settled() -> bool:
            for name in names:
                body = await kube.get("pods", name)
                phase = ((body or {}).get("status") or {}).get("phase")
                log = kubelet.pod_directory(root, NAMESPACE, name) / "log"
                spoke = log.exists() and log.read_text().endswith("\n")
                sleeps = name.startswith("sleeper")
                if not (phase in ("Succeeded", "Failed") or (sleeps and phase == "Running" and spoke)):
                    return False
            return True

        try:
            for pod in pods:
                await kube.api.create(core_path(NAMESPACE, "pods"), pod)
            await eventually(settled, 60, "every pod to end or speak")
            outcome = Ran(kube, node, root)
            for name in names:
                body = await kube.get("pods", name) or {}
                said = json.loads((kubelet.pod_directory(root, NAMESPACE, name) / "log").read_text())
                outcome.pods[name] = {
                    "said": said,
                    "phase": body["status"]["phase"],
                    "state": body["status"]["containerStatuses"][0]["state"],
                }
            yield outcome
        finally:
            stopped.set()
            await asyncio.wait({runner}, timeout=15)
            await kube.close()


@dataclass
class Ran:
    kube: Kube
    node: kubelet.ProcessKubelet
    root: Path
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)

    def warm_pid(self) -> int:
        assert self.node.warm_starter is not None and self.node.warm_starter.pid is not None
        return self.node.warm_starter.pid


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # `python -m podprobe` finds it in the working directory, warm (the warm interpreter's sys.path[0]) or
    # cold.
    (tmp_path / "podprobe.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


async def test_a_warm_started_pod_sees_what_a_cold_start_gives_it(probe: Path) -> None:
    warm = WarmStart(preload=("colorsys",), programs=("podprobe",), env={"SAID": "hello"})
    pods = [_pod("ok", 0), _pod("fails", 3), _pod("other-env", 0, said="something else")]
    async with _running(probe / "warm", warm, pods) as ran:
        for name, code in (("ok", 0), ("fails", 3)):
            said = ran.pods[name]["said"]
            # Forked by the warm interpreter (the prologue exec'd into it: the same pid), with its modules.
            assert said["parent"] == ran.warm_pid() and said["preloaded"], said
            assert said["frozen"]  # what the warm interpreter imported is not walked by this pod's collector
            assert said["argv"] == [str(code)] and said["name"] == "__main__" and said["leader"]
            assert said["said"] == "hello" and said["pod"] == name and said["cwd"] == str(probe)
            tmp = Path(said["tmp"])  # the pod's own /tmp volume, as a cold start's TMPDIR
            assert tmp.is_relative_to(ran.root / name / "volumes"), tmp
            assert ran.pods[name]["state"]["terminated"]["exitCode"] == code
        assert ran.pods["ok"]["phase"] == "Succeeded" and ran.pods["fails"]["phase"] == "Failed"
        # The warm interpreter imported under SAID=hello (the value its settings name for every pod): a pod
        # that says otherwise starts cold, as imports might have read it.
        assert ran.pods["other-env"]["said"]["parent"] == os.getpid()
        assert ran.pods["other-env"]["said"]["said"] == "something else"
        assert ran.node.warm_starter is not None
        assert ran.node.warm_starter.cold_reason == "the environment it imported under differs in SAID"
        assert "warm start: starting cold: the environment it imported under differs in SAID\n" in (
            ran.node.warm_starter.log_path.read_text()
        )
        warm_pods = ran.pods

    async with _running(probe / "cold", None, [_pod("ok", 0), _pod("fails", 3)]) as cold:
        for name in ("ok", "fails"):
            cold_said, warm_said = dict(cold.pods[name]["said"]), dict(warm_pods[name]["said"])
            assert cold_said.pop("parent") == os.getpid() and cold_said.pop("preloaded") is False
            assert cold_said.pop("frozen") is False
            assert Path(cold_said.pop("tmp")).name == Path(warm_said.pop("tmp")).name == "scratch"
            warm_said.pop("parent"), warm_said.pop("preloaded"), warm_said.pop("frozen")
            assert cold_said == warm_said
            assert cold.pods[name]["state"] == warm_pods[name]["state"]


async def test_a_deleted_warm_pod_stops_and_the_warm_interpreters_death_takes_its_pods(probe: Path) -> None:
    warm = WarmStart(preload=("colorsys",), programs=("podprobe",), env={"SAID": "hello"})
    async with _running(probe, warm, [_pod("sleeper-a", -1), _pod("sleeper-b", -1)]) as ran:
        pids = {pod.name: pod.process.pid for pod in ran.node.pods.values()}
        warm_pid = ran.warm_pid()
        assert all(ran.pods[name]["said"]["parent"] == warm_pid for name in pids)
        pids["sleeper-b's child"] = ran.pods["sleeper-b"]["said"]["child"]

        async def gone(pid: int) -> bool:
            try:
                return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
            except FileNotFoundError:
                return True

        await ran.kube.delete("pods", "sleeper-a")
        await eventually(lambda: gone(pids["sleeper-a"]), 20, "the deleted pod's process to end")
        os.kill(warm_pid, signal.SIGKILL)
        await eventually(lambda: gone(pids["sleeper-b"]), 20, "the warm interpreter's pod to die with it")
        await eventually(lambda: gone(pids["sleeper-b's child"]), 20, "and the pod's child")

        async def failed() -> bool:
            body = await ran.kube.get("pods", "sleeper-b") or {}
            return bool((body.get("status") or {}).get("phase") == "Failed")

        await eventually(failed, 20, "the pod reported Failed")
        # Later pods start cold, with nothing lost.
        await ran.kube.api.create(core_path(NAMESPACE, "pods"), _pod("after", 0))
        log = kubelet.pod_directory(ran.root, NAMESPACE, "after") / "log"

        async def spoke() -> bool:
            return log.exists() and log.read_text().endswith("\n")

        await eventually(spoke, 20, "the later pod's output")
        assert json.loads(log.read_text())["parent"] == os.getpid()


async def test_kubelets_sharing_a_warm_server_each_take_only_their_own_pods_when_they_go(probe: Path) -> None:
    """One warm server serves several kubelets (the suite's local stacks, `WarmServer`): the pods of each
    fork from it, and a kubelet that goes (stopped, or killed: its socket closes either way) takes its own
    pods and their groups with it, as its own warm interpreter's death would; the other kubelet's pods go
    on, and later pods still start warm."""
    warm = WarmStart(preload=("colorsys",), programs=("podprobe",), env={"SAID": "hello"})
    server = WarmServer(warm, probe / "warm.sock", probe / "warm.log", kubelet.pod_base_env())
    assert (probe / "warm.sock").stat().st_mode & 0o777 == 0o600  # who connects runs programs as us
    try:
        async with (
            _running(probe / "a", warm, [_pod("sleeper-a", -1)], server) as a,
            _running(probe / "b", warm, [_pod("sleeper-b", -1)], server) as b,
        ):
            said_a, said_b = a.pods["sleeper-a"]["said"], b.pods["sleeper-b"]["said"]
            assert said_a["parent"] == said_b["parent"] == server.process.pid == a.warm_pid() == b.warm_pid()
            assert said_a["preloaded"] and said_a["frozen"]
            assert a.node.warm_starter is not None
            a.node.warm_starter.close()  # kubelet a goes

            async def gone(pid: int) -> bool:
                try:
                    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
                except FileNotFoundError:
                    return True

            (pod_a,), (pod_b,) = a.node.pods.values(), b.node.pods.values()
            for pid in (pod_a.process.pid, said_a["child"]):
                await eventually(lambda pid=pid: gone(pid), 20, f"kubelet a's pod process {pid} to end")
            assert not await gone(pod_b.process.pid) and not await gone(said_b["child"])
            await b.kube.api.create(core_path(NAMESPACE, "pods"), _pod("after", 0))
            log = kubelet.pod_directory(b.root, NAMESPACE, "after") / "log"

            async def spoke() -> bool:
                return log.exists() and log.read_text().endswith("\n")

            await eventually(spoke, 20, "a later pod of kubelet b")
            assert json.loads(log.read_text())["parent"] == server.process.pid
    finally:
        server.close()
    assert not (probe / "warm.sock").exists()


async def test_the_suites_operators_fork_warm_in_every_test_and_phase(stack: Stack, tmp_path: Path) -> None:
    """The suite's operators fork from its warm interpreter for them (`_support.operator_starter`): the
    `stack` fixture's, started in the setup phase, and one started in the test's body alike. An environment
    that changed from test to test and phase to phase (pytest's PYTEST_CURRENT_TEST) once started every
    operator of the suite but the first cold, and nothing said so."""
    another = Operator("http://127.0.0.1:9", stack.redis_url, tmp_path / "another.log")
    another.start()
    try:
        for process in (stack.operator.process, another.process):
            assert isinstance(process, WarmProcess), (process, operator_starter().cold_reason)
            parent = int(Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            assert parent == operator_starter().pid
    finally:
        another.stop()


async def test_a_program_the_warm_interpreter_preloaded_runs_as_main_without_a_warning(probe: Path) -> None:
    """The local stack preloads `resilientjob.agent.store_host`, which its store pods then run with `-m`:
    runpy warned in every store pod's log that the module was in sys.modules before it ran it."""
    (probe / "quiet").mkdir()
    (probe / "quiet" / "__init__.py").write_text("")  # a module of a package, as store_host is
    (probe / "quiet" / "probe.py").write_text(
        "import json, os\n"
        "if __name__ == '__main__':\n"
        "    print(json.dumps({'name': __name__, 'parent': os.getppid()}), flush=True)\n"
    )
    warm = WarmStart(preload=("colorsys", "quiet.probe"), programs=("quiet.probe",), env={"SAID": "hello"})
    pod = _pod("quiet", 0)
    pod["spec"]["containers"][0]["command"] = ["python", "-m", "quiet.probe"]
    async with _running(probe / "warm", warm, [pod]) as ran:  # its log must be the one JSON line
        assert ran.pods["quiet"]["said"] == {"name": "__main__", "parent": ran.warm_pid()}
