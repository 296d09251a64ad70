"""Measure a `ModelProfile` (per-layer forward/backward time and memory) of a model on this device.

The planner's estimates and the restorer's transfer sizes come from this profile, so bytes are exact: a
layer's `param_bytes + optimizer_bytes` is what `p2p.LayerState` sends. Times are medians over `repeats`
runs after a warm-up, per micro-batch of `microbatch_size`, measured layer by layer on real activations.
`measure_message_latency` measures the per-message cost between two workers (`ClusterSpec.message_latency_s`).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from resilientjob.planner.profile import LayerProfile, ModelProfile

from ._device_sync import synchronize
from .models import ModelConfig, ModelKind, ModelSpec, lm_loss
from .p2p import layer_state_bytes


def computed_profile(
    model: str,
    seq_len: int,
    microbatch_size: int,
    device: str,
    built: ModelSpec | None = None,
    flops: float | None = None,
) -> ModelProfile:
    """A Hugging Face model's profile computed from its config, no layer built (`planner.hf_profile`), as
    node 0 computes it for a job without a profile and `rjob plan -f` for a manifest: `hf:<dir>` from its
    config.json alone (the weights need not be there), `hf:<family>?k=v` from the configuration transformers
    completes, as the runtime's model is (`built`, when the caller has it already). Priced at `flops`, or
    at `device_flops(device)`. ValueError naming the model otherwise."""
    from resilientjob.planner.hf_profile import profile_from_hf_config
    from resilientjob.protocol.models import HF_PREFIX, ModelSource, model_source

    if model_source(model) is ModelSource.HF_DIRECTORY:
        path = Path(model.removeprefix(HF_PREFIX)) / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"model: cannot read {path}: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"model: {path} does not hold a JSON object")
    else:
        from .models import load_model

        spec = built if built is not None else load_model(model, seq_len=seq_len)
        if spec.hf is None:
            raise ValueError(f"model: {model} has no Hugging Face config to compute a profile from")
        config = spec.hf.config.to_dict()
    speed = flops if flops is not None else device_flops(device)
    return profile_from_hf_config(config, seq_len, microbatch_size, device_flops=speed, name=model)


def device_flops(device: str) -> float:
    """The FLOP/s a computed profile prices the layers at: an accelerator's nominal sustained speed
    (`hf_profile.NOMINAL_FLOPS`); a CPU's own fp32 matrix-product rate, timed here (about 0.1 s), as no
    nominal speed fits every CPU: 150 TFLOP/s priced a CPU job's step about a thousand times too cheap, and
    the planner weighed its layouts' compute as next to nothing against their transfers."""
    from resilientjob.planner.hf_profile import NOMINAL_FLOPS

    if device != "cpu":
        return NOMINAL_FLOPS
    from .validation import gemm_benchmark

    return gemm_benchmark(size=512, repeats=3, stretched=False).flops_per_s


def measure_profile(
    model: ModelSpec,
    microbatch_size: int = 1,
    repeats: int = 3,
    device: str = "cpu",
    timed: bool = True,
    bf16: bool = False,
) -> ModelProfile:
    """Profile every layer; with `timed=False` only bytes are exact and times are 1 ms / 2 ms per layer.
    `bf16`: the layers run under bf16 autocast, as the runtime trains them with `precision: bf16`."""
    if microbatch_size < 1:
        raise ValueError(f"microbatch_size: must be >= 1, got {microbatch_size}")
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    target = torch.device(device)
    autocast = torch.autocast(target.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
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
                synchronize(target)
                start = time.perf_counter()
                with autocast:
                    out = module(inputs)
                synchronize(target)
                middle = time.perf_counter()
                loss = lm_loss(out, tokens) if index == model.num_layers - 1 else out.float().square().mean()
                loss.backward()
                synchronize(target)
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


def _ping_pong(rank: int, port: int, rounds: int, results: Any) -> None:
    """One side of `measure_message_latency`: small tensors back and forth through the runtime's waits."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import TCPStore

    from ._runtime_wait import FailureNotice, Waiter

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    waiter, notice = Waiter(30.0), FailureNotice(None)
    buffer = torch.zeros(64)
    trips = []
    try:
        for index in range(rounds):
            began = time.perf_counter()
            if rank == 0:
                sent = dist.isend(buffer, 1, tag=2 * index)
                waiter.wait(dist.irecv(buffer, 1, tag=2 * index + 1), notice, "pong")
            else:
                waiter.wait(dist.irecv(buffer, 0, tag=2 * index), notice, "ping")
                sent = dist.isend(buffer, 0, tag=2 * index + 1)
            waiter.wait(sent, notice, "send")
            trips.append(time.perf_counter() - began)
            time.sleep(0.002)  # a pipeline stage computes between messages: do not measure a busy loop
        if rank == 0:
            results.put(trips)
    finally:
        dist.destroy_process_group()
        waiter.close()


def measure_message_latency(rounds: int = 60) -> float:
    """Seconds one small message between two worker processes of this machine costs (the median one-way
    time of a ping-pong through gloo and the runtime's `Waiter`, first tenth dropped as warm-up). This is
    `ClusterSpec.message_latency_s` for jobs whose workers share the machine, as the local stack's do; it
    includes the scheduling delays of the current load, so measure it under the load the job will see."""
    import multiprocessing

    from torch._C._distributed_c10d import TCPStore

    if rounds < 10:
        raise ValueError(f"rounds: must be >= 10, got {rounds}")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    context = multiprocessing.get_context("fork")  # torch is imported already: fork starts in milliseconds
    results = context.Queue()
    sides = [context.Process(target=_ping_pong, args=(rank, store.port, rounds, results)) for rank in (0, 1)]
    for side in sides:
        side.start()
    try:
        trips: list[float] = results.get(timeout=60)
    finally:
        for side in sides:
            side.join(timeout=10)
            if side.is_alive():
                side.kill()
                side.join()
    return statistics.median(trips[rounds // 10 :]) / 2


def check_device(text: str) -> None:
    """`text` names a device this torch has; ValueError naming `device` otherwise."""
    if text.partition(":")[0] == "npu":
        try:
            import torch_npu  # noqa: F401  - registers the npu device type and torch.npu (extra `ascend`)
        except ImportError:
            raise ValueError("device: npu needs torch_npu (pip install 'resilientjob[ascend]')") from None
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"device: expected cpu, cuda[:N] or npu[:N], got {text!r}") from None
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.npu (once torch_npu is imported), ...
    if backend is None or not getattr(backend, "is_available", lambda: False)():
        raise ValueError(f"device: {text}: this torch sees no {device.type} device")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if device.index is not None and device.index >= count:
        raise ValueError(f"device: {text}: this machine has {count} {device.type} device(s)")
