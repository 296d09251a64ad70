"""Whether a tensor is a tensor-parallel shard (a `DTensor`), without importing `torch.distributed.tensor`.

That import costs about 0.7 s of CPU (1.1 s with `torch.distributed.checkpoint`, which pulls it in) in every
process that loads it: each pod's agent and each of its workers, at every start, replacement pods included.
Only a stage of k > 1 devices (`_tensor_parallel.shard_layer`) or a checkpoint needs the module, and they
import it; until one has, no tensor can be a DTensor, so the check needs no import of its own."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_MODULE = "torch.distributed.tensor"


def is_dtensor(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    module = sys.modules.get(_MODULE)
    return module is not None and isinstance(tensor, module.DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly tensor-parallel) tensor, sharing its storage; other tensors as they
    are. A sharded layer therefore travels, and is checkpointed, shard by shard."""
    if is_dtensor(tensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor
