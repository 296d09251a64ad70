"""A layer's trainable state (parameters + AdamW state) and its peer-to-peer copy between workers.

A layer travels as a fixed list of tensors: its parameters in `named_parameters` order, then per parameter
the AdamW `exp_avg`, `exp_avg_sq` and `step`. The optimizer state is created eagerly (zeros, step 0; AdamW's
first update is then identical to its lazy initialisation), so the list, and therefore the bytes a transfer
moves, is the same before and after the first step and equals `layer_state_bytes`, the figure the profiler
writes into `LayerProfile.param_bytes + optimizer_bytes` and the restorer puts into `Transfer.bytes`.
A tensor-parallel layer (`_tensor_parallel`) lists only this rank's shard of each tensor, so shard j moves
from local rank j of the source to local rank j of the destination; its replicated tensors (norms, rowwise
biases, AdamW step counts) travel with every shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from resilientjob.planner.plan import Transfer
from resilientjob.protocol.workload import TrainingSpec

from ._dtensor import is_dtensor, local
from ._runtime_wait import Wait
from .optim import PLAIN_ADAMW, make_adamw

# Tags of layer-state messages live above the pipeline's activation tags.
_TAG_BASE = 1 << 30


@dataclass(slots=True)
class LayerState:
    """One layer held by a worker: the module and its own AdamW (AdamW is element-wise, so per-layer
    optimizers update exactly as one optimizer over all layers would)."""

    index: int
    module: nn.Module
    optimizer: torch.optim.Optimizer = field(init=False)
    training: TrainingSpec = PLAIN_ADAMW
    """AdamW's settings (`optim.make_adamw`); the learning rate is set per step from the schedule."""

    def __post_init__(self) -> None:
        self.optimizer = make_adamw(self.module, self.training)
        fused = bool(self.optimizer.defaults.get("fused"))
        for param in self.module.parameters():
            self.optimizer.state[param] = {
                # Where torch keeps it: on the CPU for a non-capturable AdamW, beside the tensor when fused.
                "step": torch.tensor(0.0, dtype=torch.float32, device=param.device if fused else "cpu"),
                "exp_avg": torch.zeros_like(param),
                "exp_avg_sq": torch.zeros_like(param),
            }

    def tensors(self) -> list[torch.Tensor]:
        """Everything that defines this layer's training state, in wire order."""
        params = [local(param.detach()) for param in self.module.parameters()]
        state = [
            local(self.optimizer.state[param][key])
            for param in self.module.parameters()
            for key in ("exp_avg", "exp_avg_sq", "step")
        ]
        return params + state

    def replicated(self) -> list[bool]:
        """For each tensor of `tensors()`: whether every rank of a tensor-parallel stage holds it whole
        (unsharded parameters, their AdamW moments, every step count); all True for an unsharded layer."""
        whole = [not is_sharded(param) for param in self.module.parameters()]
        return whole + [value for flag in whole for value in (flag, flag, True)]

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The same tensors keyed by name (checkpoint keys)."""
        out = {f"param.{name}": local(param.detach()) for name, param in self.module.named_parameters()}
        for name, param in self.module.named_parameters():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                out[f"optim.{name}.{key}"] = local(self.optimizer.state[param][key])
        return out

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors())


def is_sharded(tensor: torch.Tensor) -> bool:
    return is_dtensor(tensor) and any(p.is_shard() for p in tensor.placements)


def layer_state_bytes(module: nn.Module) -> tuple[int, int]:
    """(parameter bytes, optimizer bytes) of a layer as the runtime stores and sends it."""
    params = list(module.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    step_bytes = torch.tensor(0.0).element_size()
    return param_bytes, 2 * param_bytes + step_bytes * len(params)


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """What actually crossed the wire for one planned transfer."""

    layer: int
    src: int
    dst: int
    bytes: int


def switch_copies(
    transfers: tuple[Transfer, ...],
    node: int,
    copied: set[int],
    layers: dict[int, LayerState],
    make_layer: Callable[[int], LayerState],
    wait: Wait,
    rank_of: Mapping[int, int],
    lane: int = 0,
    stage_group: dist.ProcessGroup | None = None,
    comm_device: torch.device | str = "cpu",
) -> list[TransferRecord]:
    """A switch's layer copies (`execute_transfers`), safe to try again when the switch fails on the way
    and the world re-forms with the same copies (`operator/_aborts`). Every worker of the world calls it
    with the same plan; it returns what this worker received.

    1. The copies an earlier try completed are skipped (`copies_left`): `copied` holds the layers this
       worker received since the model last changed (the caller empties it at every update).
    2. A layer received whole joins `copied`. With a tensor-parallel stage, only once its replicated part
       has come by the stage's broadcast, at the end: before that it is not whole on the other lanes.
    3. Once this worker's copies are done, one all-reduce: past it every receiver holds its layers, so a
       source may drop the ones it gave away. Before, a source whose own copies had completed dropped them
       while a receiver's failed, and no later try could get them."""
    comm = torch.device(comm_device)
    left = copies_left(transfers, node, copied, layers, wait, comm)
    before = set(layers)
    try:
        received = execute_transfers(left, node, rank_of, layers, make_layer, wait, lane, stage_group, comm)
    except BaseException:
        if stage_group is None:  # a whole layer enters `layers` once all its tensors arrived
            copied |= set(layers) - before
        raise
    copied |= {record.layer for record in received}
    if left:
        wait(dist.all_reduce(torch.zeros(1, dtype=torch.int32, device=comm), async_op=True), "copies landed")
    return received


def copies_left(
    transfers: tuple[Transfer, ...],
    node: int,
    copied: set[int],
    layers: Mapping[int, LayerState],
    wait: Wait,
    comm_device: torch.device | str = "cpu",
) -> tuple[Transfer, ...]:
    """The plan's `transfers` less those that an earlier try of the same switch completed: every worker of
    the receiving node holds the layer, received then (`copied`). One all-reduce, when there are
    transfers: each worker says which of its node's receipts it still lacks, and a transfer is skipped
    where no one lacks it."""
    if not transfers:
        return transfers
    lacking = [
        int(transfer.dst == node and not (transfer.layer in copied and transfer.layer in layers))
        for transfer in transfers
    ]
    flags = torch.tensor(lacking, dtype=torch.int32, device=comm_device)
    wait(dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True), "copies left")
    return tuple(transfer for transfer, left in zip(transfers, flags.tolist(), strict=True) if left)


def execute_transfers(
    transfers: Iterable[Transfer],
    node: int,
    rank_of: Mapping[int, int],
    layers: dict[int, LayerState],
    make_layer: Callable[[int], LayerState],
    wait: Wait,
    lane: int = 0,
    stage_group: dist.ProcessGroup | None = None,
    comm_device: torch.device | str = "cpu",
) -> list[TransferRecord]:
    """Send and receive this node's share of the transfer plan; return what this node received.

    Sends are non-blocking and receives blocking, in the plan's order on every node, so two nodes that send
    each other layers cannot deadlock. A received layer enters `layers` only once all its tensors arrived.
    `wait(work, what)` blocks on one operation (the trainer's, which gives up when a peer fails).

    Tensor-parallel stages (`stage_group`: this node's stage ranks, `lane`: this worker's local rank, whose
    `rank_of` addresses the peers' same local rank): every lane moves its shard of the sharded tensors, and
    lane 0 alone moves the replicated ones, which the receiving node then broadcasts to its other lanes, so
    the bytes crossing between nodes sum over the lanes to the plan's `Transfer.bytes`.

    A tensor that does not live on `comm_device` (AdamW's step counts stay on the CPU, as torch keeps them)
    travels through a copy there: NCCL and HCCL move device memory only.
    """
    comm = torch.device(comm_device)
    pending: list[dist.Work] = []
    keep: list[torch.Tensor] = []
    received: list[TransferRecord] = []
    for transfer in transfers:
        if transfer.src == node:
            if transfer.layer not in layers:
                raise RuntimeError(f"transfer: node {node} must send layer {transfer.layer} it does not hold")
            state = layers[transfer.layer]
            for offset, (tensor, whole) in enumerate(zip(state.tensors(), state.replicated(), strict=True)):
                if whole and lane != 0:
                    continue
                tag = _TAG_BASE + transfer.layer * 1024 + offset
                payload = tensor.contiguous() if tensor.device == comm else tensor.to(comm)
                keep.append(payload)  # alive until its send completes
                work = dist.isend(payload, dst=rank_of[transfer.dst], tag=tag)
                if work is not None:
                    pending.append(work)
        elif transfer.dst == node:
            fresh = make_layer(transfer.layer)
            size = 0
            with torch.no_grad():
                for offset, (tensor, whole) in enumerate(
                    zip(fresh.tensors(), fresh.replicated(), strict=True)
                ):
                    if whole and lane != 0:
                        continue  # arrives by the broadcast below
                    tag = _TAG_BASE + transfer.layer * 1024 + offset
                    buffer = tensor if tensor.device == comm else torch.empty_like(tensor, device=comm)
                    wait(dist.irecv(buffer, src=rank_of[transfer.src], tag=tag), f"layer {transfer.layer}")
                    if buffer is not tensor:
                        tensor.copy_(buffer)
                    size += tensor.nbytes
            layers[transfer.layer] = fresh
            received.append(TransferRecord(transfer.layer, transfer.src, transfer.dst, size))
    for work in pending:
        wait(work, "layer send")
    if stage_group is not None:
        # Every lane of this node received the same layers in the same order: one broadcast per tensor.
        for record in received:
            state = layers[record.layer]
            for tensor, whole in zip(state.tensors(), state.replicated(), strict=True):
                if whole:
                    buffer = tensor if tensor.device == comm else tensor.to(comm)
                    # From the stage's first lane; `src` is global: torch before 2.6 has no `group_src`.
                    first = dist.get_global_rank(stage_group, 0)
                    work = dist.broadcast(buffer, src=first, group=stage_group, async_op=True)
                    wait(work, f"replicated part of layer {record.layer}")
                    if buffer is not tensor:
                        with torch.no_grad():
                            tensor.copy_(buffer)
    return received
