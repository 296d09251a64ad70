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

A warm interpreter may also serve several kubelets (`WarmServer`, listening on a Unix socket): the test
suite starts dozens of local stacks, and each would import torch again while its first pods waited. A
kubelet that closes its socket, or dies, takes its pods (their process groups) with it there too.

Protocol (a `SOCK_SEQPACKET` connection, a JSON object per message): the warm interpreter says {"ready",
"pid", "executable", "env"} once it has imported (or {"failed": why}); the kubelet sends {"argv", "env",
"cwd"} with the write end of the pod's log pipe as the message's file descriptor; the warm interpreter
answers {"started": pid} or {"failed": why}, and {"exited": pid, "code": c} when a pod's process ends
(`code` as `Popen.returncode`: -N for signal N).
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
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._tether import tethered

PER_POD_ENV_PREFIXES = ("RJOB_",)
PER_POD_ENV = frozenset({"POD_NAME", "POD_IP", "TMPDIR"})
"""Variables that differ from pod to pod and that no preloaded module reads as it is imported (the agent reads
its `RJOB_*` identity at run time; `tempfile` is told to look at TMPDIR again after the fork)."""
WARM_SERVER_ENV = "RJOB_LOCAL_WARM_SERVER"
"""The stack's setting: the socket of a warm interpreter that serves several stacks (`WarmServer`: the test
suite's), used instead of one of the stack's own where it answers."""
READY_TIMEOUT_S = 120.0
"""How long a pod waits for the warm interpreter's imports before it starts cold instead."""
REPLY_TIMEOUT_S = 30.0
LISTEN_TIMEOUT_S = 10.0
"""How long a `WarmServer` is given to listen on its socket."""
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


def _differ(had: Mapping[str, str] | None, wanted: Mapping[str, str]) -> str:
    """The names (never the values: they may be secrets) of the variables two environments differ in."""
    had = had or {}
    names = sorted(name for name in had.keys() | wanted.keys() if had.get(name) != wanted.get(name))
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


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
    """The kubelet's side of one warm interpreter: its socket, a thread reading it, and its process when this
    kubelet started it (`spawn`) rather than joined one that serves several kubelets (`connect`)."""

    def __init__(
        self, sock: socket.socket, process: subprocess.Popen[bytes] | None, env: dict[str, str] | None
    ) -> None:
        self.sock = sock
        self.process = process
        self.env = env
        """What it imported under (its ready message tells, where this kubelet did not start it)."""
        self.pid = process.pid if process is not None else None
        self.ready = threading.Event()
        self.failure = ""
        self.replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self.running: dict[int, WarmProcess] = {}
        self.lock = threading.Lock()
        threading.Thread(target=self._read, name="warm interpreter", daemon=True).start()

    @classmethod
    def spawn(cls, preload: Sequence[str], env: dict[str, str], log_path: Path) -> _WarmInterpreter:
        """Start a warm interpreter of this kubelet's own, importing `preload` under `env`."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs, log_path.open("ab") as log:
            process = subprocess.Popen(
                tethered([sys.executable, "-m", __name__, str(theirs.fileno()), *preload]),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(theirs.fileno(),),
            )
        return cls(ours, process, env)

    @classmethod
    def connect(cls, path: str) -> _WarmInterpreter | None:
        """Join the warm server listening at `path` (`WarmServer`), or None where none answers there."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            return None
        return cls(sock, None, None)

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
        """Leave it: its server kills the pods it forked for us. One of our own then exits too."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        if self.process is not None:
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
                self._ready(said)
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

    def _ready(self, said: Mapping[str, Any]) -> None:
        """Its imports are done. One that serves several kubelets is usable only if it runs this Python (its
        modules are this installation's) and says what environment it imported under."""
        self.pid = int(said["pid"])
        if self.process is None:
            if said.get("executable") != sys.executable:
                self.failure = f"the warm server runs {said.get('executable')}, not {sys.executable}"
            self.env = dict(said.get("env") or {})
        self.ready.set()


class WarmStarter:
    """Starts pods' processes warm where `settings` and their environment allow; `start` answers None where
    they do not, and the caller starts that pod cold. The warm interpreter is the one `server` names (a
    `WarmServer`'s socket, shared with other kubelets) when one answers there, else one of this kubelet's
    own, started by `prestart`, or else by the first pod that can use it (under that pod's `import_env`); it
    serves until `close`, or until this process dies."""

    def __init__(self, settings: WarmStart, log_path: Path, server: str | None = None) -> None:
        self.settings = settings
        self.log_path = log_path
        self.server = server
        self._interpreter: _WarmInterpreter | None = None
        self._lock = threading.Lock()
        self.cold_reason = ""
        """Why the last process that could have started warm started cold ("" while none has)."""

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
        # One of our own knows its environment at once: a process that differs need not wait for its imports.
        if interpreter.env in (None, wanted) and not interpreter.usable():
            self._cold(interpreter.failure or f"its imports took over {READY_TIMEOUT_S:g} s")
            return None
        if interpreter.env != wanted:
            self._cold(f"the environment it imported under differs in {_differ(interpreter.env, wanted)}")
            return None
        process = interpreter.fork(argv[1:], env, stdout_fd, cwd or os.getcwd())
        if process is None:
            self._cold(interpreter.failure or "it refused the start")
        return process

    def _cold(self, reason: str) -> None:
        """Say in the log why a process starts cold (once per reason in a row): a silent cold start only
        costs time, and nothing else would tell."""
        if reason != self.cold_reason:
            self.cold_reason = reason
            with contextlib.suppress(OSError), self.log_path.open("a") as log:
                log.write(f"warm start: starting cold: {reason}\n")

    @property
    def pid(self) -> int | None:
        """The warm interpreter's process id, once it is known (until `close`)."""
        interpreter = self._interpreter
        return interpreter.pid if interpreter is not None else None

    def _interpreter_under(self, env: dict[str, str]) -> _WarmInterpreter:
        """The warm interpreter: the server's, or else one of our own started under `env` if there is none."""
        with self._lock:
            if self._interpreter is None and self.server:
                self._interpreter = _WarmInterpreter.connect(self.server)
                if self._interpreter is None:
                    print(f"warm start: no warm server at {self.server}; starting our own", flush=True)
            if self._interpreter is None:
                self._interpreter = _WarmInterpreter.spawn(self.settings.preload, env, self.log_path)
            return self._interpreter

    def close(self) -> None:
        with self._lock:
            interpreter, self._interpreter = self._interpreter, None
        if interpreter is not None:
            interpreter.close()


class WarmServer:
    """A warm interpreter that serves every kubelet that connects to its socket (`WarmStarter(server=...)`):
    the test suite runs one for the many local stacks it starts, so that each does not import torch again.
    A kubelet's pods die when it disconnects (or dies), as with its own warm interpreter; the server dies
    with the process that started it."""

    def __init__(self, settings: WarmStart, path: Path, log_path: Path, host_env: Mapping[str, str]) -> None:
        self.path = path
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                tethered([sys.executable, "-m", __name__, "--listen", str(path), *settings.preload]),
                env=import_env({**host_env, **settings.env}),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + LISTEN_TIMEOUT_S
        while not path.exists() and self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # it listens before it imports: a kubelet that connects then waits for ready

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.path.unlink(missing_ok=True)


# The warm interpreter itself: `python -m resilientjob.localstack._warm_start FD MODULE...` serves the kubelet
# at the other end of socket FD; `... --listen PATH MODULE...` serves every kubelet that connects to PATH.


def _imported(preload: Sequence[str]) -> dict[str, Any]:
    """Import `preload`; the ready message (or why not)."""
    try:
        for module in preload:
            importlib.import_module(module)
    except Exception as exc:  # the kubelet starts its pods cold, and says why in the log
        print(f"warm start: importing the preload failed: {exc!r}", flush=True)
        return {"failed": f"import: {exc!r}"}
    if threading.active_count() != 1:
        # A fork copies only the forking thread: a lock another Python thread held stays held in every child.
        # (Native threads the libraries start as they are imported, torch's, are theirs to mend at a fork:
        # torch resets its pools in a forked child, as its DataLoader workers rely on.)
        names = [thread.name for thread in threading.enumerate()]
        print(f"warm start: threads after the imports: {names}", flush=True)
        return {"failed": f"threads after the imports: {names}; a fork needs one"}
    # What the imports made lives as long as the pods do: frozen, no pod's collector walks it. A collection
    # writes to every object it visits, so each pod would copy the pages it shares with this interpreter,
    # and its exit would walk them all (bench/bench_warm_exit.py).
    gc.collect()
    gc.freeze()
    return {"ready": True, "pid": os.getpid(), "executable": sys.executable, "env": import_env(os.environ)}


@dataclass(eq=False)
class _Client:
    """A kubelet this interpreter serves, and the pods it forked for it."""

    sock: socket.socket
    pods: set[int] = field(default_factory=set)


def _serve(
    preload: Sequence[str], client: socket.socket | None, listener: socket.socket | None
) -> tuple[dict[str, Any], int] | None:
    """Import `preload`, then fork a child per request of `client` or of any kubelet that connects to
    `listener`, until `client` closes its socket (the listener's server serves until it is killed). A
    kubelet that leaves takes its pods with it. Returns only in a child: its request and the descriptor of
    its output."""
    ready = _imported(preload)
    if client is not None:
        _tell(client, ready)
    if "failed" in ready:
        return None
    selector = selectors.DefaultSelector()
    if client is not None:
        selector.register(client, selectors.EVENT_READ, _Client(client))
    if listener is not None:
        selector.register(listener, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                joined, _ = listener.accept()
                _tell(joined, ready)
                selector.register(joined, selectors.EVENT_READ, _Client(joined))
            elif isinstance(key.data, _Client):
                try:
                    message, fds, _, _ = socket.recv_fds(key.data.sock, _MESSAGE_LIMIT, 1)
                except OSError:
                    message, fds = b"", []
                if not message:
                    _leave(selector, key.data)
                    if listener is None:
                        return None  # our one kubelet is gone: so are we
                    continue
                pid = _fork(selector)
                if pid == 0:
                    return json.loads(message), fds[0]
                os.close(fds[0])
                selector.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, key.data))
                key.data.pods.add(pid)
                _tell(key.data.sock, {"started": pid})
            else:
                pid, owner = key.data
                _, status = os.waitpid(pid, 0)
                selector.unregister(key.fd)
                os.close(key.fd)
                owner.pods.discard(pid)
                _tell(owner.sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _tell(sock: socket.socket, message: Mapping[str, Any]) -> None:
    """Send `message` to a kubelet, which may have gone meanwhile (its leaving is read from its socket)."""
    with contextlib.suppress(OSError):
        sock.send(json.dumps(message).encode())


def _fork(selector: selectors.BaseSelector) -> int:
    """Fork; the child closes what serves the others (the sockets, the pods' pidfds)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for key in list(selector.get_map().values()):
            if isinstance(key.fileobj, socket.socket):
                key.fileobj.close()  # the object's own close: its descriptor's number is the pod's to reuse
            else:
                os.close(key.fd)
        selector.close()
    return pid


def _leave(selector: selectors.BaseSelector, client: _Client) -> None:
    """A kubelet closed its socket, or died: kill its pods' groups, as its death would have (they were
    tethered to it through us). Their exits are still reaped."""
    selector.unregister(client.sock)
    client.sock.close()
    for pid in client.pods:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)  # each pod leads its own session, and so its group


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
    # A preloaded program (the store host) runs afresh as __main__, as `python -m` runs it: what it imported
    # stays warm, and runpy does not warn that it was in sys.modules before it ran.
    sys.modules.pop(module, None)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main(argv: Sequence[str]) -> None:
    warm_pid = os.getpid()
    if argv[0] == "--listen":
        path, preload = argv[1], argv[2:]
        client, listener = None, socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        # Whoever can connect can have any program run as us: the socket is its owner's alone.
        umask = os.umask(0o177)
        try:
            listener.bind(path)  # before the imports: kubelets may connect meanwhile, and wait for ready
        finally:
            os.umask(umask)
        listener.listen()
    else:
        client, listener, preload = socket.socket(fileno=int(argv[0])), None, argv[1:]
    child = _serve(preload, client, listener)
    if child is None:
        return
    _become(*child, warm_pid)


if __name__ == "__main__":
    main(sys.argv[1:])
