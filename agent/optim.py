"""The optimizer side of `spec.training`: AdamW per layer, the learning-rate schedule, global-norm clipping.

Every layer has its own AdamW (agent/p2p.py `LayerState`): AdamW is element-wise, so per-layer optimizers
update exactly as one optimizer over the whole model would, and a layer's optimizer state travels with it.
Weight decay applies to matrices and embeddings (tensors of two or more dimensions), not to norms and
biases, as nanoGPT, Megatron and the Hugging Face Trainer do.

The schedule is a pure function of the global step (`lr_at`), so a reconfiguration or a checkpoint restart
resumes it exactly without saving anything. Clipping scales every gradient by max_norm / total_norm when the
total is larger; the total is the norm over the whole model with each layer counted once however the layout
splits or replicates it (the runtime sums squared norms of designated copies in its commit all-reduce).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from resilientjob.protocol.workload import Schedule, TrainingSpec

from ._dtensor import is_dtensor

PLAIN_ADAMW = TrainingSpec(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, grad_clip_norm=0.0)
"""torch's AdamW defaults without decay or clipping: what a bare `LayerState` uses."""


def lr_at(training: TrainingSpec, step: int) -> float:
    """Learning rate of global step `step` (0-based): linear warm-up to `lr`, then constant or cosine to
    `minLr` at the last step."""
    if step < 0:
        raise ValueError(f"step: must be >= 0, got {step}")
    if step < training.warmup_steps:
        return training.lr * (step + 1) / training.warmup_steps
    if training.schedule is Schedule.CONSTANT:
        return training.lr
    span = max(1, training.steps - training.warmup_steps - 1)
    progress = min(1.0, (step - training.warmup_steps) / span)
    return training.min_lr + 0.5 * (training.lr - training.min_lr) * (1 + math.cos(math.pi * progress))


def fused_on(params: Iterable[torch.Tensor]) -> bool:
    """Whether AdamW runs fused (one kernel per layer) over `params`: on CUDA, for plain tensors.

    The single-tensor loop torch uses elsewhere launches about ten kernels per tensor, a visible share of a
    GPU step (bench/bench_gpu.py). The CPU keeps the loop: its updates are the ones the reference runs
    reproduce bit for bit, and a tensor-parallel shard (a DTensor) keeps it too."""
    params = list(params)
    return bool(params) and all(p.is_cuda and not is_dtensor(p) for p in params)


def make_adamw(module: nn.Module, training: TrainingSpec) -> torch.optim.AdamW:
    """AdamW over `module`'s parameters, decaying only tensors of two or more dimensions; fused on CUDA
    (`fused_on`), whose step counts then live on the device."""
    decay = [p for p in module.parameters() if p.dim() >= 2]
    flat = [p for p in module.parameters() if p.dim() < 2]
    fused = fused_on(module.parameters())
    groups = [
        {"params": params, "weight_decay": weight_decay}
        for params, weight_decay in ((decay, training.weight_decay), (flat, 0.0))
        if params
    ]
    return torch.optim.AdamW(
        groups or [{"params": []}],
        lr=training.lr,
        betas=(training.betas[0], training.betas[1]),
        eps=training.eps,
        weight_decay=training.weight_decay,
        foreach=False,
        fused=fused or None,
    )


def warm_up(device: torch.device | str, training: TrainingSpec) -> None:
    """Build one throwaway AdamW on `device`, so that the next one costs what it should. torch's first
    optimizer imports torch._dynamo (2-3 s of a core, more on a loaded host; `Optimizer.__init__` is wrapped
    to stay out of compilation), and on an accelerator the first tensor makes the device's context. A node
    joining a running job built its first layers in the middle of the switch that takes it in, with its
    senders waiting on each receive against their collective timeout: on a loaded two-core host the switch
    ran past it and was abandoned."""
    make_adamw(nn.Linear(1, 1, device=device), training)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_coefficient(total_sq_norm: float, max_norm: float) -> float:
    """The factor every gradient is multiplied by: 1 when clipping is off or the norm is within bounds."""
    if max_norm <= 0 or not math.isfinite(total_sq_norm):
        return 1.0
    norm = math.sqrt(max(total_sq_norm, 0.0))
    return min(1.0, max_norm / (norm + 1e-6))


def sq_norm(tensors: Iterable[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """Sum of squared elements in fp32, as a 0-d tensor on `device` (no host synchronisation per tensor)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for tensor in tensors:
        total += tensor.detach().float().pow(2).sum().to(device)
    return total
