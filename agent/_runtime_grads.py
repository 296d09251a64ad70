"""The gradient side of a step: sums over replicas, the tied embedding's two copies, the global norm.

After the backward passes every holder of a layer has the gradient of its own micro-batches. Three things
make them the gradient of the whole global batch, identical on every holder:
- `sum_replicas`: each layer range is all-reduced over its holders, one colour round at a time (the
  restorer's rounds: groups of one round share no rank, so they run at once). Each range's gradients live
  in one flat buffer whose slices are the parameters' `.grad` (DDP's `gradient_as_bucket_view`): backward
  accumulates into it, the all-reduce runs on it in place, and `zero` clears it in place, so no step
  flattens or copies gradients (measured: 3% of a DP2 step on CPU, bench/bench_overhead.py).
- `sum_tied`: a tied model (GPT-2, Llama with `tie_word_embeddings`) has one tensor for the token embedding
  and the LM head; the runtime holds two copies, possibly on different nodes. Each copy's gradient (already
  summed over its replicas) is counted once, from its designated holder, in an all-reduce over every node
  holding either copy, and both copies take the sum: equal gradients, equal AdamW updates, copies that stay
  equal.
- `norm_share`: this rank's part of the global squared gradient norm, each layer counted once (designated
  holder), the tied tensor once, a tensor-parallel shard by every lane and a replicated tensor by lane 0.
  The shares are summed in the commit all-reduce, so clipping costs no collective of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from resilientjob.planner.plan import Plan

from ._dtensor import local
from ._runtime_schedule import SyncGroup, designated_holders, held_layers, sync_groups
from ._runtime_wait import Wait
from .optim import sq_norm
from .p2p import LayerState, is_sharded

Track = Callable[[dist.Work | None], dist.Work | None]
Tied = tuple[tuple[int, str], tuple[int, str]]


@dataclass(slots=True)
class GradientSync:
    """One rank's gradient groups under one plan generation."""

    node: int
    groups: list[tuple[SyncGroup, dist.ProcessGroup | None]] = field(default_factory=list)
    norm_layers: set[int] = field(default_factory=set)
    """Layers whose squared gradient norm this node contributes (it is their designated holder)."""
    tied: Tied | None = None
    tied_member: bool = False
    """This node holds a tied copy and takes part in `sum_tied`."""
    tied_group: dist.ProcessGroup | None = None
    designated: dict[int, int] = field(default_factory=dict)
    buckets: dict[int, tuple[torch.Tensor, list[tuple[nn.Parameter, torch.Tensor]]]] = field(
        default_factory=dict
    )
    """Group index -> (flat gradient buffer, [(parameter, its view of the buffer)])."""

    @classmethod
    def join(
        cls, plan: Plan, node: int, lane: int, degree: int, position: Mapping[int, int], tied: Tied | None
    ) -> GradientSync:
        """Create this generation's groups. A collective: every rank of the world calls it, in the same
        order, since every rank takes part in creating every group (every lane's too)."""
        sync = cls(node=node, tied=tied, designated=designated_holders(plan))
        for group in sync_groups(plan):
            for each in range(degree):
                ranks = [position[holder] * degree + each for holder in group.holders]
                # Ascending, as `world_nodes` numbers the ranks in pipeline order: the ring is the plan's.
                handle = dist.new_group(ranks=ranks) if len(ranks) > 1 else None
                if node in group.holders and each == lane:
                    sync.groups.append((group, handle))
        sync.norm_layers = {layer for layer, holder in sync.designated.items() if holder == node}
        if tied is not None:
            copies = {tied[0][0], tied[1][0]}
            members = sorted(n for n, layers in held_layers(plan).items() if layers & copies)
            for each in range(degree):
                ranks = [position[member] * degree + each for member in members]
                handle = dist.new_group(ranks=ranks) if len(ranks) > 1 else None
                if each == lane:
                    sync.tied_group = handle
            sync.tied_member = node in members
        return sync

    def attach(self, layers: Mapping[int, LayerState]) -> None:
        """Give each reduced layer range one flat gradient buffer, its parameters' `.grad` views into it.
        Only for whole (not tensor-parallel) layers of one dtype: a DTensor's gradient is no plain view."""
        for number, (group, handle) in enumerate(self.groups):
            params = [p for index in range(*group.layers) for p in layers[index].module.parameters()]
            if (
                handle is None
                or not params
                or any(is_sharded(p) or p.dtype != params[0].dtype for p in params)
            ):
                continue
            flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            views = []
            offset = 0
            for param in params:
                view = flat[offset : offset + param.numel()].view_as(param)
                param.grad = view
                views.append((param, view))
                offset += param.numel()
            self.buckets[number] = (flat, views)

    def zero(self, layers: Mapping[int, LayerState]) -> None:
        """Clear every gradient before a step: buffers in place, other gradients dropped."""
        bucketed = set()
        for flat, views in self.buckets.values():
            flat.zero_()
            for param, view in views:
                param.grad = view  # reattach, should anything have replaced it
                bucketed.add(id(param))
        for layer in layers.values():
            for param in layer.module.parameters():
                if id(param) not in bucketed:
                    param.grad = None

    def handles(self) -> list[dist.ProcessGroup]:
        """Every group this rank holds (kept or retired with the world)."""
        handles = [handle for _, handle in self.groups if handle is not None]
        return [*handles, self.tied_group] if self.tied_group is not None else handles

    def sum_replicas(self, layers: Mapping[int, LayerState], track: Track, wait: Wait) -> None:
        """Sum gradients of each layer range over its holders, one colour round at a time."""
        for number in sorted({group.round for group, _ in self.groups}):
            in_flight: list[tuple[SyncGroup, dist.Work | None, torch.Tensor | None, list[torch.Tensor]]] = []
            for index, (group, handle) in enumerate(self.groups):
                if group.round != number or handle is None:
                    continue
                if index in self.buckets:
                    flat, views = self.buckets[index]
                    for param, view in views:
                        if param.grad is not view:  # autograd made a new tensor (no gradient this step)
                            view.copy_(param.grad if param.grad is not None else torch.zeros_like(view))
                            param.grad = view
                    in_flight.append(
                        (group, track(dist.all_reduce(flat, group=handle, async_op=True)), None, [])
                    )
                    continue
                params = [p for index in range(*group.layers) for p in layers[index].module.parameters()]
                for param in params:
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
                # This rank's shard of each gradient (the whole gradient when the layer is not sharded).
                grads = [local(p.grad) for p in params if p.grad is not None]
                packed = torch.cat([g.reshape(-1) for g in grads])
                work = track(dist.all_reduce(packed, group=handle, async_op=True))
                in_flight.append((group, work, packed, grads))
            for group, work, unpacked, grads in in_flight:
                wait(work, f"gradient all-reduce of layers {list(group.layers)}")
                if unpacked is None:
                    continue  # reduced in place
                offset = 0
                with torch.no_grad():
                    for grad in grads:
                        count = grad.numel()
                        grad.copy_(unpacked[offset : offset + count].view_as(grad))
                        offset += count

    def sum_tied(
        self, layers: Mapping[int, LayerState], track: Track, wait: Wait, comm_device: torch.device
    ) -> None:
        """Give both tied copies the sum of their gradients (see the module doc)."""
        if self.tied is None or not self.tied_member:
            return
        params = [
            (layer, layers[layer].module.get_parameter(name)) for layer, name in self.tied if layer in layers
        ]
        for _, param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        total = torch.zeros_like(local(params[0][1].grad))  # type: ignore[arg-type]
        for layer, param in params:
            if self.designated.get(layer) == self.node:  # counted once, from one holder
                total += local(param.grad)  # type: ignore[arg-type]
        if self.tied_group is not None:
            carrier = total if total.device == comm_device else total.to(comm_device)
            wait(track(dist.all_reduce(carrier, group=self.tied_group, async_op=True)), "tied embedding sum")
            total = carrier.to(total.device)
        with torch.no_grad():
            for _, param in params:
                local(param.grad).copy_(total)  # type: ignore[arg-type]

    def norm_share(self, layers: Mapping[int, LayerState], lane: int, device: torch.device | str) -> float:
        """This rank's part of the global squared gradient norm (see the module doc)."""
        skip = {self.tied[1]} if self.tied is not None else set()
        grads: list[torch.Tensor] = []
        for index in sorted(self.norm_layers):
            for name, param in layers[index].module.named_parameters():
                if param.grad is None or (index, name) in skip:
                    continue
                if is_sharded(param) or lane == 0:
                    grads.append(local(param.grad))
        return float(sq_norm(grads, device)) if grads else 0.0
