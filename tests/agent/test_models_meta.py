"""Every layer of every model family runs forward and backward off the CPU: on the `meta` device, and on a
fake accelerator whose tensors carry a device but no data (FakeTensorMode).

A tensor a layer makes on the wrong device (`torch.arange(n)` without `device=`) fails here: on `meta`
because meta and CPU tensors do not mix, on the fake accelerator because FakeTensorMode checks devices as a
real accelerator would. A fake `cuda` device does not work on CPU-only torch: `torch.arange(n,
device="cuda")`, slicing and autograd ask the CUDA device guard, which is not linked (autograd even aborts
the process). The fake accelerator is therefore the PrivateUse1 device registered with a Python device
guard (`torch.utils.backend_registration._setup_privateuseone_for_python_backend("fakegpu")`), in a
subprocess, because that registration is process-wide and permanent (and torch_npu uses the same slot).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from resilientjob.agent.models import ModelSpec, load_model

SEQ = 12
HF_SMALL = (
    "num_hidden_layers=2&hidden_size=32&intermediate_size=64&num_attention_heads=4&num_key_value_heads=2"
)
SPECS = {
    "gpt": ("gpt", {"layers": 4, "hidden": 16, "heads": 2, "vocab": 24, "seq_len": SEQ}),
    "llama": ("llama", {"layers": 4, "hidden": 16, "heads": 2, "vocab": 24, "seq_len": SEQ}),
    "hf-gpt2": ("hf:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=24&n_positions=16", {"seq_len": SEQ}),
    "hf-llama": (f"hf:llama?{HF_SMALL}&vocab_size=24&max_position_embeddings=16", {"seq_len": SEQ}),
    "hf-qwen2": (
        f"hf:qwen2?{HF_SMALL}&vocab_size=24&max_position_embeddings=16&tie_word_embeddings=true",
        {"seq_len": SEQ},
    ),
    # A window shorter than the sequence: the block builds its sliding-window mask.
    "hf-mistral": (
        f"hf:mistral?{HF_SMALL}&vocab_size=24&max_position_embeddings=16&sliding_window=5",
        {"seq_len": SEQ},
    ),
}


def _spec(key: str) -> ModelSpec:
    if key.startswith("hf-"):
        pytest.importorskip("transformers")
    name, options = SPECS[key]
    return load_model(name, **options)


def _input(spec: ModelSpec, index: int, device: torch.device | str, grad: bool) -> torch.Tensor:
    if index == 0:
        return torch.zeros((2, spec.seq_len), dtype=torch.long, device=device)
    return torch.zeros(spec.hidden_shape(2), device=device, requires_grad=grad)


def _forward_backward(layer: nn.Module, x: torch.Tensor, device: torch.device) -> None:
    out = layer(x)
    assert out.device == device
    out.float().square().mean().backward()
    grads = [p.grad for p in layer.parameters()]
    assert grads and all(g is not None and g.device == device for g in grads)
    if x.is_floating_point():
        assert x.grad is not None and x.grad.device == device


@pytest.mark.parametrize("key", sorted(SPECS))
def test_every_layer_runs_forward_and_backward_on_meta(key: str) -> None:
    spec = _spec(key)
    meta = torch.device("meta")
    for index in range(spec.num_layers):
        with meta:  # built on meta: the constructors and the initialisation follow the default device
            built = spec.layer(index)
        assert all(p.is_meta for p in built.parameters()), index
        _forward_backward(built, _input(spec, index, meta, grad=True), meta)
        moved = spec.layer(index).to(meta)  # built on the CPU, then moved, as the runtime does
        _forward_backward(moved, _input(spec, index, meta, grad=True), meta)


def _on_fake(module: nn.Module, mode: FakeTensorMode, device: torch.device, grad: bool) -> nn.Module:
    """`module` with every parameter and buffer replaced by a fake tensor of the same shape on `device`.

    `.to(device)` cannot make fake tensors of a device this torch was not built for, and `to_empty` refuses to
    swap in a tensor subclass; replacing the entries one by one works for both."""
    module = module.to("meta")
    with mode:
        for sub in module.modules():
            for name, param in list(sub._parameters.items()):
                if param is not None:
                    fake = torch.empty(param.shape, dtype=param.dtype, device=device)
                    sub._parameters[name] = nn.Parameter(fake, requires_grad=grad)
            for name, buffer in list(sub._buffers.items()):
                if buffer is not None:
                    sub._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
    return module


class _CpuPositions(nn.Module):
    """A layer with the bug the fake device must catch: a CPU tensor made in forward (as `_rotary` had)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + torch.arange(x.shape[1], dtype=x.dtype)[:, None]


def _fake_gpu_main() -> None:
    """Subprocess: forward and backward of every layer of every family on a fake PrivateUse1 device."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend("fakegpu")  # a Python device guard: autograd can run
    device = torch.device("fakegpu", 0)
    for key in sorted(SPECS):
        spec = _spec(key)
        for index in range(spec.num_layers):
            mode = FakeTensorMode()
            module = _on_fake(spec.layer(index), mode, device, grad=True)
            with mode:
                _forward_backward(module, _input(spec, index, device, grad=True), device)
        print(key, "ok")
    # The check can fail: the buggy layer is caught.
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    mode = FakeTensorMode()
    module = _on_fake(_CpuPositions(), mode, device, grad=True)
    try:
        with mode:
            module(torch.zeros((2, 4, 16), device=device))
    except FakeTensorDeviceMismatchError:
        print("cpu-tensor caught")


@pytest.mark.slow
def test_every_layer_runs_forward_and_backward_on_a_fake_accelerator() -> None:
    pytest.importorskip("transformers")
    result = subprocess.run(
        [sys.executable, __file__, "--fake-gpu"], capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    want = [f"{key} ok" for key in sorted(SPECS)] + ["cpu-tensor caught"]
    assert result.stdout.splitlines() == want


def _main(argv: list[str]) -> None:
    actions: dict[str, Callable[[], None]] = {"--fake-gpu": _fake_gpu_main}
    actions[argv[0]]()


if __name__ == "__main__":
    _main(sys.argv[1:])


def test_the_runtime_trains_exactly_the_profiles_the_protocol_names() -> None:
    from resilientjob.agent._hf_models import PROFILE_MODELS
    from resilientjob.protocol.models import TRAINABLE_PROFILES

    assert set(PROFILE_MODELS) == TRAINABLE_PROFILES
