"""A process kubelet for the local stack: runs each Pod of the (emulated) API server as a local process.

Pod phase follows the process (Running while it lives, Succeeded/Failed by exit code), annotations and
labels are written to files the way the downward API does, `fieldRef`, `secretKeyRef` and `configMapKeyRef`
environment variables are resolved (a missing key keeps the pod Pending, its container waiting with
`CreateContainerConfigError`, until it exists), and a deleted pod's processes are stopped. It talks to the
API over HTTP like any kubelet.

Every process a pod started dies with the pod, as a container's do: each pod runs in its own session (and
process group), a deleted pod's whole group is stopped, and when a pod's main process exits (killed or not)
whatever it left running in its group is killed. Nothing outlives its pod here that would not outlive it on
a cluster.

All pods share this host's network, so a port a pod's spec fixes (the agent's metrics port, the same in every
worker pod; the store pod's TCPStore port) is replaced by a free one per pod, written to
`metrics-port` in the pod's directory for the metrics port.

Pods share this host's file system too, so an emptyDir volume, which on a node is the pod's own, would be
one directory for every pod (a job's checkpoints at `/checkpoints` mixed every job's and every node's). A
pod's emptyDir volumes are directories of the pod here (`volumes/<pod uid>/<volume>`, new for each pod, as
emptyDir is), and the paths under their mounts that a worker writes, which all come in its workload (the
checkpoint and output paths of `RJOB_WORKLOAD`), are moved there. A pod's `/tmp` (the operator's scratch
emptyDir) is its own directory too, as `TMPDIR`: what a pod makes with `tempfile` (the agent's working
directory, torch elastic's error files) goes with the pod instead of piling up in the host's `/tmp` from
every killed agent. A path the pod names under `/tmp` stays the host's: the caches the operator points there
(shared by the pods of this host, as a node's would be) and the files a test hands a job. Other volumes
(claims) are the host's paths as they are.

Pods run in every namespace, as a node's kubelet runs whatever is scheduled to it. A pod's files (its output
`log`, `pid`, `podinfo/`) are under `pods/<name>/` for a pod in `default` and `pods/<namespace>_<name>/` for
one elsewhere (no name or namespace holds an underscore, so no two pods share a directory).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from resilientjob.operator.kube import KubeApi, core_path

from ._tether import tethered
from ._warm_start import WarmProcess, WarmStart, WarmStarter
from .ports import free_port

# What the operator writes into its pods and the agent reads (operator/_manifests.py, agent/store_host.py):
# repeated, not imported, as a kubelet knows nothing of either (tests/operator/test_local_stack.py checks
# that the copies agree).
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "resilientjob-operator"
AGENT_METRICS_ENV = "RJOB_AGENT_METRICS_PORT"
STORE_PORT_ENV = "RJOB_STORE_PORT"
WORKLOAD_ENV = "RJOB_WORKLOAD"
HOST_TMP = "/tmp"

# A kubelet's `FallbackToLogsOnError`: the tail of a failed container's log when it left no message.
FALLBACK_LINES = 80
FALLBACK_BYTES = 2048
LOG_DRAIN_S = 2.0
"""How long the report of a failed pod waits for its output's last lines to reach the log."""


def pod_base_env(host: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a pod's environment starts from: the host's (this process's now, by default), less the stack's
    own settings, with this environment's `python` first on PATH."""
    env = {key: value for key, value in (host or os.environ).items() if not key.startswith("RJOB_")}
    # The image's `python` is this environment's, also where a shell finds it: an Ascend worker's command
    # runs behind `sh -c '...; exec "$@"' sh python -m ...`, which ran the host's bare python.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH") or os.defpath])
    return env


def pod_directory(pods: Path, namespace: str, name: str) -> Path:
    """Where a pod's files are, under the stack's `pods` folder (the module's docstring says why so)."""
    return pods / (name if namespace == "default" else f"{namespace}_{name}")


def downward_annotations_text(annotations: Mapping[str, str]) -> str:
    """The downward API's file format for a map: one `key="value"` per line, sorted (json quoting)."""
    return "".join(f"{key}={json.dumps(value)}\n" for key, value in sorted(annotations.items()))


@dataclass(slots=True)
class RunningPod:
    name: str
    namespace: str
    uid: str
    process: subprocess.Popen[bytes] | WarmProcess
    podinfo: Path
    annotations: dict[str, str]
    reported: str = ""
    metrics_port: int | None = None
    container: str = "worker"
    started_at: str = ""
    """RFC 3339: when its process started (its container status's `running.startedAt`)."""
    ended: bool = False
    """Its main process exited and what it left in its group was killed: the group id may be reused now."""
    log_capture: threading.Thread | None = None
    """The thread that copies its output to its log (done once the output ends)."""
    fallback_to_logs: bool = False
    """Its container's `terminationMessagePolicy` is `FallbackToLogsOnError`: a failure that left no
    termination message is told by its log's tail."""


class ContainerConfigError(Exception):
    """A container's environment names a Secret or ConfigMap key that is not there: the pod stays Pending
    (CreateContainerConfigError) and is tried again until it is."""


class ProcessKubelet:
    """Poll the API for pods, start/stop their processes, and report their phases. With a `namespace`,
    only that namespace's pods run; without one, every namespace's."""

    def __init__(
        self,
        kube: KubeApi,
        state_dir: Path,
        namespace: str | None = None,
        interval_s: float = 0.1,
        warm_start: WarmStart | None = None,
        warm_server: str | None = None,
        host_env: Mapping[str, str] | None = None,
    ) -> None:
        """`warm_start`: which pods' programs start from the warm interpreter (`_warm_start`); None: every
        pod's process starts cold. `warm_server`: the socket of a warm interpreter that serves several
        kubelets (`_warm_start.WarmServer`), used where it answers instead of one of this kubelet's own.
        `host_env`: the environment pods start from (default: this process's when each starts; a test's
        in-process kubelet gives one without pytest's per-test variables, or they would not start warm)."""
        self.host_env = dict(host_env) if host_env is not None else None
        self.kube = kube
        self.state_dir = state_dir
        self.namespace = namespace
        self.interval_s = interval_s
        self.pods: dict[str, RunningPod] = {}
        self.warm_starter = (
            WarmStarter(warm_start, state_dir / "warm-start.log", warm_server) if warm_start else None
        )

    async def run(self, stopped: asyncio.Event, before_stop: Callable[[], None] | None = None) -> None:
        """Sync until `stopped`; then call `before_stop` (the stack stops its operator there) and stop every
        pod's process, all at once so that shutting down takes one grace period, not one per pod."""
        if self.warm_starter is not None:
            self.warm_starter.prestart(pod_base_env(self.host_env))
        try:
            while not stopped.is_set():
                await self.sync_once()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopped.wait(), self.interval_s)
        finally:
            if before_stop is not None:
                before_stop()
            running = list(self.pods.values())
            for pod in running:
                _signal_group(pod, signal.SIGTERM)
            for pod in running:
                self._stop(pod)
            if self.warm_starter is not None:
                self.warm_starter.close()

    async def sync_once(self) -> None:
        listed = await self.kube.list(core_path(self.namespace, "pods") if self.namespace else "/api/v1/pods")
        present: dict[str, dict[str, Any]] = {
            p["metadata"]["uid"]: p
            for p in listed
            if (p["metadata"].get("labels") or {}).get(LABEL_MANAGED_BY) == MANAGER
            and not p["metadata"].get("deletionTimestamp")
        }
        for uid, pod in list(self.pods.items()):
            if uid not in present:
                self._stop(pod)
                del self.pods[uid]
                # Its emptyDir volumes go with it, as a kubelet's do (replacements get new names: nothing
                # else would ever remove them).
                volumes = pod_directory(self.state_dir / "pods", pod.namespace, pod.name) / "volumes" / uid
                shutil.rmtree(volumes, ignore_errors=True)
        for uid, body in present.items():
            running = self.pods.get(uid)
            if running is None:
                if (body.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
                    continue
                try:
                    running = await self._start(body)
                except ContainerConfigError as exc:
                    await self._waiting(body, "CreateContainerConfigError", str(exc))
                    continue
                self.pods[uid] = running
            annotations = dict(body["metadata"].get("annotations") or {})
            if annotations != running.annotations:
                running.annotations = annotations
                self._write_podinfo(running.podinfo, body)
            await self._report(running)

    def _write_podinfo(self, directory: Path, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        for name, values in (
            ("annotations", meta.get("annotations") or {}),
            ("labels", meta.get("labels") or {}),
        ):
            # Atomic replace, as the kubelet's symlink swap makes downward-API updates atomic for readers.
            temporary = directory / f".{name}.tmp"
            temporary.write_text(downward_annotations_text(values))
            os.replace(temporary, directory / name)

    async def _env(self, body: dict[str, Any], podinfo: Path, volumes: Mapping[str, Path]) -> dict[str, str]:
        env = pod_base_env(self.host_env)
        container = body["spec"]["containers"][0]
        fields = {
            "metadata.name": body["metadata"]["name"],
            "metadata.namespace": body["metadata"]["namespace"],
            "status.podIP": "127.0.0.1",
        }
        for item in container.get("env") or []:
            source = item.get("valueFrom") or {}
            if "value" in item:
                env[item["name"]] = str(item["value"])
            elif "fieldRef" in source:
                env[item["name"]] = fields.get(source["fieldRef"]["fieldPath"], "")
            elif "secretKeyRef" in source or "configMapKeyRef" in source:
                kind = "secret" if "secretKeyRef" in source else "configmap"
                ref = source["secretKeyRef" if kind == "secret" else "configMapKeyRef"]
                found = await self.kube.get(core_path(body["metadata"]["namespace"], f"{kind}s", ref["name"]))
                value = ((found or {}).get("data") or {}).get(ref["key"])
                if value is not None:
                    env[item["name"]] = base64.b64decode(value).decode() if kind == "secret" else value
                elif not ref.get("optional"):
                    # As a kubelet does: the container is not created until the key exists.
                    if found is None:
                        raise ContainerConfigError(f'{kind} "{ref["name"]}" not found')
                    where = (
                        f"{'Secret' if kind == 'secret' else 'ConfigMap'} {found['metadata']['namespace']}"
                    )
                    raise ContainerConfigError(f"couldn't find key {ref['key']} in {where}/{ref['name']}")
        env["RJOB_PODINFO_DIR"] = str(podinfo)
        # The container's last words, which a kubelet keeps in its status (`/dev/termination-log` there).
        env["RJOB_TERMINATION_LOG"] = str(podinfo.parent / "termination-log")
        if env.get(AGENT_METRICS_ENV):
            # One host for every pod: the spec's port (the same in every worker) would clash.
            env[AGENT_METRICS_ENV] = str(free_port())
        if env.get(STORE_PORT_ENV):
            env[STORE_PORT_ENV] = "0"  # the store host binds a free port and registers it in Redis
        if env.get(WORKLOAD_ENV):
            env[WORKLOAD_ENV] = _workload_in_volumes(env[WORKLOAD_ENV], volumes)
        return env

    async def _warm(
        self, command: list[str], env: dict[str, str]
    ) -> tuple[WarmProcess | None, IO[bytes] | None]:
        """The pod's process forked by the warm interpreter and its output, or (None, None): start it cold."""
        if self.warm_starter is None or not self.warm_starter.settings.runs(command):
            return None, None
        output, into = os.pipe()
        try:
            process = await asyncio.to_thread(self.warm_starter.start, command, env, into)
        finally:
            os.close(into)
        if process is None:
            os.close(output)
            return None, None
        return process, open(output, "rb")  # the log thread closes it

    async def _start(self, body: dict[str, Any]) -> RunningPod:
        name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
        directory = pod_directory(self.state_dir / "pods", namespace, name)
        podinfo = directory / "podinfo"
        podinfo.mkdir(parents=True, exist_ok=True)
        (directory / "termination-log").unlink(missing_ok=True)  # a pod of the same name had its own
        # And its own log: `kubectl logs` of a new pod under an old name shows the new pod's output only.
        uid = str(body["metadata"].get("uid", ""))
        marker = directory / "uid"
        if not marker.exists() or marker.read_text() != uid:
            for earlier in ("log", LOG_TIMES):
                (directory / earlier).unlink(missing_ok=True)
            marker.write_text(uid)
        self._write_podinfo(podinfo, body)
        command = list(body["spec"]["containers"][0].get("command") or ["python", "-m", "resilientjob.agent"])
        if command[0] in ("python", "python3"):
            command[0] = sys.executable  # the image's python is this environment's python
        volumes = _empty_dirs(body, directory)
        env = await self._env(body, podinfo, volumes)
        if HOST_TMP in volumes and env.get("TMPDIR", HOST_TMP).rstrip("/") == HOST_TMP:
            env["TMPDIR"] = str(volumes[HOST_TMP])
        metrics_port = int(env[AGENT_METRICS_ENV]) if env.get(AGENT_METRICS_ENV) else None
        if metrics_port is not None:
            (directory / "metrics-port").write_text(str(metrics_port))
        process: subprocess.Popen[bytes] | WarmProcess | None
        process, output = await self._warm(command, env)
        if process is None or output is None:
            cold = subprocess.Popen(
                tethered(command),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            process, output = cold, cold.stdout
        assert output is not None
        log_capture = threading.Thread(
            target=capture_log,
            args=(output, directory / "log", directory / LOG_TIMES),
            name=f"log {namespace}/{name}",
            daemon=True,
        )
        log_capture.start()
        (directory / "pid").write_text(str(process.pid))
        annotations = dict(body["metadata"].get("annotations") or {})
        return RunningPod(
            name,
            namespace,
            body["metadata"]["uid"],
            process,
            podinfo,
            annotations,
            metrics_port=metrics_port,
            container=body["spec"]["containers"][0]["name"],
            started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            log_capture=log_capture,
            fallback_to_logs=body["spec"]["containers"][0].get("terminationMessagePolicy")
            == "FallbackToLogsOnError",
        )

    async def _waiting(self, body: dict[str, Any], reason: str, message: str) -> None:
        """A pod whose container cannot be created yet: Pending, the container waiting with `reason`."""
        container = body["spec"]["containers"][0]["name"]
        waiting = {"waiting": {"reason": reason, "message": message}}
        statuses = (body.get("status") or {}).get("containerStatuses") or []
        if statuses and statuses[0].get("state") == waiting:
            return  # told already
        status = {
            "phase": "Pending",
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": _container_statuses(container, waiting),
        }
        path = core_path(body["metadata"]["namespace"], "pods", body["metadata"]["name"]) + "/status"
        await self.kube.patch(path, {"status": status})

    async def _report(self, pod: RunningPod) -> None:
        code = pod.process.poll()
        if code is not None and not pod.ended:
            _signal_group(pod, signal.SIGKILL)  # the container is gone: so is all it started
            pod.ended = True
        if code is None:
            phase, status = (
                "Running",
                {
                    "phase": "Running",
                    "podIP": "127.0.0.1",
                    "conditions": [{"type": "Ready", "status": "True"}],
                    # A merge patch replaces the list: a waiting state from before (a missing Secret key,
                    # `_waiting`) goes, as a kubelet's status of a started container says.
                    "containerStatuses": _container_statuses(
                        pod.container, {"running": {"startedAt": pod.started_at}}
                    ),
                },
            )
        else:
            phase = "Succeeded" if code == 0 else "Failed"
            reason = "Completed" if code == 0 else "Error"
            terminated: dict[str, Any] = {"exitCode": code, "reason": reason}
            last_words = _termination_message(pod.podinfo.parent / "termination-log")
            if not last_words and code != 0 and pod.fallback_to_logs:
                if pod.log_capture is not None:  # its last lines may still be on their way to the log
                    await asyncio.to_thread(pod.log_capture.join, LOG_DRAIN_S)
                last_words = _log_tail(pod.podinfo.parent / "log")
            if last_words:
                terminated["message"] = last_words
            status = {
                "phase": phase,
                "reason": reason,
                "message": f"exit code {code}",
                "conditions": [{"type": "Ready", "status": "False"}],
                "containerStatuses": _container_statuses(pod.container, {"terminated": terminated}),
            }
        if phase != pod.reported:
            await self.kube.patch(core_path(pod.namespace, "pods", pod.name) + "/status", {"status": status})
            pod.reported = phase

    @staticmethod
    def _stop(pod: RunningPod) -> None:
        """SIGTERM to the pod's process group, SIGKILL to what is left after the grace period."""
        if pod.process.poll() is None:
            _signal_group(pod, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                pod.process.wait(3)
        _signal_group(pod, signal.SIGKILL)
        pod.ended = True
        with contextlib.suppress(subprocess.TimeoutExpired):
            pod.process.wait(3)


LOG_TIMES = "log.times"
"""Beside a pod's `log`: `<byte offset> <unix time>` of each line's start, when the kubelet read it."""
LOG_LINE_LIMIT = 1 << 16
"""Bytes read at most before a line is written out without its end (a process that never ends a line)."""


def _container_statuses(container: str, state: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod's one container's status in `state` (waiting, running or terminated); ready while it runs."""
    return [{"name": container, "ready": "running" in state, "restartCount": 0, "state": state}]


def capture_log(stream: IO[bytes], log_path: Path, times_path: Path) -> None:
    """Copy a pod's output to its `log` as it comes, noting when each line started (`LOG_TIMES`), as a
    kubelet's container log keeps a time per line: `kubectl logs --timestamps` and `--since` read them.
    Appends: the log of a pod's earlier container (a restart) stays before it. Runs until the pod's
    processes have all closed their output."""
    with stream, log_path.open("ab") as log, times_path.open("a") as times:
        at_line_start = log.tell() == 0 or _ends_a_line(log_path)
        for line in iter(lambda: stream.readline(LOG_LINE_LIMIT), b""):
            if at_line_start:
                times.write(f"{log.tell()} {time.time():.6f}\n")
                times.flush()
            log.write(line)
            log.flush()
            at_line_start = line.endswith(b"\n")


def _ends_a_line(path: Path) -> bool:
    with path.open("rb") as log:
        log.seek(-1, os.SEEK_END)
        return log.read(1) == b"\n"


def _empty_dirs(body: Mapping[str, Any], directory: Path) -> dict[str, Path]:
    """The pod's emptyDir mounts as mount path -> its own directory, made empty: the pod's uid names it (a
    pod of the same name before had its own), and those of earlier pods of the name go."""
    spec = body.get("spec") or {}
    empty = {v["name"] for v in spec.get("volumes") or [] if isinstance(v, dict) and "emptyDir" in v}
    mounts = (spec.get("containers") or [{}])[0].get("volumeMounts") or []
    root = directory / "volumes"
    uid = str(body["metadata"].get("uid") or "pod")
    if root.exists():
        for earlier in root.iterdir():
            if earlier.name != uid:
                shutil.rmtree(earlier, ignore_errors=True)
    found: dict[str, Path] = {}
    for mount in mounts:
        path = str(mount.get("mountPath") or "").rstrip("/")
        if mount.get("name") in empty and path:
            found[path] = root / uid / str(mount["name"])
            found[path].mkdir(parents=True, exist_ok=True)
    return found


def _workload_in_volumes(raw: str, mounts: Mapping[str, Path]) -> str:
    """The workload JSON with its checkpoint and output paths moved into the pod's own volumes when they
    lie under an emptyDir mount (`_empty_dirs`) but `/tmp`'s (a path there is the host's: the module's
    docstring says why); as it was otherwise, or when it is not a JSON object."""
    try:
        workload = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    if not mounts or not isinstance(workload, dict):
        return raw

    def moved(path: object) -> object:
        if not isinstance(path, str):
            return path
        for mount, host in mounts.items():
            if mount == HOST_TMP:
                continue
            if path.rstrip("/") == mount or path.startswith(mount + "/"):
                return str(host) + path.rstrip("/")[len(mount) :]
        return path

    for section in ("checkpoint", "output"):
        if isinstance(workload.get(section), dict) and "path" in workload[section]:
            workload[section]["path"] = moved(workload[section]["path"])
    return json.dumps(workload)


def _signal_group(pod: RunningPod, signum: int) -> None:
    """Signal every process of the pod: its main process leads its own group (`start_new_session`), and the
    group outlives the leader while anything in it runs (never once `ended`: the id may be reused)."""
    if not pod.ended:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pod.process.pid, signum)


def _log_tail(path: Path) -> str:
    """A failed container's termination message under `FallbackToLogsOnError`, as a kubelet makes it: the
    log's last `FALLBACK_LINES` lines, at most `FALLBACK_BYTES` of them."""
    try:
        with path.open("rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - FALLBACK_BYTES))
            tail = log.read()
    except OSError:
        return ""
    return b"\n".join(tail.splitlines()[-FALLBACK_LINES:]).decode(errors="replace")


def _termination_message(path: Path) -> str:
    """What the container left at its termination-message path, as a kubelet reads it (at most 4096 bytes)."""
    try:
        return path.read_bytes()[:4096].decode(errors="replace")
    except OSError:
        return ""
