"""The local stack's processes end with its supervisor, however it ends: SIGKILLed, it can clean nothing up,
and its redis-server, operator and pods must not run on as orphans (`resilientjob.localstack._tether`).
While it runs, a redis-server or operator that dies is started again, as a cluster restarts a crashed pod."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from resilientjob.localstack import kubelet

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(child) for child in (task / "children").read_text().split()}
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper (this sandbox's init may never reap one)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def _create_pod(api_url: str, name: str, command: tuple[str, ...] = ("sleep", "600")) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {kubelet.LABEL_MANAGED_BY: kubelet.MANAGER}},
        "spec": {"containers": [{"name": "main", "image": "busybox", "command": list(command)}]},
    }
    request = urllib.request.Request(
        f"{api_url}/api/v1/namespaces/default/pods",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 201


def test_a_killed_supervisor_takes_redis_the_operator_and_the_pods_with_it(tmp_path: Path) -> None:
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "resilientjob.localstack", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    children: set[int] = set()
    try:
        _until((tmp_path / "state.json").exists, 60, "the stack's state.json")
        state = json.loads((tmp_path / "state.json").read_text())
        _create_pod(state["api_url"], "sleeper")
        pid_file = tmp_path / "pods" / "sleeper" / "pid"
        _until(pid_file.exists, 30, "the kubelet to start the pod")
        pod_pid = int(pid_file.read_text())
        # The pod runs its own command under its own pid (the prologue exec'd it), not a wrapper.
        _until(lambda: Path(f"/proc/{pod_pid}/cmdline").read_bytes().split(b"\0")[0] == b"sleep", 10, "exec")
        children = _children(supervisor.pid)
        assert {pod_pid, int(state["operator_pid"])} <= children and len(children) >= 3  # and redis-server

        supervisor.kill()
        supervisor.wait(10)
        _until(lambda: not any(_alive(pid) for pid in children), 10, f"the children {children} to end")
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_crashed_operator_or_redis_is_started_again(tmp_path: Path) -> None:
    with (tmp_path / "stack.log").open("wb") as log:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "resilientjob.localstack", str(tmp_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _until((tmp_path / "state.json").exists, 60, "the stack's state.json")
        first = json.loads((tmp_path / "state.json").read_text())
        assert first["restarts"] == {"redis-server": 0, "operator": 0}

        def restarted(name: str) -> bool:
            state = json.loads((tmp_path / "state.json").read_text())
            return bool(state["restarts"][name] == 1)

        os.kill(first["operator_pid"], signal.SIGKILL)
        os.kill(first["redis_pid"], signal.SIGKILL)
        _until(lambda: restarted("operator") and restarted("redis-server"), 30, "both started again")
        state = json.loads((tmp_path / "state.json").read_text())
        assert _alive(state["operator_pid"]) and state["operator_pid"] != first["operator_pid"]
        assert _alive(state["redis_pid"]) and state["redis_pid"] != first["redis_pid"]
        assert state["redis_url"] == first["redis_url"]  # the same port: clients reconnect to it

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(state["health_url"], timeout=2) as response:
                    return bool(response.status == 200)
            except OSError:
                return False

        _until(healthy, 30, "the new operator's liveness endpoint")
        text = (tmp_path / "stack.log").read_text()
        assert "operator exited with code -9; starting it again in 5 s" in text
        # Dated, as a kubelet's log lines are: when it restarted is what a reader of the log looks for.
        line = next(line for line in text.splitlines() if "operator exited with code -9" in line)
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING ", line), line
        assert "redis-server exited with code -9" in text
    finally:
        supervisor.terminate()
        try:
            supervisor.wait(30)
        finally:
            if supervisor.poll() is None:
                os.killpg(supervisor.pid, signal.SIGKILL)


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds `text`."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in command and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def test_down_kills_a_stack_that_does_not_stop_and_every_process_of_its_pods(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stack that does not stop when told (here: stopped with SIGSTOP, so its SIGTERM waits) is killed
    by `rjob local down` after its wait, with everything it ran: Redis, the operator, each pod and what the
    pod started itself. Before, `down` said "still stopping" and the stack ran on for good, taking CPU from
    whatever ran next."""
    from resilientjob.cli import _local

    monkeypatch.setenv("RJOB_LOCAL_DIR", str(tmp_path))
    monkeypatch.setattr(_local, "DOWN_TIMEOUT_S", 1.0)
    assert _local._up() == 0
    state = json.loads((tmp_path / "state.json").read_text())
    supervisor = int(state["pid"])
    everything: set[int] = set()
    try:
        # The shell is the pod's main process; the sleep it starts is the pod's own child.
        _create_pod(state["api_url"], "forker", ("sh", "-c", "sleep 600 & wait"))
        pid_file = tmp_path / "pods" / "forker" / "pid"
        _until(pid_file.exists, 30, "the kubelet to start the pod")
        pod = int(pid_file.read_text())
        _until(lambda: bool(_children(pod)), 10, "the pod's own child")
        everything = {supervisor, pod, *_children(pod), *_children(supervisor)}
        assert {int(state["operator_pid"]), int(state["redis_pid"])} <= everything

        os.kill(supervisor, signal.SIGSTOP)
        assert _local._down() == 0
        said = capsys.readouterr().err
        assert f"killed: the stack (pid {supervisor}) had not stopped after 1 s" in said, said
        assert not (tmp_path / "state.json").exists()
        _until(lambda: not any(_alive(pid) for pid in everything), 10, f"{everything} to end")
    finally:
        for pid in everything:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_up_that_does_not_start_in_time_leaves_nothing_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rjob local up` that gives up on a stack stops it: left running, the stack came up later behind a
    command that had said it failed, and nothing ever stopped it."""
    from resilientjob.cli import _local
    from resilientjob.cli._common import CliError

    monkeypatch.setenv("RJOB_LOCAL_DIR", str(tmp_path))
    monkeypatch.setattr(_local, "UP_TIMEOUT_S", 0.0)
    with pytest.raises(CliError, match=r"did not start within 0 s \(stopped it\); see .*stack\.log"):
        _local._up()
    try:
        _until(lambda: not _processes_naming(str(tmp_path)), 10, "the stack's processes to end")
        assert not (tmp_path / "state.json").exists()
    finally:
        for pid in _processes_naming(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)


def test_killing_a_stack_kills_the_groups_of_warm_started_pods_too() -> None:
    """A warm-started pod is the child of the stack's warm interpreter, not of the stack: killing the stack
    kills its group (and so what the pod started itself) as it does a cold-started pod's. A tree shaped so:
    the stack -> the warm interpreter (in the stack's group; tethered to it in the product) -> a pod (its
    own session) -> the pod's child."""
    from resilientjob.cli import _local

    pod = "sleep 600 & wait"
    warm = f"import subprocess, time; subprocess.Popen(['sh', '-c', {pod!r}], start_new_session=True); "
    warm += "time.sleep(600)"
    stack = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {warm!r}]); "
            "time.sleep(600)",
        ],
        start_new_session=True,
    )
    interpreters: set[int] = set()
    pods: set[int] = set()
    try:
        _until(lambda: bool(_children(stack.pid)), 20, "the warm interpreter")
        interpreters = _children(stack.pid)
        _until(lambda: any(_children(pid) for pid in interpreters), 20, "the pod")
        pods = {pid for interpreter in interpreters for pid in _children(interpreter)}
        _until(lambda: all(_children(pid) for pid in pods), 20, "the pod's own child")
        pods |= {child for pid in pods for child in _children(pid)}
        _local._kill_stack(stack.pid)
        stack.wait(10)
        _until(lambda: not any(_alive(pid) for pid in pods), 10, f"the pod's processes {pods} to end")
    finally:
        for pid in pods | interpreters:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if stack.poll() is None:
            stack.kill()
            stack.wait()
