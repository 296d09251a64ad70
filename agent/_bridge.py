"""The bridge from the control plane to the training runtime: what an agent pod runs when its job trains a
real model (`spec.model` is a runtime model such as `gpt`, `llama`, `sleep` or `module:function`).

Two parts:
- The **store**: the job's one `TCPStore` (rendezvous, plans, failure counter, commit votes) lives in the
  job's store pod (`store_host`), not in any worker pod, so that no worker pod is special: killing any of
  them, node 0 included, leaves the store up. The agent reads its address from `RJOB_STORE_ADDR` or the
  Redis key the store pod registers (`store_address`).
- The **worker** (`TrainingAgent`): one process per device started with torch elastic's `start_processes`
  (as `launcher.NodeAgent` does), running `worker.run_from_plan`, with `_worker_probe` inside it: the
  `torch.distributed` tracer, chaos orders (`agent.chaos`, when the job allows chaos: a duty-cycle delay
  of compute or a delay of sends to one peer), each committed step's wall, compute and communication time
  split from the trace, a per-group profile every few steps, and validation passes at an agreed iteration
  boundary. The agent tails what the worker writes into `Telemetry.record_iteration` (the compute
  detector blames the slow node, not its waiting peers) and `Telemetry.record_profile`. The worker
  processes die with the agent (`_die_with_parent`), as a container's processes die together.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import json
import os
import signal
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from resilientjob.planner.plan import Plan
from resilientjob.protocol.keys import JobKeys
from resilientjob.protocol.messages import WORKLOAD_TERMINATION_PREFIX
from resilientjob.protocol.models import ModelSource, model_source

from . import _parked
from ._device_work import worker_start_method
from ._model_profile import wait_for_first_plan
from ._redis import REDIS_DOWN, Outage
from ._termination import workload_line, write_termination_message
from .config import COLLECTIVE_TIMEOUT_S, POD_PLAN_TIMEOUT_S, JobConfig
from .hooks import StepHooks
from .telemetry import DRAINED_ROLE, Telemetry


def wants_training(model: str) -> bool:
    """Whether the agent trains `model` with the runtime (every model but `synthetic:<profile>`); ValueError
    naming `model` when it names nothing (`protocol.models`: no fallback to the synthetic loop)."""
    return model_source(model) is not ModelSource.SYNTHETIC


# ---- the store's address ---------------------------------------------------------------------------------
async def store_address(client: aioredis.Redis, keys: JobKeys, pod: str, timeout_s: float = 120.0) -> str:
    """The job's store `host:port`: `RJOB_STORE_ADDR`, or the address the job's store pod registered in
    Redis (`store_host`), waited for (with backoff while Redis is away) up to `timeout_s`."""
    if os.environ.get("RJOB_STORE_ADDR"):
        return os.environ["RJOB_STORE_ADDR"]
    deadline = time.monotonic() + timeout_s
    outage = Outage(f"agent {pod}")
    while time.monotonic() < deadline:
        try:
            raw = await client.get(keys.store)
            outage.ok()
        except REDIS_DOWN as exc:
            await asyncio.sleep(outage.failed(exc))
            continue
        if raw:
            return raw.decode() if isinstance(raw, bytes) else str(raw)
        await asyncio.sleep(0.05)
    raise TimeoutError(f"store: the store pod of job {keys.job} registered no address within {timeout_s} s")


# ---- the worker process ----------------------------------------------------------------------------------
def _die_with_parent(parent: int) -> None:
    """A pod's processes die together (a container's cgroup does that in a cluster): SIGKILL on the agent's
    death from the kernel where it can, and a watchdog on the parent id as a fallback."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.1)
        os._exit(1)

    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, name="rjob-parent-watch", daemon=True).start()


def plan_role(plan: Plan, node: int) -> str:
    """What this node computes under `plan` (its ops), as a short key: the detector restarts on change.
    `DRAINED_ROLE` for a node in the plan that computes nothing (S2 drained its replica)."""
    from ._runtime_schedule import build_ops

    ops = build_ops(plan).get(node, [])
    if not ops and node in plan.idle_nodes:
        return DRAINED_ROLE
    text = repr([(op.kind.value, op.pipeline, op.stage, op.microbatch, op.layers) for op in ops])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


class _ProbeHooks(StepHooks):
    """The pod's instruments around the runtime (`_worker_probe`): trace the worker, obey chaos orders,
    report each committed step (wall, compute and communication from the trace) and a profile every few
    steps to the agent through the sink file, run validation at its boundary."""

    def __init__(
        self,
        node: int,
        sink_path: str,
        keys: JobKeys | None,
        device: str = "cpu",
        lane: int = 0,
        collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
        plan_timeout_s: float = POD_PLAN_TIMEOUT_S,
        abort_sink: str | None = None,
    ) -> None:
        from ._worker_probe import WorkerProbe, chaos_client

        self.node = node
        self.lane = lane
        self.abort_sink = abort_sink or sink_path
        """Lane 0's sink, which the agent reads: every lane's abort goes there (`TrainingAgent._forward`)."""
        self.collective_timeout_s = collective_timeout_s
        """The job's collective timeout; an abort sends its plan's wait bound (`runtime.wait_bound_s`): how
        long this worker's peers wait behind a hung one before they abort too."""
        self.wait_bounds: dict[int, float] = {}
        """Generation -> its plan's wait bound, from `on_plan`."""
        self.plan_timeout_s = plan_timeout_s
        """Sent with an abort: how long this worker then waits for the next generation."""
        self.device = device
        """Where a drained node's probe products run (`WorkerProbe.end_step`)."""
        self.roles: dict[int, str] = {}
        sink = open(sink_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the worker process
        self.probe = WorkerProbe(node, sink, lane=lane, device=device)
        if keys is not None:
            self.probe.start_chaos(keys, chaos_client())

    def on_plan(self, plan: Plan) -> None:
        from .runtime import wait_bound_s

        self.wait_bounds[plan.generation] = wait_bound_s(plan, self.collective_timeout_s)
        self.probe.on_plan(plan)

    def on_applied(self, generation: int, rendezvous_s: float, copy_s: float, copied_bytes: int) -> None:
        self.probe.applied(generation, rendezvous_s, copy_s, copied_bytes)

    def on_abort(self, generation: int, step: int, error: str, switching: bool = False) -> None:
        line = {
            "kind": "abort",
            "lane": self.lane,
            "generation": generation,
            "step": step,
            "error": error,
            "switching": switching,
            "collective_timeout_s": self.wait_bounds.get(generation, self.collective_timeout_s),
            "plan_timeout_s": self.plan_timeout_s,
        }
        # One short line appended at once (O_APPEND): the lanes' lines do not interleave.
        with open(self.abort_sink, "a") as sink:
            sink.write(json.dumps(line) + "\n")

    def before_step(self, store: Any, generation: int, step: int, world_rank: int | None) -> None:
        # An iteration boundary: nothing in flight, so a validation pass due now holds training here.
        self.probe.maybe_validate(store, generation, step, world_rank)
        self.probe.begin_step()

    def after_step(self, plan: Plan | None, generation: int, step: int, loss: float, samples: int) -> None:
        if plan is not None and plan.generation not in self.roles:
            self.roles[plan.generation] = plan_role(plan, self.node)
        role = self.roles.get(generation, "")
        drained_on = self.device if role == DRAINED_ROLE else None
        self.probe.end_step(generation, step, samples, loss, role, drained_on=drained_on)


def worker_entry(
    node: int, config: JobConfig, host: str, port: int, sink_path: str, parent: int, local_rank: int = 0
) -> dict[str, object]:
    """Entry point of one worker process (started by `TrainingAgent` through torch elastic); a node whose
    stages span k devices runs k of them, `local_rank` 0..k-1. Every one is instrumented (all take part in
    validation passes and obey chaos), but only local rank 0's sink reaches the telemetry: the others see
    the same steps, and counting them would report each step k times."""
    from ._store_client import ReconnectingStore, address_from_pod_env
    from .worker import device_name, run_from_plan

    abort_sink = sink_path
    if local_rank:
        sink_path = f"{sink_path}.{local_rank}"
    _die_with_parent(parent)
    # A forked child inherits the agent's asyncio signal set-up; torch elastic stops workers with SIGTERM.
    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)
    job = os.environ.get("RJOB_JOB")
    hooks = _ProbeHooks(
        node,
        sink_path,
        JobKeys(os.environ.get("RJOB_NAMESPACE", "default"), job) if job else None,
        device=device_name(config.workload.device, local_rank),
        lane=local_rank,
        collective_timeout_s=config.collective_timeout_s,
        plan_timeout_s=config.plan_timeout_s,
        abort_sink=abort_sink,
    )
    # The store pod may be replaced while the job trains: the worker follows it to its new address.
    timeout = timedelta(seconds=config.plan_timeout_s)
    store = ReconnectingStore(f"{host}:{port}", address_from_pod_env(), timeout, config.plan_timeout_s)
    return run_from_plan(node, config, host, port, local_rank, store=store, hooks=hooks)


# ---- the agent's side ------------------------------------------------------------------------------------
class TrainingAgent:
    """Runs this node's worker (which obeys chaos orders itself) and feeds its reports to the telemetry."""

    def __init__(self, telemetry: Telemetry, config: JobConfig, address: str) -> None:
        self.telemetry = telemetry
        self.config = config
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"store: expected host:port, got {address!r}")
        self.host, self.port = host, int(port)
        self.directory = Path(tempfile.mkdtemp(prefix=f"rjob-{telemetry.keys.job}-{telemetry.node}-"))
        self.sink = self.directory / "steps.jsonl"
        self.sink.touch()
        self.context: Any = None
        self.switches: dict[int, tuple[float, float, int]] = {}
        """Generation -> (rendezvous s, copy s, bytes) of this node's switch to it, until its first step."""
        self.lanes = 1
        """Workers this node runs (`start`): its abort is reported once every one of them aborted."""
        self.aborted: dict[int, dict[int, bool]] = {}
        """Generation -> the lanes that abandoned a step of it (or the switch to it: True)."""

    def devices(self) -> int:
        """Workers this node starts: one per device of its stages in the store's current plan. Blocks until
        the store host listens (up to a minute): call it off the event loop, or the heartbeats stall."""
        from torch._C._distributed_c10d import TCPStore

        from ._plan_store import read_generation, read_plan
        from ._tensor_parallel import tp_degree

        store = TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=60))
        return tp_degree(read_plan(store, read_generation(store)))

    def start(self, devices: int) -> None:
        """Start the node's `devices` workers: forked on the CPU (torch is already imported here, which
        halves start-up on few cores), spawned on an accelerator (`_device_work`)."""
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

        self.lanes, self.aborted = devices, {}
        args = (self.telemetry.node, self.config, self.host, self.port, str(self.sink), os.getpid())
        self.context = start_processes(
            name=f"rjob-node{self.telemetry.node}",
            entrypoint=worker_entry,
            args={local_rank: (*args, local_rank) for local_rank in range(devices)},
            envs={local_rank: {"LOCAL_RANK": str(local_rank)} for local_rank in range(devices)},
            logs_specs=DefaultLogsSpecs(log_dir=str(self.directory / "logs"), redirects=Std.NONE),
            start_method=worker_start_method(self.config.workload.device),
        )

    def pids(self) -> list[int]:
        return list(self.context.pids().values()) if self.context is not None else []

    async def forward_steps(self, stopped: asyncio.Event) -> None:
        """Tail the worker's sink (steps, profiles, validation passes) into the telemetry and the pod log."""
        with self.sink.open() as lines:
            while not stopped.is_set():
                line = lines.readline()
                if not line.endswith("\n"):
                    if line:
                        lines.seek(lines.tell() - len(line))
                    await asyncio.sleep(0.05)
                    continue
                with contextlib.suppress(RedisError, OSError):
                    await self._forward(json.loads(line))

    async def _forward(self, event: dict[str, Any]) -> None:
        kind = event.get("kind", "step")
        if kind == "step":
            chaos = float(event.get("chaos_s") or 0.0)
            print(
                f"step {event['step']} gen {event['generation']} loss {event['loss']:.4f} "
                f"wall {event['wall_s']:.3f}s compute {event['compute_s']:.3f}s"
                + (f" (chaos {chaos:.3f}s)" if chaos > 0 else "")
                + (f" probe {event['probe_s'] * 1e3:.2f}ms" if event.get("probe_s") else ""),
                flush=True,
            )
            # The switch to this generation goes out with its first step's record (`IterationRecord`).
            switch = self.switches.pop(event["generation"], None)
            for older in [g for g in self.switches if g < event["generation"]]:
                del self.switches[older]  # a generation this node switched to but never stepped in
            await self.telemetry.record_iteration(
                event["generation"],
                event["step"],
                event["wall_s"],
                event["samples"],
                event["role"],
                compute_s=event["compute_s"],
                communication_s=event["communication_s"],
                loss=event["loss"],
                chaos_s=chaos,
                switch=switch,
                probe_s=event.get("probe_s"),
            )
        elif kind == "applied":
            self.switches[event["generation"]] = (event["rendezvous_s"], event["copy_s"], event["bytes"])
        elif kind == "profile":
            await self.telemetry.record_profile(
                generation=event["generation"],
                step=event["step"],
                iterations=event["iterations"],
                iteration_s=event["iteration_s"],
                compute_s=event["compute_s"],
                communication_s=event["communication_s"],
                groups=event["groups"],
            )
        elif kind == "abort":
            lane = int(event.get("lane", 0))
            switching = bool(event.get("switching", False))
            print(
                f"gen {event['generation']}: "
                + ("switch abandoned" if switching else f"step {event['step']} abandoned")
                + (f" by device {lane}" if self.lanes > 1 else "")
                + f": {event['error']}; waiting for the next generation",
                flush=True,
            )
            # A node is reported once all its devices aborted: a device that hangs while the others abort
            # is the node hanging (`_aborts` fences it), and re-forming the world with it would stall.
            # Any device's switch makes the node's: its lanes' copies are one node's copies.
            lanes = self.aborted.setdefault(event["generation"], {})
            lanes[lane] = lanes.get(lane, False) or switching
            if len(lanes) < self.lanes:
                return
            for older in [g for g in self.aborted if g < event["generation"]]:
                del self.aborted[older]
            await self.telemetry.record_abort(
                event["generation"],
                event["step"],
                event["error"],
                event["collective_timeout_s"],
                event["plan_timeout_s"],
                switching=any(lanes.values()),
            )
        elif kind == "validation":
            print(
                f"validation {event['id']} at step {event['step']}: held {event['held_s']:.3f}s", flush=True
            )

    async def supervise(self, stopped: asyncio.Event) -> int:
        """Exit status of the pod: 0 when training finished, 1 when the worker failed. A worker the plan
        left out (parked by fail-slow mitigation) ends cleanly; the pod stays up, keeps heartbeating and
        probes its device (`_parked`) until a generation takes the node back, then starts a new worker."""
        while not stopped.is_set():
            result = self.context.wait(timeout=0) if self.context is not None else None
            if result is not None:
                if result.is_failed():
                    print(f"worker failed: {result.failures}", flush=True)
                    for failure in result.failures.values():
                        line = workload_line(failure.message)
                        if line is not None:  # the spec's fault, not the node's: the operator fails the job
                            print(f"worker stopped by the job's spec: {line}", flush=True)
                            await self._tell_workload_error(line)
                            break
                    return 1
                value = result.return_values.get(0) or {}
                if not value.get("left"):
                    return 0
                print("worker left: no part for this node in the plan; probing its device", flush=True)
                back = await _parked.until_taken_back(
                    self.telemetry, stopped, self.probe_devices(), self.telemetry.step
                )
                if back is None:
                    return 0
                self.context.close()
                print(f"generation {back.generation} takes this node back: starting its worker", flush=True)
                self.start(await asyncio.to_thread(self.devices))
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopped.wait(), 0.2)
        return 0

    async def _tell_workload_error(self, line: str) -> None:
        """Tell the operator that the job's spec stopped this node's worker: in Redis while this agent still
        beats (a kubelet may report the pod's exit after its heartbeat expired, and the node would be fenced
        as failed), and in the container's termination message, which outlives Redis."""
        write_termination_message(line)
        keys = self.telemetry.keys
        with contextlib.suppress(*REDIS_DOWN):
            await self.telemetry.client.hset(
                keys.workload_errors, str(self.telemetry.node), WORKLOAD_TERMINATION_PREFIX + line
            )

    def probe_devices(self) -> list[str]:
        """The devices a parked node probes: each accelerator its workers used (only named here: the probing
        child makes each current, `_parked.measure`); on the CPU the one "cpu" its lanes shared."""
        from .worker import device_name

        kind = self.config.workload.device
        return [device_name(kind, lane) for lane in range(self.lanes if kind != "cpu" else 1)]

    def stop(self) -> None:
        if self.context is not None:
            self.context.close()
        with contextlib.suppress(OSError):
            for path in sorted(self.directory.rglob("*"), reverse=True):
                path.unlink() if path.is_file() else path.rmdir()
            self.directory.rmdir()


def preload() -> None:
    """Import what the workers need, so that their fork inherits it. Call it before the agent's first
    heartbeat: loading torch's shared libraries holds the GIL for seconds on a busy node (seen: pods fenced
    for a lapsed heartbeat with this import in flight in a thread, on two loaded cores; none since it moved
    here), while a pod that has not beaten yet is judged by its phase alone."""
    import torch.distributed.elastic.multiprocessing  # noqa: F401

    from . import worker  # noqa: F401


async def train(telemetry: Telemetry, stopped: asyncio.Event, config: JobConfig) -> int:
    """Run this pod's share of a real training job until it ends or `stopped`; returns the exit status."""
    workload, model = config.workload, config.workload.model
    # A job whose profile only a pod can make has no plan yet: wait for it as long as it takes (node 0
    # makes the profile meanwhile, and reports a model it cannot load rather than die of it here); the
    # store host registers only once a plan exists.
    published = await wait_for_first_plan(telemetry, stopped, workload, config.model_options)
    if published is None:
        return 0
    # Importing torch takes seconds on a loaded machine: off the event loop, or heartbeats would lapse and
    # the operator would fence this pod as dead before it ever trained.
    # (Loading the model checks it; the imports are `preload`'s.)
    layers = (await asyncio.to_thread(config.load_model)).num_layers
    if published.plan.num_layers != layers:
        raise ValueError(
            f"model: {model} has {layers} layers but the job's profile has {published.plan.num_layers}"
        )
    address = await store_address(telemetry.client, telemetry.keys, telemetry.pod)
    agent = TrainingAgent(telemetry, config, address)
    # The store host may still be starting: waiting for it on the event loop would stall the heartbeats.
    agent.start(await asyncio.to_thread(agent.devices))
    # torch elastic installs SIGTERM/SIGINT handlers that raise; a pod stops cleanly through `stopped`.
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopped.set)
    print(f"training {model} on node {telemetry.node}; store {address}", flush=True)
    done = asyncio.Event()
    helpers = [asyncio.create_task(agent.forward_steps(done))]
    supervisor = asyncio.create_task(agent.supervise(stopped))
    try:
        code = await supervisor
        await asyncio.sleep(0.1)  # the last step lines
        return code
    finally:
        done.set()
        await asyncio.gather(*helpers, return_exceptions=True)
        agent.stop()
