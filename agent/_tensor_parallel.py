"""Tensor parallelism inside a stage: the Megatron split of the built-in blocks over a node's k devices.

A stage whose `StagePlan.gpus` lists k devices runs on k worker processes of its node (local ranks
0..k-1), and every block it holds is sharded over them with `torch.distributed.tensor.parallel`:
attention `qkv` and the MLP's up projections column-wise, attention `out` and the MLP's down projection
row-wise, so each block needs one all-reduce forward and one backward. Norms, the rowwise biases, the
embedding and the head stay replicated: their inputs are identical on the k ranks, so their gradients are
too, and each local rank's data-parallel sync (one group per local rank) keeps the replicas equal.

The fused `qkv` projection is column-sharded after its rows are interleaved per shard ([q_j; k_j; v_j] for
shard j), so each rank holds whole heads of q, k and v and `Attention.forward` splits its local output in
three as it does unsharded. `full_parameters` undoes the interleave when it gathers a layer back.

Sharding uses `src_data_rank=None`: every rank built the layer from the same seed, so each slices its own
shard locally and no communication is needed; the same holds for a layer rebuilt after a reconfiguration
(`Trainer` then overwrites the local shards with the ones it held or received).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import ProcessGroup

from resilientjob.planner.errors import PlannerError
from resilientjob.planner.plan import Plan

from ._dtensor import is_dtensor
from ._hf_models import _Block, _Embedding, _GPT2Embedding, _Head
from .models import Embedding, GPTBlock, Head, LlamaBlock, SleepLayer

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

# `torch.distributed.tensor.parallel` is imported where a stage shards (k > 1 devices) or a checkpoint's
# shards merge, not here: every worker loads this module, and that import is most of a second (`_dtensor`).

_QKV = ("attn.qkv.weight", "attn.qkv.bias")
"""Parameters whose rows are interleaved per shard before column sharding."""

_REPLICATED = (Embedding, Head, SleepLayer, _Embedding, _GPT2Embedding, _Head)
"""Layers kept whole on every rank of a stage (their compute is small next to the blocks')."""


def tp_degree(plan: Plan) -> int:
    """The number of devices every live stage of `plan` spans (the tensor-parallel degree k).

    Raises PlannerError naming the field when live stages disagree, or when a plan with k > 1 reroutes a
    stage (its micro-batches would have to run on a peer's k shards in another order: not supported)."""
    degree: int | None = None
    first = ""
    for p, pipeline in enumerate(plan.pipelines):
        for s, stage in enumerate(pipeline.stages):
            if stage.rerouted:
                continue
            k = max(1, len(stage.gpus))
            if degree is None:
                degree, first = k, f"pipelines[{p}].stages[{s}]"
            elif k != degree:
                raise PlannerError(
                    f"pipelines[{p}].stages[{s}].gpus",
                    f"stage on node {stage.node} spans {k} devices but {first} spans {degree}; the training "
                    "runtime needs one tensor-parallel degree for every stage",
                )
    degree = degree or 1
    if degree > 1:
        for p, pipeline in enumerate(plan.pipelines):
            for s, stage in enumerate(pipeline.stages):
                if stage.rerouted:
                    raise PlannerError(
                        f"pipelines[{p}].stages[{s}].rerouted",
                        f"stage of node {stage.node} is rerouted in a plan with {degree} devices per stage; "
                        "rerouting runs one device per stage (use the dynamic policy)",
                    )
    return degree


def stage_groups(stages: int, degree: int, timeout_s: float) -> list[ProcessGroup]:
    """The process group of each of `stages` stages' `degree` lanes (world ranks `slot * degree + j`),
    created by every rank, as `new_group` requires. Each times out after `timeout_s`, not torch's 30
    minutes: a stage's lanes can part at a wait between nodes (a dead peer's lane 1 sent before it died,
    its lane 0 did not), and the lane left waiting in a tensor-parallel collective must give up as its
    peer did, not hold the whole job (`runtime`'s module docstring)."""
    timeout = timedelta(seconds=timeout_s)
    return [
        dist.new_group(ranks=[slot * degree + lane for lane in range(degree)], timeout=timeout)
        for slot in range(stages)
    ]


def stage_mesh(group: ProcessGroup, device: str) -> DeviceMesh:
    """A one-dimensional mesh over the k ranks of this node's stage (a subgroup of the world)."""
    return DeviceMesh.from_group(group, device_type=device.split(":", maxsplit=1)[0])


def _block_plan(module: nn.Module) -> dict[str, ParallelStyle]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(module, GPTBlock):
        return {
            "attn.qkv": ColwiseParallel(),
            "attn.out": RowwiseParallel(),
            "mlp.0": ColwiseParallel(),
            "mlp.2": RowwiseParallel(),
        }
    if isinstance(module, LlamaBlock):
        return {
            "attn.qkv": ColwiseParallel(),
            "attn.out": RowwiseParallel(),
            "gate": ColwiseParallel(),
            "up": ColwiseParallel(),
            "down": RowwiseParallel(),
        }
    if isinstance(module, _Block) and _has_submodules(module, _HF_PROJECTIONS):
        return {
            f"block.{name}": ColwiseParallel() if column else RowwiseParallel()
            for name, column in _HF_PROJECTIONS.items()
        }
    raise ValueError(
        f"model: layer {_layer_name(module)} has no tensor-parallel plan (the built-in GPT and Llama blocks "
        "and the Llama, Qwen2 and Mistral blocks of transformers); run it with one device per stage "
        "(gpusPerNode: 1)"
    )


_HF_PROJECTIONS: dict[str, bool] = {
    "self_attn.q_proj": True,
    "self_attn.k_proj": True,
    "self_attn.v_proj": True,
    "self_attn.o_proj": False,
    "mlp.gate_proj": True,
    "mlp.up_proj": True,
    "mlp.down_proj": False,
}
"""The Megatron split of a transformers Llama-style decoder layer (Llama, Qwen2, Mistral): q, k and v
column-wise (each rank whole heads of each; their attention reshapes to `(-1, head_dim)`, so it runs on the
local heads as it is), o row-wise, SwiGLU's gate and up column-wise and down row-wise (True: column-wise).
GPT-2's block fuses q, k and v in one transposed `Conv1D`, which these styles cannot split."""


def _has_submodules(module: nn.Module, names: Iterable[str]) -> bool:
    try:
        return all(isinstance(module.get_submodule(f"block.{name}"), nn.Linear) for name in names)
    except AttributeError:
        return False


def _layer_name(module: nn.Module) -> str:
    inner = getattr(module, "block", None)
    return type(inner).__name__ if isinstance(module, _Block) and inner is not None else type(module).__name__


def _heads(module: nn.Module) -> tuple[int, ...]:
    """The attention head counts a shard must divide: the built-in blocks' heads; a transformers block's
    query and key/value heads."""
    if isinstance(module, GPTBlock | LlamaBlock):
        return (module.attn.heads,)
    config = getattr(getattr(getattr(module, "block", None), "self_attn", None), "config", None)
    return config_heads(config) if config is not None else ()


def config_heads(config: Any) -> tuple[int, int]:
    """(query heads, key/value heads) of a transformers configuration: what a stage's split must divide
    (node 0's pre-flight asks it of the configuration before any worker builds a block)."""
    heads = int(config.num_attention_heads)
    return heads, int(getattr(config, "num_key_value_heads", None) or heads)


def _check_divisible(module: nn.Module, plan: dict[str, ParallelStyle], degree: int) -> None:
    """Refuse uneven shards: a row-wise layer rebuilds its input's global shape assuming equal shards."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    for heads in _heads(module):
        if heads % degree:
            raise ValueError(f"heads: {heads} attention heads cannot be split over {degree} devices")
    for name, style in plan.items():
        linear = module.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"model: {name} of {_layer_name(module)} is not a Linear")
        width = linear.out_features if isinstance(style, ColwiseParallel) else linear.in_features
        if width % degree:
            raise ValueError(
                f"hidden: {name} of {_layer_name(module)} is {width} wide, not divisible by {degree} "
                "devices (choose hidden so that every projection splits evenly)"
            )


def _interleave(tensor: torch.Tensor, degree: int) -> torch.Tensor:
    """Rows [q; k; v] -> [q_0; k_0; v_0; q_1; ...] so that column shard j holds whole heads of each."""
    q, k, v = tensor.chunk(3, dim=0)
    rows = zip(q.chunk(degree), k.chunk(degree), v.chunk(degree), strict=True)
    parts = [torch.cat((qj, kj, vj)) for qj, kj, vj in rows]
    return torch.cat(parts)


def _deinterleave(tensor: torch.Tensor, degree: int) -> torch.Tensor:
    shards = [shard.chunk(3, dim=0) for shard in tensor.chunk(degree, dim=0)]
    return torch.cat([torch.cat([shard[i] for shard in shards]) for i in range(3)])


@functools.cache
def _local_slices() -> dict[str, Any]:
    """Each rank slices its own shard, with no communication: a keyword of newer torch (whose default sends
    rank 0's). Torch without it (the Ascend image's torch_npu pins 2.5.1) scatters the first rank's shards,
    one collective per layer over the stage's ranks, which every one of them calls in the same order here:
    the same values, since every rank built the layer from the same seed."""
    from torch.distributed.tensor.parallel import parallelize_module

    return (
        {"src_data_rank": None} if "src_data_rank" in inspect.signature(parallelize_module).parameters else {}
    )


def shard_layer(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard one layer over `mesh` in place (built-in blocks), or keep it replicated (embedding, head,
    sleep layers). Raises ValueError for a layer type it cannot shard."""
    if isinstance(module, _REPLICATED):
        return module
    from torch.distributed.tensor.parallel import parallelize_module

    degree = mesh.size()
    plan = _block_plan(module)
    _check_divisible(module, plan, degree)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name in _QKV:
                param.copy_(_interleave(param, degree))
    return parallelize_module(module, mesh, plan, **_local_slices())


def full_parameters(module: nn.Module, degree: int) -> list[torch.Tensor]:
    """Every parameter of a (possibly sharded) layer gathered whole, in the unsharded layout.

    A collective over the stage's ranks when the layer is sharded: all of them must call it."""
    out = []
    with torch.no_grad():
        for name, param in module.named_parameters():
            value = param.full_tensor() if is_dtensor(param) else param.detach()
            if degree > 1 and name in _QKV and isinstance(module, GPTBlock | LlamaBlock):
                value = _deinterleave(value, degree)
            out.append(value.clone())
    return out


def merge_shards(module: nn.Module, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A layer's whole parameters (by name, in the unsharded layout) from the local parameters each of its k
    ranks held (`shards[j]`: rank j's, as a checkpoint keeps them), with no process group: column-wise
    projections are joined along their rows (weight and bias), row-wise ones along their columns (their
    bias is replicated), replicated parameters taken from rank 0. `module`: the layer, for its plan (a
    `meta` layer will do; so will `meta` shards, which gives the shapes alone)."""
    degree = len(shards)
    if degree == 1 or isinstance(module, _REPLICATED):
        return dict(shards[0])
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = _block_plan(module)
    whole = {}
    for name, _ in module.named_parameters():
        owner, _, leaf = name.rpartition(".")
        parts = [shard[name] for shard in shards]
        style = plan.get(owner)
        if isinstance(style, ColwiseParallel):
            value = torch.cat(parts, dim=0)
        elif isinstance(style, RowwiseParallel) and leaf == "weight":
            value = torch.cat(parts, dim=1)
        else:
            value = parts[0]
        if name in _QKV and isinstance(module, GPTBlock | LlamaBlock):
            value = _deinterleave(value, degree)
        whole[name] = value
    return whole
