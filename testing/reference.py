"""The reference a test compares a resilient run with: the same job, failure-free, in one process.

Written as plainly as possible and independently of the runtime (no pipeline schedule, no process groups,
no sharding): same initial weights, data order, global batch, optimizer, learning-rate schedule, clipping and
tied embeddings. A run through failures that commits the same losses and parameters lost and repeated no
sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from resilientjob.agent.config import JobConfig
from resilientjob.agent.data import SampleOrder
from resilientjob.agent.models import lm_loss
from resilientjob.agent.optim import lr_at, set_lr
from resilientjob.agent.p2p import LayerState


def reference_run(
    config: JobConfig, global_batch: int, microbatch_size: int
) -> tuple[list[float], dict[int, list[torch.Tensor]], dict[int, list[torch.Tensor]]]:
    """The failure-free single-process run of the same job (same initial weights, data order, global
    batch, optimizer, schedule, clipping and tied embeddings), written as plainly as possible."""
    model = config.load_model()
    dataset = config.open_dataset(model)
    training = config.workload.training
    order = SampleOrder(dataset.num_samples, global_batch, seed=dataset.seed)
    layers = [LayerState(index, model.layer(index), training=training) for index in range(model.num_layers)]
    tied = [_named(layers[index].module, name) for index, name in model.tied] if model.tied else []
    losses = []
    first_grads: dict[int, list[torch.Tensor]] = {}
    for step in range(config.steps):
        for layer in layers:
            layer.zero_grad()
        total = 0.0
        for microbatch in range(global_batch // microbatch_size):
            inputs, targets = dataset.batch(order.microbatch_ids(step, microbatch, microbatch_size))
            x = inputs
            for layer in layers:
                x = layer.module(x)
            loss = lm_loss(x, targets) / global_batch
            torch.autograd.backward([loss])
            total += float(loss.detach())
        if tied:  # one tensor in the model: both copies get the sum of their gradients
            summed = sum((p.grad for p in tied if p.grad is not None), torch.zeros_like(tied[0]))
            for param in tied:
                param.grad = summed.clone()
        if step == 0:
            first_grads = _grads(layers)
        params = [p for layer in layers for p in layer.module.parameters() if p.grad is not None]
        if training.grad_clip_norm > 0:
            # The tied tensor is one parameter of the model: its norm counts once.
            counted = [p for p in params if all(p is not q for q in tied[1:])]
            norm = torch.sqrt(sum((p.grad.float().pow(2).sum() for p in counted), torch.zeros(())))  # type: ignore[union-attr]
            coefficient = min(1.0, training.grad_clip_norm / (float(norm) + 1e-6))
            for param in params:
                param.grad.mul_(coefficient)  # type: ignore[union-attr]
        for layer in layers:
            set_lr(layer.optimizer, lr_at(training, step))
            layer.optimizer.step()
        losses.append(total)
    params_out = {layer.index: [p.detach().clone() for p in layer.module.parameters()] for layer in layers}
    return losses, params_out, first_grads


def _named(module: torch.nn.Module, name: str) -> torch.nn.Parameter:
    for pname, param in module.named_parameters():
        if pname == name:
            return param
    raise ValueError(f"tied: no parameter {name!r}")


def _grads(layers: Sequence[LayerState]) -> dict[int, list[torch.Tensor]]:
    """The summed gradients of a step (left in place until the next step's `zero_grad`)."""
    return {
        layer.index: [
            p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in layer.module.parameters()
        ]
        for layer in layers
    }
