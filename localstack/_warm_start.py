"""Warm starts for the process kubelet: pods' Python programs forked from an interpreter that has already
imported what they import.

Every worker pod of a job runs `python -m resilientjob.agent`, and each such interpreter spent 3-5 CPU
seconds importing torch, transformers and the agent before it did anything; a job of four pods, its
replacements and its store pod paid that again and again on a two-core machine. On a node the image's
layers are cached but the interpreter starts cold all the same, so this is a cost of emulating many nodes
on one host, not of the product, and it goes here: one interpreter (the *warm interpreter*) imports the
agent's modules once, and each pod's process is a fork of it that then runs the pod's program as `python
-m` would (`runpy`, `__main__`, its arguments).

A pod sees what a cold start gives it: its own session and process group, its environment and working
directory, its output on the pod's log, the exit code of its program, SIGKILL when the warm interpreter
(and so the kubelet) dies, as a tethered process does (`_tether`). Modules read some variables as they are
imported (transformers its cache paths, OpenMP its thread count), so the warm interpreter imports under the
first such pod's environment less the variables that differ per pod (`PER_POD_ENV`), and a pod whose
environment differs from that in anything else starts cold. The warm interpreter runs no Python thread but its
main one when it forks (it checks), so no lock of one is held in a child.

Protocol (one `SOCK_SEQPACKET` pair, a JSON object per message): the kubelet sends {"argv", "env", "cwd"}
with the write end of the pod's log pipe as the message's file descriptor; the warm interpreter answers
{"started": pid} or {"failed": why}, and {"exited": pid, "code": c} when a pod's process ends (`code` as
`Popen.returncode`: -N for signal N).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import queue
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._tether import tethered

PER_POD_ENV_PREFIXES = ("RJOB_",)
PER_POD_ENV = frozenset({"POD_NAME", "POD_IP", "TMPDIR"})
"""Variables that differ from pod to pod and that no preloaded module reads as it is imported (the agent reads
its `RJOB_*` identity at run time; `tempfile` is told to look at TMPDIR again after the fork)."""
READY_TIMEOUT_S = 120.0
"""How long a pod waits for the warm interpreter's imports before it starts cold instead."""
REPLY_TIMEOUT_S = 30.0
_MESSAGE_LIMIT = 1 << 22
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class WarmStart:
    """Which pods start warm, and what the warm interpreter imports for them."""

    preload: tuple[str, ...]
    """Modules imported once, before the first fork (what the programs below import as they start)."""
    programs: tuple[str, ...] = ("resilientjob.",)
    """`python -m` modules that start warm: a module's name, or a prefix of names ending in '.'."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables these pods' specs set, the same in every pod, beyond what this host's environment holds: the
    warm interpreter imports under them when it starts before any pod (`WarmStarter.prestart`)."""

    def runs(self, command: Sequence[str]) -> bool:
        """Whether `command` (argv; its interpreter already this one) is `python -m` of one of `programs`."""
        if len(command) < 3 or command[0] != sys.executable or command[1] != "-m":
            return False
        module = command[2]
        return any(module.startswith(p) if p.endswith(".") else module == p for p in self.programs)


AGENT_WARM_START = WarmStart(
    preload=(
        "torch",
        "torch.distributed.checkpoint",
        "transformers.modeling_utils",
        # What `python -m resilientjob.agent` imports, not the module itself: runpy runs a `__main__` that
        # is in sys.modules already twice (and warns).
        "resilientjob.agent.telemetry",
        "resilientjob.agent._redis",
        "resilientjob.agent._bridge",
        "resilientjob.agent.worker",
        "resilientjob.agent.store_host",
    ),
    # The operator's scratch variables (`operator._manifests.SCRATCH_ENV` less TMPDIR, which is per pod):
    # repeated, not imported, as the kubelet knows nothing of the operator (the contract test compares).
    env={
        "XDG_CACHE_HOME": "/tmp/cache",
        "TORCH_HOME": "/tmp/torch",
        "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor",
        "TRITON_CACHE_DIR": "/tmp/triton",
        "MPLCONFIGDIR": "/tmp/matplotlib",
    },
)
"""The local stack's: the worker and store pods' programs and the modules they import as they start."""


def import_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of a pod's environment that modules may read as they are imported."""
    return {k: v for k, v in env.items() if k not in PER_POD_ENV and not k.startswith(PER_POD_ENV_PREFIXES)}


class WarmProcess:
    """A pod's process forked by the warm interpreter: the part of `subprocess.Popen` the kubelet uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired([f"pid {self.pid}"], timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def ended(self, code: int) -> None:
        self.returncode = code
        self._exited.set()


class _WarmInterpreter:
    """The kubelet's side of one warm interpreter: its process, its socket, and a thread reading it."""

    def __init__(self, preload: Sequence[str], env: dict[str, str], log_path: Path) -> None:
        self.env = env
        self.ready = threading.Event()
        self.failure = ""
        self.replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self.running: dict[int, WarmProcess] = {}
        self.lock = threading.Lock()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs, log_path.open("ab") as log:
            self.process = subprocess.Popen(
                tethered([sys.executable, "-m", __name__, str(theirs.fileno()), *preload]),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(theirs.fileno(),),
            )
        self.sock = ours
        threading.Thread(target=self._read, name="warm interpreter", daemon=True).start()

    def usable(self) -> bool:
        return self.ready.wait(READY_TIMEOUT_S) and not self.failure

    def fork(
        self, argv: Sequence[str], env: Mapping[str, str], stdout_fd: int, cwd: str
    ) -> WarmProcess | None:
        request = json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd}).encode()
        with self.lock:
            try:
                socket.send_fds(self.sock, [request], [stdout_fd])
                reply = self.replies.get(timeout=REPLY_TIMEOUT_S)
            except (OSError, queue.Empty) as exc:
                self.failure = self.failure or f"no reply to a start: {exc!r}"
                return None
        process = reply.get("process")
        return process if isinstance(process, WarmProcess) else None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.sock.close()

    def _read(self) -> None:
        """Route the warm interpreter's messages: ready, replies to `fork`, exits to their processes. Once it
        is gone, so are the processes it forked (each was tethered to it)."""
        while True:
            try:
                message = self.sock.recv(_MESSAGE_LIMIT)
            except OSError:
                break
            if not message:
                break
            said = json.loads(message)
            if "ready" in said:
                self.ready.set()
            elif "exited" in said:
                self.running.pop(int(said["exited"]), WarmProcess(0)).ended(int(said["code"]))
            else:
                if "started" in said:
                    # The reply carries the process: its exit may be read (and it leave `running`) before
                    # the caller wakes.
                    said["process"] = self.running[int(said["started"])] = WarmProcess(int(said["started"]))
                elif not self.ready.is_set():
                    self.failure = str(said.get("failed"))
                    self.ready.set()
                self.replies.put(said)
        self.failure = self.failure or "the warm interpreter exited"
        self.ready.set()
        for process in list(self.running.values()):
            process.ended(-signal.SIGKILL)
        self.running.clear()
        self.replies.put({"failed": self.failure})


class WarmStarter:
    """Starts pods' processes warm where `settings` and their environment allow; `start` answers None where
    they do not, and the caller starts that pod cold. The warm interpreter is started by `prestart`, or else
    by the first pod that can use it (under that pod's `import_env`), and lives until `close`, or until this
    process dies."""

    def __init__(self, settings: WarmStart, log_path: Path) -> None:
        self.settings = settings
        self.log_path = log_path
        self._interpreter: _WarmInterpreter | None = None
        self._lock = threading.Lock()

    def prestart(self, host_env: Mapping[str, str]) -> None:
        """Start the warm interpreter now, under `host_env` and the settings' `env` (what a pod of this host
        whose spec sets nothing else has), so that it imports while the stack and its operator start: the
        first pods then wait less, or not at all."""
        self._interpreter_under(import_env({**host_env, **self.settings.env}))

    def start(
        self, argv: Sequence[str], env: Mapping[str, str], stdout_fd: int, cwd: str | None = None
    ) -> WarmProcess | None:
        """Fork `argv` with `env`, its output on `stdout_fd` (the caller closes its own copy), in `cwd`
        (default: the caller's), or None. Blocks while the warm interpreter imports: call it off the event
        loop."""
        if not self.settings.runs(argv):
            return None
        wanted = import_env(env)
        interpreter = self._interpreter_under(wanted)
        if interpreter.env != wanted or not interpreter.usable():
            return None
        return interpreter.fork(argv[1:], env, stdout_fd, cwd or os.getcwd())

    @property
    def pid(self) -> int | None:
        """The warm interpreter's process id, once started (until `close`)."""
        interpreter = self._interpreter
        return interpreter.process.pid if interpreter is not None else None

    def _interpreter_under(self, env: dict[str, str]) -> _WarmInterpreter:
        """The warm interpreter, started under `env` if there is none yet."""
        with self._lock:
            if self._interpreter is None:
                self._interpreter = _WarmInterpreter(self.settings.preload, env, self.log_path)
            return self._interpreter

    def close(self) -> None:
        with self._lock:
            interpreter, self._interpreter = self._interpreter, None
        if interpreter is not None:
            interpreter.close()


# The warm interpreter itself: `python -m resilientjob.localstack._warm_start FD MODULE...`.


def _serve(sock: socket.socket, preload: Sequence[str]) -> tuple[dict[str, Any], int] | None:
    """Import `preload`, then fork a child per request until the kubelet closes the socket. Returns only in
    a child: its request and the descriptor of its output."""
    try:
        for module in preload:
            importlib.import_module(module)
    except Exception as exc:  # the kubelet starts its pods cold, and says why in the log
        print(f"warm start: importing the preload failed: {exc!r}", flush=True)
        sock.send(json.dumps({"failed": f"import: {exc!r}"}).encode())
        return None
    if threading.active_count() != 1:
        # A fork copies only the forking thread: a lock another Python thread held stays held in every child.
        # (Native threads the libraries start as they are imported, torch's, are theirs to mend at a fork:
        # torch resets its pools in a forked child, as its DataLoader workers rely on.)
        names = [thread.name for thread in threading.enumerate()]
        print(f"warm start: threads after the imports: {names}", flush=True)
        sock.send(json.dumps({"failed": f"threads after the imports: {names}; a fork needs one"}).encode())
        return None
    # What the imports made lives as long as the pods do: frozen, no pod's collector walks it. A collection
    # writes to every object it visits, so each pod would copy the pages it shares with this interpreter,
    # and its exit would walk them all (1.8 CPU-s of a forked pod's exit with torch imported, 0.5 frozen).
    gc.collect()
    gc.freeze()
    sock.send(b'{"ready": true}')
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is sock:
                message, fds, _, _ = socket.recv_fds(sock, _MESSAGE_LIMIT, 1)
                if not message:
                    return None  # the kubelet is gone (or closed us): so are we, and our pods with us
                request = json.loads(message)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    for other in list(selector.get_map().values()):
                        if other.fileobj is not sock:
                            os.close(other.fd)  # the other pods' pidfds
                    selector.close()
                    return request, fds[0]
                os.close(fds[0])
                pidfd = os.pidfd_open(pid)
                selector.register(pidfd, selectors.EVENT_READ, pid)
                sock.send(json.dumps({"started": pid}).encode())
            else:
                _, status = os.waitpid(key.data, 0)
                selector.unregister(key.fd)
                os.close(key.fd)
                sock.send(
                    json.dumps({"exited": key.data, "code": os.waitstatus_to_exitcode(status)}).encode()
                )


def _become(request: Mapping[str, Any], output: int, warm_pid: int) -> None:
    """In a fresh child: take on the pod's process (as a tethered cold start would be) and run its program."""
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != warm_pid:
        os._exit(137)  # the warm interpreter died before the request took effect
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # found again from this environment's TMPDIR
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()  # its global generator was seeded once, in the warm interpreter
    _, module, *args = request["argv"]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main(argv: Sequence[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    warm_pid = os.getpid()
    child = _serve(sock, argv[1:])
    if child is None:
        return
    sock.close()
    _become(*child, warm_pid)


if __name__ == "__main__":
    main(sys.argv[1:])
