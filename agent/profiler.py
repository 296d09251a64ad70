"""Measure a `ModelProfile` (per-layer forward/backward time and memory) of a model on this device.

The planner's estimates and the restorer's transfer sizes come from this profile, so bytes are exact: a
layer's `param_bytes + optimizer_bytes` is what `p2p.LayerState` sends. Times are medians over `repeats`
runs after a warm-up, per micro-batch of `microbatch_size`, measured layer by layer on real activations.
"""

from __future__ import annotations

import statistics
import time

import torch

from resilientjob.planner.profile import LayerProfile, ModelProfile

from .models import ModelConfig, ModelKind, ModelSpec, lm_loss
from .p2p import layer_state_bytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_profile(
    model: ModelSpec,
    microbatch_size: int = 1,
    repeats: int = 3,
    device: str = "cpu",
    timed: bool = True,
) -> ModelProfile:
    """Profile every layer; with `timed=False` only bytes are exact and times are 1 ms / 2 ms per layer."""
    if microbatch_size < 1:
        raise ValueError(f"microbatch_size: must be >= 1, got {microbatch_size}")
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    target = torch.device(device)
    tokens = torch.randint(model.vocab, (microbatch_size, model.seq_len), device=target)
    x: torch.Tensor = tokens
    layers: list[LayerProfile] = []
    for index in range(model.num_layers):
        module = model.layer(index).to(target)
        param_bytes, optimizer_bytes = layer_state_bytes(module)
        forward_s, backward_s = (0.001, 0.002)
        inputs = x.detach()
        if inputs.is_floating_point():
            inputs.requires_grad_()
        if timed:
            forwards, backwards = [], []
            for _ in range(repeats + 1):  # the first run warms up allocators and kernels
                _sync(target)
                start = time.perf_counter()
                out = module(inputs)
                _sync(target)
                middle = time.perf_counter()
                loss = lm_loss(out, tokens) if index == model.num_layers - 1 else out.float().square().mean()
                loss.backward()
                _sync(target)
                forwards.append(middle - start)
                backwards.append(time.perf_counter() - middle)
            forward_s, backward_s = statistics.median(forwards[1:]), statistics.median(backwards[1:])
        with torch.no_grad():
            out = module(inputs)
        activation_bytes = out.numel() * out.element_size()
        layers.append(
            LayerProfile(
                name=f"{type(module).__name__.lower()}{index}",
                forward_s=forward_s,
                backward_s=backward_s,
                param_bytes=param_bytes,
                optimizer_bytes=optimizer_bytes,
                activation_bytes=activation_bytes,
                output_bytes=activation_bytes if index < model.num_layers - 1 else 0,
            )
        )
        x = out
    return ModelProfile(name=model.name, layers=tuple(layers))


def calibrated_profile(model: ModelSpec) -> ModelProfile:
    """The exact profile of a calibrated-sleep model: bytes as measured, times as the sleeps are set.

    Sleep layers take `forward_sleep_s` forward and twice that backward per micro-batch whatever the CPU
    load, so this is what the planner should predict from (the runtime's own overheads are what the
    estimator-accuracy benchmark then measures)."""
    config = model.meta.get("config")
    if not isinstance(config, ModelConfig) or config.kind != ModelKind.SLEEP:
        raise ValueError(f"model: {model.name} is not a calibrated-sleep model (load_model('sleep', ...))")
    measured = measure_profile(model, timed=False)
    layers = tuple(
        layer.model_copy(
            update={"forward_s": config.forward_sleep_s, "backward_s": 2 * config.forward_sleep_s}
        )
        for layer in measured.layers
    )
    return ModelProfile(name=measured.name, layers=layers)
