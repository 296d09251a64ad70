"""`rjob local`: the whole control plane on this machine (emulated API server over HTTP, real Redis, the real
operator, a process kubelet). `up`, `apply -f FILE`, `get`, `kubeconfig`, `logs POD`, `chaos kill POD`,
`chaos slow POD --factor F --for 60s [--link PEER]`, `chaos break POD [--switch]`, `chaos hang POD [--for
10m]`, `chaos clear POD`, `down`."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from resilientjob.protocol.chaos import ALLOW_ENV

from ._chaos import (
    SWITCH_HELP,
    break_said,
    break_window_s,
    check_fault_applies,
    check_slow,
    parse_duration,
)
from ._common import CliError, guarded, make_directory
from ._manifest_files import Document, load_documents

GROUP, VERSION, PLURAL = "resilientjob.io", "v1alpha1", "resilientjobs"
LOCAL_EXTRA = ("kmock", "celpy", "attrs")
"""The modules the local stack needs beyond the core install: the `local` extra (pyproject.toml)."""


def _check_local_extra() -> None:
    """One line instead of a stack that dies in the background (`rjob local up`, `rjob demo`)."""
    if any(importlib.util.find_spec(name) is None for name in LOCAL_EXTRA):
        raise CliError("rjob local needs: pip install 'resilientjob[local]'")


def _state_dir() -> Path:
    return Path(os.environ.get("RJOB_LOCAL_DIR") or Path.home() / ".rjob" / "local")


def _state() -> dict[str, Any]:
    path = _state_dir() / "state.json"
    if not path.exists():
        raise CliError("the local stack is not running: run `rjob local up`")
    state: dict[str, Any] = json.loads(path.read_text())
    return state


def _call(
    method: str, path: str, body: Any = None, content_type: str = "application/json"
) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(_state()["api_url"] + path, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "local",
        help="run the control plane locally",
        description="A local stand-in for a cluster: an API server that kubectl talks to, Redis, the "
        "operator and a process kubelet that runs pods as processes. Its state (kubeconfig, logs, pod "
        "directories) is kept in $RJOB_LOCAL_DIR (default ~/.rjob/local); give each stack its own.",
    )
    commands = parser.add_subparsers(dest="local_command", required=True)
    commands.add_parser(
        "up",
        help="start API server, Redis, operator and kubelet in the background",
        description="Start the stack in the background, its state in $RJOB_LOCAL_DIR (default "
        "~/.rjob/local), and print `export KUBECONFIG=...` for kubectl.",
    )
    apply = commands.add_parser("apply", help="create or update objects from a YAML file")
    apply.add_argument("-f", "--filename", required=True)
    commands.add_parser("get", help="list jobs and their pods")
    commands.add_parser("kubeconfig", help="print the path of the kubeconfig for kubectl and other clients")
    logs = commands.add_parser("logs", help="print a pod's output")
    logs.add_argument("pod")
    logs.add_argument("-n", "--namespace", default="default")
    chaos = commands.add_parser("chaos", help="inject faults").add_subparsers(
        dest="chaos_command", required=True
    )
    kill = chaos.add_parser("kill", help="SIGKILL a pod's process")
    kill.add_argument("pod")
    kill.add_argument("-n", "--namespace", default="default")
    slow = chaos.add_parser("slow", help="slow a pod's steps down for a while")
    slow.add_argument("pod")
    slow.add_argument("-n", "--namespace", default="default")
    slow.add_argument(
        "--factor",
        type=float,
        default=1.5,
        help="times slower, >= 1 (default 1.5): the pod's compute, or with --link its transfers to the peer",
    )
    slow.add_argument("--for", dest="duration", default="60s", help="duration such as 60s or 2m")
    slow.add_argument("--link", metavar="PEER", help="slow the link to this peer pod (or node number)")
    slow.add_argument("--latency", type=float, default=0.001, help="link: nominal seconds per message")
    slow.add_argument("--bandwidth", type=float, default=1e9, help="link: nominal bytes per second")
    clear = chaos.add_parser("clear", help="withdraw a pod's slowdown or hang before its time is up")
    clear.add_argument("pod")
    clear.add_argument("-n", "--namespace", default="default")
    broken = chaos.add_parser(
        "break", help="fail a pod's next collective once, as a reset connection would (the pod stays alive)"
    )
    broken.add_argument("pod")
    broken.add_argument("--switch", action="store_true", help=SWITCH_HELP)
    broken.add_argument("-n", "--namespace", default="default")
    hang = chaos.add_parser("hang", help="block a pod's worker in its next collective (its agent beats on)")
    hang.add_argument("pod")
    hang.add_argument("-n", "--namespace", default="default")
    hang.add_argument("--for", dest="duration", default="10m", help="duration such as 60s or 10m (default)")
    commands.add_parser("down", help="stop everything")
    parser.set_defaults(handler=guarded(_run))


def _run(args: argparse.Namespace) -> int:
    command = args.local_command
    if command == "up":
        return _up()
    if command == "down":
        return _down()
    if command == "apply":
        return _apply(Path(args.filename))
    if command == "get":
        return _get()
    if command == "kubeconfig":
        print(_state()["kubeconfig"])
        return 0
    if command == "logs":
        log = _pod_directory(args.namespace, args.pod) / "log"
        if not log.exists():
            raise CliError(f"pod: no logs for {args.pod!r} in namespace {args.namespace!r}")
        sys.stdout.write(log.read_text(errors="replace"))
        return 0
    if args.chaos_command == "kill":
        return _kill(args.pod, args.namespace)
    if args.chaos_command == "clear":
        return _clear(args.pod, args.namespace)
    if args.chaos_command == "hang":
        return _slow(args.pod, 1.0, args.duration, namespace=args.namespace, fault="hang")
    if args.chaos_command == "break":
        window = f"{break_window_s(args.switch):g}s"
        return _slow(args.pod, 1.0, window, namespace=args.namespace, fault="break", switch=args.switch)
    return _slow(
        args.pod, args.factor, args.duration, args.link, args.latency, args.bandwidth, args.namespace
    )


def _pod_directory(namespace: str, pod: str) -> Path:
    """Where the stack's process kubelet keeps a pod's files: its rule (`localstack.kubelet.pod_directory`)
    repeated, as the CLI never imports the stack (tests/operator/test_kubectl.py reads a pod's logs both
    ways, outside `default`)."""
    return _state_dir() / "pods" / (pod if namespace == "default" else f"{namespace}_{pod}")


UP_TIMEOUT_S = 30.0
"""How long `up` waits for the stack to say where it serves (its state file) before it stops it."""
DOWN_TIMEOUT_S = 15.0
"""How long `down` waits for the stack to stop its pods, operator and Redis before it kills them."""


def _up() -> int:
    _check_local_extra()
    directory = _state_dir()
    if (directory / "state.json").exists():
        print(f"already up ({directory})")
        return 0
    make_directory(directory, "RJOB_LOCAL_DIR")
    log = directory / "stack.log"
    with log.open("ab") as output:
        # Spawned, not a Popen: the stack outlives this command (and `rjob demo`, which calls this here).
        command = [sys.executable, "-m", "resilientjob.localstack", str(directory)]
        actions = [(os.POSIX_SPAWN_DUP2, output.fileno(), 1), (os.POSIX_SPAWN_DUP2, output.fileno(), 2)]
        stack = os.posix_spawn(sys.executable, command, os.environ, file_actions=actions, setsid=True)
    deadline = time.monotonic() + UP_TIMEOUT_S
    while not (directory / "state.json").exists():
        ended, status = os.waitpid(stack, os.WNOHANG)
        if ended:
            code = os.waitstatus_to_exitcode(status)
            raise CliError(f"local stack exited with code {code} as it started; see {log}")
        if time.monotonic() > deadline:
            # Left running, it would come up later behind a command that said it failed, and live on.
            _kill_stack(stack)
            os.waitpid(stack, 0)
            raise CliError(f"local stack did not start within {UP_TIMEOUT_S:g} s (stopped it); see {log}")
        time.sleep(0.1)
    state = _state()
    print(f"API server {state['api_url']}\nRedis      {state['redis_url']}\nstate      {directory}")
    print(f"export KUBECONFIG={state['kubeconfig']}")
    return 0


def _down() -> int:
    path = _state_dir() / "state.json"
    if not path.exists():
        print("not running")
        return 0
    pid = int(json.loads(path.read_text())["pid"])
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        path.unlink()
        return 0
    deadline = time.monotonic() + DOWN_TIMEOUT_S
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    if path.exists():
        _kill_stack(pid)
        path.unlink(missing_ok=True)
        print(
            f"killed: the stack (pid {pid}) had not stopped after {DOWN_TIMEOUT_S:g} s; see "
            f"{_state_dir() / 'stack.log'}",
            file=sys.stderr,
        )
        return 0
    print("stopped")
    return 0


def _kill_stack(pid: int) -> None:
    """SIGKILL the stack's process `pid` and its pods' process groups. Its other children (Redis, the
    operator, the warm interpreter, each pod's main process) are tied to its life (`localstack._tether`) and
    die with it, but a pod's own children would outlive the pod that the kubelet no longer stops: so each
    pod's group first, a group only while its leader is the stack's child or a child of one (a warm-started
    pod is the warm interpreter's), as a pid its pods no longer hold may be another's."""
    children = _children(pid)
    grandchildren = [grandchild for child in children for grandchild in _children(child)]
    for leader in children + grandchildren:
        with contextlib.suppress(OSError):
            if os.getpgid(leader) == leader:
                os.killpg(leader, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` now (Linux's /proc; none elsewhere)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid:
            found.append(int(entry.name))
    return found


# The kinds `rjob local apply` creates, by kind: the served apiVersion and the plural.
_KINDS = {
    "ResilientJob": (f"{GROUP}/{VERSION}", PLURAL),
    "ConfigMap": ("v1", "configmaps"),
    "Secret": ("v1", "secrets"),
}


def _resource_path(document: Document) -> str:
    body = document.body
    namespace = body["metadata"].get("namespace") or "default"
    api_version, kind = body["apiVersion"], body["kind"]
    if kind not in _KINDS:
        raise CliError(
            f"{document.where}: kind: {kind!r} is not supported by the local stack ({', '.join(_KINDS)})"
        )
    served, plural = _KINDS[kind]
    if api_version != served:
        raise CliError(
            f"{document.where}: apiVersion: {api_version!r} is not served for kind {kind} (use {served!r})"
        )
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{base}/namespaces/{namespace}/{plural}"


def _refusal(payload: Any) -> str:
    return str(payload.get("message") if isinstance(payload, dict) else payload).splitlines()[0]


def _apply(path: Path) -> int:
    documents = load_documents(path)
    # Every document is checked before any is sent: a bad second document leaves the first unapplied.
    targets = [(document, _resource_path(document)) for document in documents]
    for document, collection in targets:
        body, name = document.body, document.body["metadata"]["name"]
        # As kubectl asks: a misspelt field is refused by name, not pruned into a "required" complaint.
        status, payload = _call("POST", f"{collection}?fieldValidation=Strict", body)
        if status == 409:
            status, payload = _call(
                "PATCH",
                f"{collection}/{name}?fieldValidation=Strict",
                {"spec": body.get("spec"), "data": body.get("data")},
                "application/merge-patch+json",
            )
        if status >= 400:
            raise CliError(f"{document.where}: {_refusal(payload)}")
        print(f"{body['kind'].lower()}/{name} applied")
    return 0


def _get() -> int:
    """Every job and pod of the stack, in all namespaces (as `kubectl get -A`)."""
    _, jobs = _call("GET", f"/apis/{GROUP}/{VERSION}/{PLURAL}")
    print(
        f"{'NAMESPACE':<12} {'NAME':<20} {'PHASE':<14} {'WORKERS':<8} {'LAYOUT':<24} {'THROUGHPUT':>10} "
        f"{'STEP':>8} {'LOSS':>8} GEN"
    )
    for job in (jobs or {}).get("items", []):
        status, meta = job.get("status") or {}, job["metadata"]
        print(
            f"{meta.get('namespace', ''):<12} {meta['name']:<20} {status.get('phase', ''):<14} "
            f"{status.get('workers', ''):<8} {status.get('layout', ''):<24} "
            f"{status.get('throughput', 0):>10} {status.get('step', 0):>8} {_loss(status.get('loss')):>8} "
            f"{status.get('planGeneration', '')}"
        )
        why = _failure(status) or _waiting(status)
        if why:
            print(f"  {why}")
    _, pods = _call("GET", "/api/v1/pods")
    print(f"\n{'NAMESPACE':<12} {'POD':<28} {'PHASE':<10} GENERATION")
    if not (pods or {}).get("items"):
        print("(no pods)")
    for pod in (pods or {}).get("items", []):
        meta = pod["metadata"]
        annotations = meta.get("annotations") or {}
        phase = (pod.get("status") or {}).get("phase", "Pending")
        print(
            f"{meta.get('namespace', ''):<12} {meta['name']:<28} {phase:<10} "
            f"{annotations.get('resilientjob.io/generation', '')}"
        )
    return 0


def _failure(status: dict[str, object]) -> str:
    """For a failed job, the reason and message of the condition that failed it (as `kubectl describe`)."""
    if status.get("phase") != "Failed":
        return ""
    conditions = status.get("conditions")
    failed = [
        c
        for c in (conditions if isinstance(conditions, list) else [])
        if isinstance(c, dict) and c.get("status") == "False" and c.get("message")
    ]
    failed.sort(key=lambda c: c.get("type") != "Valid")  # an invalid spec says it best
    return f"{failed[0].get('reason', '')}: {failed[0]['message']}" if failed else ""


def _waiting(status: dict[str, object]) -> str:
    """For a job whose worker pods do not all run, why not (its WorkersReady condition); '' otherwise."""
    conditions = status.get("conditions")
    for c in conditions if isinstance(conditions, list) else []:
        if (
            isinstance(c, dict)
            and c.get("type") == "WorkersReady"
            and c.get("status") == "False"
            and c.get("reason") != "TrainingComplete"
        ):
            return f"{c.get('reason', '')}: {c.get('message', '')}"
    return ""


def _loss(value: object) -> str:
    return f"{value:.4f}" if isinstance(value, int | float) else "-"


def _kill(pod: str, namespace: str = "default") -> int:
    pid_file = _pod_directory(namespace, pod) / "pid"
    if not pid_file.exists():
        raise CliError(f"pod: {pod!r} is not running locally in namespace {namespace!r}")
    try:
        # The pod's whole process group (the kubelet starts each pod as a group leader), as a container
        # crash takes every process of the container.
        os.killpg(int(pid_file.read_text()), signal.SIGKILL)
    except ProcessLookupError:
        raise CliError(f"pod: {pod!r} has already exited") from None
    print(f"pod/{pod} killed")
    return 0


def _worker(pod: str, field: str, namespace: str) -> tuple[dict[str, str], dict[str, Any]]:
    """A worker pod's labels (the job named by its owner) and the pod itself; CliError naming `field` when
    there is no such pod or it is no ResilientJob worker."""
    _, body = _call("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}")
    if not (body or {}).get("metadata"):
        raise CliError(f"{field}: no pod {pod!r} in namespace {namespace!r}")
    labels = body["metadata"].get("labels") or {}
    if "resilientjob.io/node" not in labels:
        raise CliError(f"{field}: {pod!r} is not a ResilientJob worker")
    # The owner names the job: the label holds a hashed form of a name longer than a label value may be.
    refs = body["metadata"].get("ownerReferences") or []
    owners = [ref.get("name") for ref in refs if ref.get("kind") == "ResilientJob"]
    return ({**labels, "resilientjob.io/job": owners[0]} if owners else dict(labels)), body


def _clear(pod: str, namespace: str = "default") -> int:
    """Withdraw the pod's chaos order (`protocol.chaos`): its worker runs at its own speed again."""
    import redis

    from resilientjob.protocol.chaos import clear_order
    from resilientjob.protocol.keys import JobKeys

    labels, _ = _worker(pod, "pod", namespace)
    client = redis.Redis.from_url(_state()["redis_url"])
    try:
        had = clear_order(
            client, JobKeys(namespace, labels["resilientjob.io/job"]), int(labels["resilientjob.io/node"])
        )
    finally:
        client.close()
    print(f"pod/{pod} {'cleared' if had else 'had no chaos order'}")
    return 0


def _slow(
    pod: str,
    factor: float,
    duration: str,
    link: str | None = None,
    latency_s: float = 0.001,
    bandwidth_bps: float = 1e9,
    namespace: str = "default",
    fault: str | None = None,
    switch: bool = False,
) -> int:
    """Write the chaos order the pod's worker obeys (`agent.chaos`): its compute, or its link to `link`
    (whose nominal latency and bandwidth set the delay per transfer), or a `fault` ("break", "hang"; a
    break in the worker's next `switch`)."""
    import redis
    from pydantic import ValidationError

    from resilientjob.protocol.chaos import ChaosOrder, write_order
    from resilientjob.protocol.keys import JobKeys

    seconds = parse_duration(duration)  # bad input is refused before anything is read or written
    if fault is None:
        check_slow(factor, latency_s, bandwidth_bps)
    labels, body = _worker(pod, "pod", namespace)
    job = labels["resilientjob.io/job"]
    containers = (body.get("spec") or {}).get("containers") or []
    env = {entry.get("name"): entry.get("value") for c in containers for entry in c.get("env") or []}
    if env.get(ALLOW_ENV) != "1":
        # The worker would ignore the order: say so rather than print that it was slowed.
        raise CliError(
            f"pod: job {job!r} does not allow chaos: set spec.chaos.enabled: true ({ALLOW_ENV}=1 is not in "
            f"{pod}'s env)"
        )
    check_fault_applies(fault, env.get("RJOB_MODEL"), job)
    peer: int | None = None
    if link is not None:
        peer_labels = {"resilientjob.io/job": job, "resilientjob.io/node": link} if link.isdigit() else None
        peer_labels = peer_labels or _worker(link, "link", namespace)[0]
        if peer_labels["resilientjob.io/job"] != job:
            raise CliError(
                f"link: {link!r} belongs to job {peer_labels['resilientjob.io/job']!r}, not {job!r}"
            )
        peer = int(peer_labels["resilientjob.io/node"])
        if str(peer) == labels["resilientjob.io/node"]:
            raise CliError(f"link: {link!r} is {pod}'s own node {peer}: a link joins two nodes")
    try:
        order = ChaosOrder(
            factor=factor,
            until=time.time() + seconds,
            link=peer,
            latency_s=latency_s,
            bandwidth_bps=bandwidth_bps,
            fault=fault,
            switch=True if switch else None,
        )
    except ValidationError as exc:
        error = exc.errors()[0]
        raise CliError(f"{'.'.join(map(str, error['loc'])) or 'factor'}: {error['msg']}") from None
    client = redis.Redis.from_url(_state()["redis_url"])
    try:
        write_order(client, JobKeys(namespace, job), int(labels["resilientjob.io/node"]), order)
    finally:
        client.close()
    if fault == "break":
        print(f"pod/{pod}: {break_said(switch)}")
    elif fault == "hang":
        print(f"pod/{pod}: its worker will hang in its next collective for {duration}")
    else:
        target = f" link to node {peer}" if peer is not None else ""
        print(f"pod/{pod}{target} slowed x{factor} for {duration}")
    return 0
