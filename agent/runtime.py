"""The training runtime of one worker: execute any plan, and switch to a new plan in the same process.

A `Trainer` holds the layers its node owns under the current plan. One step runs the node's 1F1B ops (see
`_runtime_schedule`), sums gradients layer range by layer range across replicas in the restorer's colour
rounds, then commits atomically (`_runtime_commit`): every rank votes in the job's store, then a world
all-reduce of the step's loss and of a "new plan seen" flag, after which every worker applies its optimizers;
if a peer dies in between, the votes decide, identically on every survivor. Only committed steps count; an
abandoned step is redone under the next plan, so the global step and the global batch are preserved, and all
survivors always stand at the same step.

Why the update equals the symmetric one: each micro-batch's loss is the sum of its per-sample losses divided
by the global batch B, and replicas' gradients are summed (never averaged). Whatever the split of the batch
over pipelines, micro-batches or rerouted peers, every parameter receives sum(per-sample gradients) / B.

Reconfiguration re-initialises the default process group in place: `destroy_process_group()`, then
`init_process_group(store=PrefixStore(f"gen{g}/", store))` over the same TCPStore the launcher hosts, with
this plan's ranks; the per-generation prefix keeps the new rendezvous from reading the old one's keys. Every
wait goes through `_runtime_wait.Waiter`: a wait blocked behind a dead peer is abandoned as soon as the
launcher announces the failure in the store (`FailureNotice`), and at the latest after the plan's wait bound
(`wait_bound_s`: `collective_timeout_s`, or three of the plan's estimated steps when longer; on gloo also the
groups' own timeout), never after the 30-minute default. Groups left with operations pending behind a dead
peer are retired, not destroyed (`_runtime_commit.Retirement`), because destroying them hangs.

A stage may span k devices of its node (`StagePlan.gpus`): the node then runs k workers, one per local rank
j, world rank = (position of the node in `world_nodes`) * k + j, and each block is tensor-parallel over the
node's k ranks (`_tensor_parallel`). The rest of the runtime runs in k independent lanes: local rank j
exchanges activations with local rank j of the neighbouring stages, sums gradients with local rank j of the
other replicas (one group per colour-round group per lane), and copies shard j of a layer from local rank j
of the source; only lane 0 reports the loss and the sample ids, and every rank votes. Every live stage must
have the same k, and k > 1 excludes rerouting (`check_supported`). The tensor-parallel collectives inside a
block are DTensor's own (blocking, bounded by the stage group's timeout, `collective_timeout_s`, rather
than the `Waiter`). The k ranks of a stage live and die with their node, but its lanes can part at a wait
between nodes: a dead peer's lane 1 sent before it died and its lane 0 did not. Lane 0 then abandons the
step while lane 1 waits for it in the next tensor-parallel collective; that wait fails after the collective
timeout (the default of 30 minutes held the whole job, a flaky test under load) and lane 1 abandons too.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store
from torch.distributed.device_mesh import DeviceMesh

from resilientjob.planner.plan import Plan
from resilientjob.protocol.messages import abort_line
from resilientjob.protocol.store_keys import GENERATION_KEY, arriving_key
from resilientjob.protocol.workload import Precision, TrainingSpec

from ._runtime_commit import (
    CommitPhase,
    CommittedStep,
    CommitVote,
    FaultHook,
    ReconfigurationError,
    Retirement,
    RolledStep,
    VotedStep,
    agree_on_step,
    leave_world,
    reduce_dtype,
)
from ._runtime_grads import GradientSync
from ._runtime_p2p import PeerChannels, directional_groups, send_order
from ._runtime_schedule import Op, OpKind, build_ops, held_layers, lane_ranks, world_nodes
from ._runtime_wait import ComputeError, FailureNotice, PeerFailure, Waiter
from ._tensor_parallel import shard_layer, stage_groups, stage_mesh, tp_degree
from .data import SampleOrder, TokenDataset, fingerprint
from .hooks import StepHooks
from .models import ModelSpec, lm_loss
from .optim import PLAIN_ADAMW, clip_coefficient, lr_at, set_lr
from .p2p import LayerState, TransferRecord, switch_copies


def check_supported(plan: Plan) -> int:
    """Return the plan's tensor-parallel degree k (devices per stage, one worker each); raise PlannerError
    naming the field when live stages span different numbers of devices or k > 1 comes with rerouting."""
    return tp_degree(plan)


def backend_for(device: torch.device | str) -> str:
    """Collective backend for a device type: CUDA -> NCCL, Ascend NPU -> HCCL, CPU -> gloo."""
    # A string is split by hand: torch.device("npu") only parses once torch_npu has registered the type.
    kind = device.split(":")[0] if isinstance(device, str) else device.type
    if kind == "cuda":
        return "nccl"
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  - registers the NPU device and the HCCL backend (extra `ascend`)
        except ImportError:
            raise ValueError("device: npu needs torch_npu (pip install 'resilientjob[ascend]')") from None
        return "hccl"
    if kind == "cpu":
        return "gloo"
    raise ValueError(f"device: no collective backend for device type {kind!r}")


def join_world(
    store: Store, generation: int, rank: int, world_size: int, timeout_s: float, device: str = "cpu"
) -> None:
    """Create the default process group for one plan generation, in this process (the previous one must
    have been left: `Trainer` does it with `_runtime_commit.leave_world`)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    backend = backend_for(device)
    if backend != "gloo":
        # The runtime gives up on a blocked operation itself (`Waiter`, after `timeout_s`), then waits for the
        # operator's next plan and aborts the old group when it leaves it. NCCL's watchdog would instead
        # take the whole process down once an operation on a dead peer passed the group's timeout, seconds
        # before that plan comes: the survivors of a failure died with it. So the watchdog only reports,
        # and the group's own timeout is far past the runtime's.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    dist.init_process_group(
        backend=backend,
        store=PrefixStore(f"gen{generation}/", store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=group_timeout_s(device, timeout_s)),
    )


def group_timeout_s(device: torch.device | str, timeout_s: float) -> float:
    """A process group's own timeout: the runtime's on gloo, whose operations fail by it; far longer on an
    accelerator, whose watchdog must not act before the runtime has (`join_world`)."""
    return timeout_s if backend_for(device) == "gloo" else max(timeout_s, ACCELERATOR_GROUP_TIMEOUT_S)


WAIT_BOUND_STEPS = 3.0
"""A plan's waits may make no progress for this many of its estimated steps (`wait_bound_s`)."""


def wait_bound_s(plan: Plan, collective_timeout_s: float) -> float:
    """How long one wait of `plan`'s world may make no progress before the step (or the switch) is
    abandoned: the collective timeout, or `WAIT_BOUND_STEPS` of the plan's estimated steps when that is
    longer. A healthy rank waits up to about a step: a 1F1B stage's first backward comes only after the
    pipeline's forwards and the later stages' backwards, a replica's gradient all-reduce waits for the
    slowest replica (one slowed on purpose, as fail-slow leaves it until mitigated), and the switch's last
    all-reduce for the longest layer copy, which grows with the model as its steps do. A bound of a fixed
    5 s abandoned every step of a model whose steps are longer, and the operator re-formed its world
    forever; the worker reports the bound with its abort, so the operator's hang window grows with it."""
    return max(collective_timeout_s, WAIT_BOUND_STEPS * plan.step_time_s)


ACCELERATOR_GROUP_TIMEOUT_S = 1800.0
"""The NCCL/HCCL groups' own timeout: the runtime's `Waiter` abandons an operation long before (at the
plan's `wait_bound_s`); this only bounds what a group left behind could hold."""

JOIN_WAIT_S = 300.0
"""How long a joining node waits for its peers to reach the rendezvous of the plan that takes it in."""


def arrive(store: Store, generation: int, world_size: int, joining: bool) -> None:
    """Count this rank in at the generation's rendezvous. A joining node is idle when the plan appears,
    while its peers reach the rendezvous only at the end of their step, which on a busy machine can take
    longer than the rendezvous timeout: so it enters only once every rank has arrived, or gives up when a
    newer plan replaces this one (RuntimeError: the caller moves on to that plan)."""
    key = arriving_key(generation)
    store.add(key, 1)
    deadline = time.monotonic() + JOIN_WAIT_S
    while joining and int(store.add(key, 0)) < world_size:
        if int(store.add(GENERATION_KEY, 0)) > generation or time.monotonic() > deadline:
            raise RuntimeError(f"join: the peers did not reach the rendezvous of generation {generation}")
        time.sleep(0.01)


@dataclass(slots=True)
class StepTimings:
    """Seconds spent in each phase of the last reconfiguration (written to the store for benchmarks)."""

    rendezvous_s: float = 0.0
    copy_s: float = 0.0
    bytes_received: int = 0


@dataclass(slots=True)
class Trainer:
    """One worker's model shard, optimizer state and position in the data stream."""

    node: int
    model: ModelSpec
    dataset: TokenDataset
    global_batch: int
    training: TrainingSpec = PLAIN_ADAMW
    """AdamW, schedule, clipping and precision (`spec.training`)."""
    collective_timeout_s: float = 5.0
    device: str = "cpu"
    """Where layers, optimizer state, activations and receive buffers live: `cpu`, `cuda:<j>`, `npu:<j>`."""
    checkpoint_interval_s: float = 0.0
    """World rank 0 asks for a checkpoint at the first commit this long after the last one (0: never); the
    request travels in the commit all-reduce so every worker checkpoints the same step."""
    local_rank: int = 0
    """This worker's index among its node's `degree` workers (the j-th entry of its stage's gpus)."""
    degree: int = 1
    """Devices (workers) per stage: the tensor-parallel degree every plan this trainer applies must have."""
    layers: dict[int, LayerState] = field(default_factory=dict)
    step: int = 0
    """Committed steps so far; the next step to run."""
    joining: bool = False
    """A new node joining a job that has trained already (a replacement pod): it holds nothing and takes the
    step of the world it joins instead of voting one."""
    plan: Plan | None = None
    generation: int = -1
    received: list[TransferRecord] = field(default_factory=list)
    timings: StepTimings = field(default_factory=StepTimings)
    _ops: list[Op] = field(default_factory=list)
    _grads: GradientSync | None = None
    """This generation's gradient groups (`_runtime_grads`)."""
    _rank_of: dict[int, int] = field(default_factory=dict)
    _order: SampleOrder = field(init=False)
    notice: FailureNotice = field(default_factory=lambda: FailureNotice(None))
    """Trips when a failure the current plan does not account for is announced."""
    _waiter: Waiter = field(init=False)
    store: Store | None = None
    """The job's store (the one `apply_plan` joined through); commit votes go there."""
    fault_hook: FaultHook | None = None
    """Fault injection: called as hook(step, phase) at each `CommitPhase` (tests kill the worker there)."""
    hooks: StepHooks = field(default_factory=StepHooks)
    """Called around plans and steps (`hooks`): the pod's probe, or nothing."""
    retirement: Retirement = field(default_factory=Retirement)
    _pending: list[object] = field(default_factory=list)
    """Work items of the step in progress (and the transfers of a switch), kept until it commits."""
    _abandoned: bool = False
    """The last step or switch failed: the current groups may have operations pending on a dead peer."""
    _world_size: int = 0
    _tp_groups: list[dist.ProcessGroup] = field(default_factory=list)
    _channels: PeerChannels | None = None
    """This generation's pipeline messages (`_runtime_p2p`)."""
    p2p_in_order: bool = False
    """Match pipeline messages by their order alone also on gloo, as NCCL and HCCL do (the tests' check that
    the order is right without tags)."""
    _mesh: DeviceMesh | None = None
    """The DeviceMesh of this node's stage ranks under the current plan (degree > 1 only)."""
    _unsharded: set[int] = field(default_factory=set)
    """Layers built whole by `init_layers` before any world existed; sharded when the first plan is joined."""
    checkpoint_due: bool = False
    """The last committed step is one every worker checkpoints (time interval, decided by world rank 0)."""
    _checkpoint_clock: float = field(default_factory=time.monotonic)
    last_grad_norm: float = 0.0
    """Global gradient norm of the last committed step (before clipping)."""
    _voted: VotedStep | None = None
    """The step this rank voted for and has not applied (its summed gradients are still in `.grad`)."""
    _committed: CommittedStep | None = None
    rolled: list[RolledStep] = field(default_factory=list)
    """Steps applied at a rendezvous because the peers had committed them (the worker records them)."""
    on_rolled: Callable[[RolledStep], None] | None = None
    """Called with such a step as soon as it is applied, before any layer of the new plan moves: the worker
    checkpoints it if it was due, as its peers did when they committed it."""
    _fingerprint: int | None = None
    """The data set's digest (`data.fingerprint`), read once, at the first rendezvous."""
    _copied: set[int] = field(default_factory=set)
    """Layers received since the model last changed: a re-formed switch does not copy them again
    (`p2p.switch_copies`)."""

    def __post_init__(self) -> None:
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s: must be > 0, got {self.collective_timeout_s}")
        if self.degree < 1:
            raise ValueError(f"degree: must be >= 1, got {self.degree}")
        if not 0 <= self.local_rank < self.degree:
            raise ValueError(f"local_rank: must be in [0, {self.degree}), got {self.local_rank}")
        self._order = SampleOrder(self.dataset.num_samples, self.global_batch, seed=self.dataset.seed)
        self._waiter = Waiter(self.collective_timeout_s, device=self.device)

    @property
    def comm_device(self) -> torch.device:
        """Where tensors handed to collectives live: the accelerator for NCCL/HCCL, the CPU for gloo."""
        return torch.device("cpu") if backend_for(self.device) == "gloo" else torch.device(self.device)

    def _wait(self, work: dist.Work | None, what: str) -> None:
        if work is not None:
            self._pending.append(work)
        self._waiter.wait(work, self.notice, what)

    def _track(self, work: dist.Work | None) -> dist.Work | None:
        if work is not None:
            self._pending.append(work)
        return work

    def _leave(self) -> None:
        """Leave the current world: destroy it after clean steps, retire (or abort) it after a failure."""
        keep: list[object] = list(self._grads.handles()) if self._grads is not None else []
        keep.extend(self._tp_groups)
        if self._channels is not None:
            keep.extend([*self._channels.groups, *self._channels.outstanding()])
        leave_world(self.retirement, self.generation, keep + self._pending, self._abandoned)
        self._grads, self._pending, self._abandoned = None, [], False
        self._tp_groups, self._mesh = [], None
        self._channels = None

    def _data_fingerprint(self) -> int:
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.dataset)
        return self._fingerprint

    def close(self) -> None:
        """Leave the process group and stop the wait helpers."""
        self._leave()
        self._waiter.close()

    def _current(self) -> Plan:
        if self.plan is None:
            raise RuntimeError("plan: the trainer has not applied a plan yet")
        return self.plan

    # ---- layers ------------------------------------------------------------------------------------------
    def make_layer(self, index: int, initial: bool = True) -> LayerState:
        """Layer `index` on this worker's device with its initial weights (seeded, or read from the model
        directory), or, with `initial=False`, only allocated (its contents arrive by a peer-to-peer copy, so
        nothing is read from disk); this rank's shard of it when stages are tensor-parallel."""
        module = (self.model.layer(index) if initial else self.model.allocate(index)).to(self.device)
        if self.degree > 1:
            if self._mesh is None:
                raise RuntimeError("degree: a tensor-parallel layer needs the stage mesh of a joined plan")
            module = shard_layer(module, self._mesh)
        return LayerState(index, module, training=self.training)

    def _receive_layer(self, index: int) -> LayerState:
        return self.make_layer(index, initial=False)

    def init_layers(self, plan: Plan) -> None:
        """Build this node's layers of the first plan (no communication); with several devices per stage
        they are sharded when the plan is joined (the stage mesh needs the world)."""
        for index in sorted(held_layers(plan).get(self.node, set())):
            module = self.model.layer(index).to(self.device)
            self.layers[index] = LayerState(index, module, training=self.training)
            if self.degree > 1:
                self._unsharded.add(index)

    def _rebind(self) -> None:
        """Re-create every held layer on the new stage mesh, keeping this rank's shard of its state.

        A tensor-parallel layer's parameters are DTensors bound to the mesh (and process group) of the plan
        they were built under; after a switch that group is gone, so each layer is rebuilt for the new mesh
        (slicing locally, no communication) and its local parameters and AdamW state are copied over."""
        for index in sorted(self.layers):
            fresh = self.make_layer(index, initial=index in self._unsharded)
            if index not in self._unsharded:
                with torch.no_grad():
                    for target, source in zip(fresh.tensors(), self.layers[index].tensors(), strict=True):
                        target.copy_(source)
            self.layers[index] = fresh
        self._unsharded.clear()

    @property
    def last_committed(self) -> CommittedStep | None:
        """The last step this trainer committed itself (not one it applied at a rendezvous)."""
        return self._committed

    @property
    def world_rank(self) -> int | None:
        """This node's rank in the current plan's process group (None when it has no part in it)."""
        return self._rank_of.get(self.node)

    @property
    def wait_bound_s(self) -> float:
        """How long a wait of the current plan's world may make no progress (`wait_bound_s`)."""
        if self.plan is None:
            return self.collective_timeout_s
        return wait_bound_s(self.plan, self.collective_timeout_s)

    @property
    def active(self) -> bool:
        return self.plan is not None and self.node in self._rank_of

    # ---- plans -------------------------------------------------------------------------------------------
    def apply_plan(self, plan: Plan, store: Store) -> bool:
        """Join plan `plan.generation`, copy missing layers, drop surplus ones.

        Returns False if this node has no part in the plan."""
        self.hooks.on_plan(plan)  # before the layer copy, so that a slowed link already delays its sends
        if plan.global_batch != self.global_batch:
            raise ReconfigurationError(
                f"global_batch: plan has {plan.global_batch}, job runs {self.global_batch}"
            )
        if check_supported(plan) != self.degree:
            raise ReconfigurationError(
                f"gpus: plan {plan.generation} has {tp_degree(plan)} devices per stage, the job's workers "
                f"run {self.degree}"
            )
        nodes = world_nodes(plan)
        self._leave()
        self.plan, self.generation, self.store = plan, plan.generation, store
        self._waiter.timeout_s = self.wait_bound_s
        self.notice = FailureNotice.for_generation(store, plan.generation)
        if self.node not in nodes:
            self._rank_of = {}
            return False
        try:
            return self._join(plan, store, nodes)
        except BaseException:
            self._abandoned = True
            raise

    def _join(self, plan: Plan, store: Store, nodes: list[int]) -> bool:
        started = time.perf_counter()
        k = self.degree
        # Lane j's view of the world: node -> rank of its local rank j (p2p ops address lane peers).
        self._rank_of = lane_ranks(nodes, k, self.local_rank)
        self._world_size = len(nodes) * k
        arrive(store, plan.generation, self._world_size, self.joining)
        join_world(
            store, plan.generation, self._rank_of[self.node], self._world_size, self.wait_bound_s, self.device
        )
        # Everyone resumes at the same committed step, or nobody resumes live. A joining node has no step of
        # its own: it votes neither bound and takes the one the others agree on (the data order and the
        # learning-rate schedule follow from it; AdamW's step counts arrive with the layers).
        # A rank one step behind (its commit was lost with a replaced store) applies the step its peers
        # committed, before any layer moves (`_runtime_commit.agree_on_step`).
        agreed, rolled = agree_on_step(
            self.step,
            self.joining,
            self._voted,
            self._committed,
            self.comm_device,
            self._wait,
            self.dataset.num_samples,
            self._data_fingerprint(),
        )
        if rolled is not None:
            self._apply_update(rolled.sq_norm)
            self.rolled.append(rolled)
            if self.on_rolled is not None:
                self.on_rolled(rolled)
        if self.joining:
            self.step, self.joining = agreed, False
        if k > 1:
            groups = stage_groups(len(nodes), k, group_timeout_s(self.device, self.wait_bound_s))
            for node, group in zip(nodes, groups, strict=True):
                if node == self.node:
                    self._tp_groups.append(group)
                    self._mesh = stage_mesh(group, self.device)
            self._rebind()
        rendezvous = time.perf_counter()
        records = switch_copies(
            plan.transfers,
            self.node,
            self._copied,
            self.layers,
            self._receive_layer,
            self._wait,
            self._rank_of,
            lane=self.local_rank,
            stage_group=self._tp_groups[0] if self._tp_groups else None,
            comm_device=self.comm_device,
        )
        keep = held_layers(plan).get(self.node, set())
        missing = keep - set(self.layers)
        if missing:
            raise ReconfigurationError(
                f"transfers: node {self.node} lacks layers {sorted(missing)} after copying"
            )
        for index in set(self.layers) - keep:
            del self.layers[index]
        self.received.extend(records)
        schedule = build_ops(plan)
        self._ops = schedule.get(self.node, [])
        self._channels = PeerChannels(
            self.node,
            self._rank_of,
            send_order(schedule, self.node),
            directional_groups(self._world_size, group_timeout_s(self.device, self.wait_bound_s)),
            device=self.device,
            tagged=backend_for(self.device) == "gloo" and not self.p2p_in_order,
        )
        position = {node: index for index, node in enumerate(nodes)}
        self._grads = GradientSync.join(plan, self.node, self.local_rank, k, position, self.model.tied)
        self._grads.attach(self.layers)
        self.timings = StepTimings(
            rendezvous_s=rendezvous - started,
            copy_s=time.perf_counter() - rendezvous,
            bytes_received=sum(record.bytes for record in records),
        )
        self._pending = []
        return True

    # ---- one step ----------------------------------------------------------------------------------------
    def _inputs(self, step: int, microbatch: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        ids = self._order.microbatch_ids(step, microbatch, self._current().microbatch_size)
        inputs, targets = self.dataset.batch(ids)
        if torch.device(self.device).type == "cuda":
            # From pageable memory the driver may stage the copy synchronously, holding the host until the
            # device has drained its queue, once per micro-batch; from pinned memory it is queued.
            inputs, targets = inputs.pin_memory(), targets.pin_memory()
        return ids, inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.training.precision is Precision.BF16:
            return torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _own_compute(self, what: str, *args: object) -> Iterator[None]:
        """Around this worker's own computation: its RuntimeError (a shape error in the model, an
        out-of-memory, a device fault) becomes a ComputeError, which no new plan answers. Tensor-parallel
        layers talk to their peers inside forward and backward, so there an error may be a peer's and stays
        a RuntimeError. `what` is formatted with `args` only on an error: this wraps every micro-batch."""
        try:
            yield
        except RuntimeError as exc:
            if self.degree > 1 or isinstance(exc, PeerFailure):
                raise
            raise ComputeError(
                f"node {self.node}, step {self.step}: {what.format(*args)} failed: {exc}"
            ) from exc

    def _forward(self, layers: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
        with self._own_compute("forward of layers {}..{}", layers[0], layers[1] - 1), self._autocast():
            for index in range(*layers):
                x = self.layers[index].module(x)
        # Activations cross stages in fp32 whatever the compute precision: the residual stream stays exact.
        return x if x.dtype == torch.long else x.float()

    def _recv(
        self, shape: tuple[int, ...], src: int, tag: int, mailbox: dict[int, torch.Tensor]
    ) -> torch.Tensor:
        if src == self.node:
            return mailbox.pop(tag)
        buffer, work = self._peer_channels().recv(shape, src, tag)
        self._wait(work, f"receive from node {src}")
        return buffer

    def _peer_channels(self) -> PeerChannels:
        if self._channels is None:
            raise RuntimeError("p2p: the trainer has not joined a world")
        return self._channels

    def run_step(self, latest_generation: int) -> tuple[float, bool, list[int]]:
        """Run and commit one step. Returns (mean loss, whether a newer plan is waiting, sample ids whose
        loss this node computed). Raises RuntimeError if a peer fails and the step is abandoned; every
        survivor then abandons it too (see `_runtime_commit`)."""
        self.hooks.before_step(self.store, self.generation, self.step, self.world_rank)
        try:
            loss, switch, ids = self._run_step(latest_generation)
        except BaseException:
            self._abandoned = True
            raise
        self.hooks.after_step(self.plan, self.generation, self.step, loss, len(ids))
        return loss, switch, ids

    def _gradient_sync(self) -> GradientSync:
        if self._grads is None:
            raise RuntimeError("gradients: the trainer has not joined a world")
        return self._grads

    def _fault(self, phase: CommitPhase) -> None:
        if self.fault_hook is not None:
            self.fault_hook(self.step, phase)

    def _run_step(self, latest_generation: int) -> tuple[float, bool, list[int]]:
        if self._abandoned:
            # The last commit was decided by the vote after this rank's commit all-reduce failed: the world's
            # collectives are out of step (a rank never issued the one the others did), and the next one
            # could pair with a stale operation of theirs and commit a step on this rank alone (seen: the
            # re-formed world found its ranks two steps apart, one without the gradients to catch up, and
            # every worker exited). No step more in this world: the next generation starts clean.
            raise PeerFailure(f"step {self.step}: the world's collectives broke at the last commit")
        step, plan = self.step, self._current()
        grads = self._gradient_sync()
        grads.zero(self.layers)
        self._voted = None  # its gradients are gone
        shape = self.model.hidden_shape(plan.microbatch_size)
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        mailbox: dict[int, torch.Tensor] = {}
        sends: list[dist.Work] = []
        channels = self._peer_channels()
        channels.start_step()
        # Summed on the device and read once at the commit: one host synchronisation per step, not per
        # micro-batch.
        loss_sum = torch.zeros((), dtype=reduce_dtype(torch.device(self.device)), device=self.device)
        sample_ids: list[int] = []
        for op in self._ops:
            key = (op.microbatch, op.layers[0])
            if op.kind == OpKind.FORWARD:
                if op.first:
                    ids, x, targets = self._inputs(step, op.microbatch)
                    inputs: torch.Tensor | None = None
                else:
                    x = self._recv(shape, _peer(op.recv_from, op), op.tag, mailbox).requires_grad_()
                    inputs = x
                y = self._forward(op.layers, x)
                if op.last:
                    if not op.first:  # a node that ran the first layers already holds the targets
                        ids, _, targets = self._inputs(step, op.microbatch)
                    with self._own_compute("the loss"), self._autocast():
                        y = lm_loss(y, targets) / plan.global_batch
                    if self.local_rank == 0:  # the k ranks of a stage compute the same loss: count it once
                        loss_sum += y.detach().to(loss_sum.dtype)
                        sample_ids.extend(ids)
                else:
                    sends.extend(self._send(y.detach(), op.send_to, op.send_tag, mailbox))
                saved[key] = (inputs, y)
            else:
                inputs, y = saved.pop(key)
                if op.last:
                    with self._own_compute("backward of layers from {}", op.layers[0]):
                        torch.autograd.backward([y])
                else:
                    grad = self._recv(tuple(y.shape), _peer(op.recv_from, op), op.tag, mailbox)
                    with self._own_compute("backward of layers from {}", op.layers[0]):
                        torch.autograd.backward([y], [grad])
                if inputs is not None:
                    if inputs.grad is None:
                        raise RuntimeError(f"backward: no input gradient for {op}")
                    sends.extend(self._send(inputs.grad, op.send_to, op.send_tag, mailbox))
        for work in sends:
            self._wait(work, "send")
        channels.finish_step()
        grads.sum_replicas(self.layers, self._track, self._wait)
        grads.sum_tied(self.layers, self._track, self._wait, self.comm_device)
        clipping = self.training.grad_clip_norm > 0
        norm_share = grads.norm_share(self.layers, self.local_rank, self.device) if clipping else 0.0
        loss, switch, total_sq_norm = self._commit(
            float(loss_sum), latest_generation > self.generation, norm_share, sample_ids
        )
        self._committed = CommittedStep(self.generation, step, loss, total_sq_norm, self.checkpoint_due)
        self._apply_update(total_sq_norm)
        if not self._abandoned:
            self._pending = []
        return loss, switch, sample_ids

    def _apply_update(self, total_sq_norm: float) -> None:
        """The optimizer step of the current step from its summed gradients, clipped by the global norm."""
        self.last_grad_norm = total_sq_norm**0.5 if total_sq_norm > 0 else 0.0
        coefficient = clip_coefficient(total_sq_norm, self.training.grad_clip_norm)
        lr = lr_at(self.training, self.step)
        for layer in self.layers.values():
            if coefficient < 1.0:
                for param in layer.module.parameters():
                    if param.grad is not None:
                        param.grad.mul_(coefficient)
            set_lr(layer.optimizer, lr)
            layer.optimizer.step()
        self.step += 1
        self._voted = None
        self._copied.clear()  # the layers changed: a copy made before is not one to keep

    def _commit(
        self, loss_share: float, newer_plan: bool, sq_norm_share: float, sample_ids: list[int]
    ) -> tuple[float, bool, float]:
        """Vote, then all-reduce the loss, the squared gradient norm, the "newer plan seen" flag (so all
        switch after the same step) and the checkpoint request (world rank 0's clock). Returns (loss,
        switch, squared norm) once the step is committed; raises PeerFailure if it is abandoned."""
        if self.store is None or self.world_rank is None or self.plan is None:
            raise RuntimeError("commit: the trainer has not joined a world")
        vote = CommitVote(self.store, self.generation, self.step, self.world_rank, self._world_size)
        self._fault(CommitPhase.VOTE)
        if not vote.vote([loss_share, sq_norm_share], sample_ids):
            raise PeerFailure(f"commit of step {self.step}: the vote was closed (a peer failed)")
        self._voted = VotedStep(self.generation, self.step, self.plan)
        self._fault(CommitPhase.VOTED)
        checkpoint = (
            self.world_rank == 0
            and self.checkpoint_interval_s > 0
            and time.monotonic() - self._checkpoint_clock >= self.checkpoint_interval_s
        )
        flags = [loss_share, sq_norm_share, 1.0 if newer_plan else 0.0, 1.0 if checkpoint else 0.0]
        commit = torch.tensor(flags, dtype=reduce_dtype(self.comm_device), device=self.comm_device)
        try:
            self._wait(dist.all_reduce(commit, async_op=True), "commit")
        except RuntimeError as exc:
            totals = vote.close()
            if totals is None:
                raise
            # Said, as the worker says an abandoned step: a fault here would otherwise leave no trace.
            said = f"commit of step {self.step}: {abort_line(exc)}; every rank had voted: committed"
            print(said, flush=True)
            # The world's all-reduce failed here: its groups may hold operations pending on the dead peer,
            # so they must be retired, not destroyed, whenever this trainer leaves them (even at close()).
            self._abandoned = True
            # Peers may still wait in it for this rank's part, dead peer or not (a reset connection): they
            # learn that the world broke at their next look, not after their collective timeout.
            self.notice.abandon()
            # Every rank voted before the failure: the step is committed everywhere. The flags are lost; no
            # rank starts a next step in this world (`_run_step`), and the switch happens then, alike.
            self._fault(CommitPhase.REDUCED)
            self.checkpoint_due = False
            return totals[0], False, totals[1]
        self._fault(CommitPhase.REDUCED)
        values = commit.tolist()
        self.checkpoint_due = values[3] > 0
        if self.checkpoint_due:
            self._checkpoint_clock = time.monotonic()
        return float(values[0]), values[2] > 0, float(values[1])

    def _send(
        self, tensor: torch.Tensor, dst: int | None, tag: int, mailbox: dict[int, torch.Tensor]
    ) -> list[dist.Work]:
        target = _peer(dst, "send")
        if target == self.node:
            mailbox[tag] = tensor
            return []
        work = self._track(self._peer_channels().send(tensor.float().contiguous(), target, tag))
        return [work] if work is not None else []


def _peer(node: int | None, op: object) -> int:
    """The neighbour an op exchanges with; the schedule guarantees one exists where it is used."""
    if node is None:
        raise RuntimeError(f"schedule: {op} has no neighbour to exchange with")
    return node
