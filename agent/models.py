"""Models as ordered layer lists (embedding ... blocks ... head), the unit every plan splits and moves.

The runtime never sees a monolithic `nn.Module`: a stage holds layers [start, end) and a transfer moves one
layer, so models are described by a `ModelSpec` that can build any single layer on demand. Layer `i` is
initialised from its own seed, so every worker that builds layer `i` gets bit-identical weights without
communicating, and a worker that receives layer `i` later can allocate it and overwrite it in place.

Built in: a small GPT (pre-norm attention + GELU MLP), a Llama-style stack (RMSNorm, rotary attention,
SwiGLU, no biases) and calibrated-sleep layers whose compute is a sleep of a fixed duration, so that two CPU
cores can emulate many workers without contention distorting step times. User models come from
`module:function` returning the ordered layers. Hugging Face causal LMs (GPT-2, Llama, Qwen2, Mistral) come
from a `save_pretrained` directory `hf:./dir`, from a configuration `hf:gpt2?n_layer=2&n_embd=32...`, or from
a built-in planner profile name such as `llama2-7b` (see `_hf_models`).

Besides `layer(i)` (initial weights), a spec can `allocate(i)`: a layer of the right shapes whose contents
will be overwritten, as a layer received peer-to-peer is; for a checkpoint directory that skips the disk
read, for a configuration the random initialisation. `tied` names a parameter pair that Hugging Face shares
(the LM head's projection and the token embedding) and that the runtime holds as two equal copies.
"""

from __future__ import annotations

import copy
import importlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ._hf_models import HFModel


class ModelKind(StrEnum):
    GPT = "gpt"
    LLAMA = "llama"
    SLEEP = "sleep"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a built-in model. `layers` counts every layer: embedding + blocks + head."""

    kind: ModelKind = ModelKind.GPT
    layers: int = 8
    vocab: int = 32
    hidden: int = 32
    heads: int = 2
    seq_len: int = 16
    seed: int = 0
    forward_sleep_s: float = 0.0
    """Sleep layers only: seconds per forward per micro-batch (backward sleeps twice as long)."""
    sleep_samples: int = 0
    """Sleep layers only: the samples `forward_sleep_s` is for, so that a micro-batch of m samples sleeps
    m / sleep_samples times it, as a device's compute grows with the batch (0: per micro-batch, any size)."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ModelKind):
            raise ValueError(f"kind: must be one of {[k.value for k in ModelKind]}, got {self.kind!r}")
        if self.layers < 3 and self.kind != ModelKind.SLEEP:
            raise ValueError(f"layers: need embedding + at least one block + head (3), got {self.layers}")
        if self.layers < 1:
            raise ValueError(f"layers: must be >= 1, got {self.layers}")
        for name in ("vocab", "hidden", "heads", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"heads: must divide hidden={self.hidden}, got {self.heads}")
        if self.forward_sleep_s < 0:
            raise ValueError(f"forward_sleep_s: must be >= 0, got {self.forward_sleep_s}")
        if self.sleep_samples < 0:
            raise ValueError(f"sleep_samples: must be >= 0, got {self.sleep_samples}")


# ---- layers ----------------------------------------------------------------------------------------------
class Embedding(nn.Module):
    """Token + learned position embedding; input token ids (m, T) -> hidden (m, T, d)."""

    def __init__(self, vocab: int, hidden: int, seq_len: int, positions: bool = True) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Parameter(torch.randn(seq_len, hidden) * 0.02) if positions else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.tokens(tokens)
        if self.positions is not None:
            hidden = hidden + self.positions[: tokens.shape[1]]
        return hidden


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on (m, heads, T, head_dim); pairs the two halves of the head dimension."""
    _, _, length, dim = x.shape
    half = dim // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=x.dtype, device=x.device) / half))
    angles = torch.arange(length, dtype=x.dtype, device=x.device)[:, None] * freqs[None, :]
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., :half], x[..., half : 2 * half]
    rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    return torch.cat((rotated, x[..., 2 * half :]), dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, bias: bool, rotary: bool) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.out = nn.Linear(hidden, hidden, bias=bias)
        self.rotary = rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        # Thirds of the projection, not `hidden`-wide splits: under tensor parallelism (`_tensor_parallel`)
        # this rank's qkv output holds only its heads of q, k and v, interleaved per shard.
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        shape = (batch, length, -1, hidden // self.heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        if self.rotary:
            q, k = _rotary(q), _rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.out(y.transpose(1, 2).reshape(batch, length, -1))
        return out


class GPTBlock(nn.Module):
    """Pre-norm transformer block (GPT-2 style)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, bias=True, rotary=False)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class LlamaBlock(nn.Module):
    """RMSNorm, rotary attention without biases, SwiGLU MLP (Llama 2 style)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        inner = 4 * hidden * 2 // 3
        self.norm1 = RMSNorm(hidden)
        self.attn = Attention(hidden, heads, bias=False, rotary=True)
        self.norm2 = RMSNorm(hidden)
        self.gate = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        out: torch.Tensor = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return out


class Head(nn.Module):
    """Final norm + projection to vocabulary logits."""

    def __init__(self, hidden: int, vocab: int, rms: bool = False) -> None:
        super().__init__()
        self.norm: nn.Module = RMSNorm(hidden) if rms else nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(self.norm(x))
        return out


class _SleepFn(torch.autograd.Function):
    """Identity whose forward and backward take a calibrated wall-clock time without using the CPU."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, fwd: float, bwd: float
    ) -> torch.Tensor:
        ctx.backward_s = bwd  # type: ignore[attr-defined]
        time.sleep(fwd)
        return x.clone()

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)  # type: ignore[attr-defined]
        return grad, None, None


class SleepLayer(nn.Module):
    """A tiny affine layer whose compute is a calibrated sleep (so many emulated workers fit on 2 cores):
    per micro-batch, or per `samples` samples of it when `samples` > 0."""

    def __init__(self, hidden: int, forward_s: float, backward_s: float, samples: int = 0) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(hidden))
        self.forward_s = forward_s
        self.backward_s = backward_s
        self.samples = samples

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.shape[0] / self.samples if self.samples else 1.0
        if x.dtype == torch.long:  # first layer: token ids -> a float hidden state
            x = F.one_hot(x, self.scale.numel()).float()
        out: torch.Tensor = _SleepFn.apply(  # type: ignore[no-untyped-call]
            x * self.scale, self.forward_s * scale, self.backward_s * scale
        )
        return out


# ---- model specs -----------------------------------------------------------------------------------------
@dataclass(slots=True)
class ModelSpec:
    """Builds layer `i` of a model identically on every worker; knows the activation shape between layers."""

    name: str
    num_layers: int
    build: Callable[[int], nn.Module]
    vocab: int
    seq_len: int
    hidden_shape: Callable[[int], tuple[int, ...]]
    """Activation shape between layers for a micro-batch of the given size."""
    meta: dict[str, object] = field(default_factory=dict)
    build_empty: Callable[[int], nn.Module] | None = None
    """Layer `i` with the right shapes and arbitrary contents on the CPU, read from nowhere and not
    initialised (None: `build`)."""
    tied: tuple[tuple[int, str], tuple[int, str]] | None = None
    """Two parameters that are one tensor in the model ((layer, parameter name) of the embedding's token
    weight and of the head's projection): `build` starts them equal, the runtime keeps them equal."""
    hf: HFModel | None = None
    """The Hugging Face model this spec builds (tensor names, config), for export; None for other models."""

    def __post_init__(self) -> None:
        if self.tied is not None:
            (first, _), (second, _) = self.tied
            if first == second or not (0 <= first < self.num_layers and 0 <= second < self.num_layers):
                raise ValueError(f"tied: layers {first} and {second} must be two layers of {self.num_layers}")

    def _check(self, index: int) -> None:
        if not 0 <= index < self.num_layers:
            raise ValueError(f"layer: {index} outside [0, {self.num_layers})")

    def layer(self, index: int) -> nn.Module:
        """Layer `index` with its initial weights (loaded or seeded), on the CPU."""
        self._check(index)
        return self.build(index)

    def allocate(self, index: int) -> nn.Module:
        """Layer `index` to be overwritten (by a peer-to-peer copy or a checkpoint): no disk read."""
        self._check(index)
        return (self.build_empty or self.build)(index)

    def hf_names(self, index: int) -> dict[str, str]:
        """Local parameter name -> Hugging Face tensor name, for layer `index` of a Hugging Face model."""
        self._check(index)
        if self.hf is None:
            raise ValueError(f"model: {self.name} is not a Hugging Face model (hf:<dir>, hf:<family>?...)")
        return self.hf.hf_names(index)


def builtin_model(config: ModelConfig) -> ModelSpec:
    """The GPT, Llama-style or sleep model of `config` as a `ModelSpec`."""
    hidden, last = config.hidden, config.layers - 1

    def build(index: int) -> nn.Module:
        # Seeding per layer makes layer i's initial weights independent of which other layers a worker holds.
        torch.manual_seed(config.seed * 100_003 + index)
        if config.kind == ModelKind.SLEEP:
            return SleepLayer(
                hidden, config.forward_sleep_s, 2 * config.forward_sleep_s, config.sleep_samples
            )
        llama = config.kind == ModelKind.LLAMA
        if index == 0:
            return Embedding(config.vocab, hidden, config.seq_len, positions=not llama)
        if index == last:
            return Head(hidden, config.vocab, rms=llama)
        return LlamaBlock(hidden, config.heads) if llama else GPTBlock(hidden, config.heads)

    return ModelSpec(
        name=f"{config.kind.value}-{config.layers}",
        num_layers=config.layers,
        build=build,
        vocab=config.vocab if config.kind != ModelKind.SLEEP else hidden,
        seq_len=config.seq_len,
        hidden_shape=lambda micro: (micro, config.seq_len, hidden),
        meta={"config": config},
    )


def user_model(target: str, vocab: int | None, seq_len: int, seed: int = 0) -> ModelSpec:
    """A model from `module:function`; the function returns the ordered layers (embedding ... head).

    The function is called once (seeded), layers are deep-copied on demand, and the activation shape between
    layers is read from one forward pass over a one-sample batch (the layers must share it). The vocabulary
    is the model's: what both its first layer (an embedding's rows) and its head (logits per token) take;
    `vocab` (the `vocab` model option) only where the model does not tell (a head that is no LM head).
    """
    module_name, sep, function_name = target.partition(":")
    if not sep or not module_name or not function_name:
        raise ValueError(f"model: expected 'module:function', got {target!r}")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"model: cannot load {target!r}: {exc}") from None
    if not callable(function):
        raise ValueError(f"model: {target!r} is a {type(function).__name__}, not a function")
    torch.manual_seed(seed)
    made = function()
    if not isinstance(made, Iterable):
        raise ValueError(f"model: {target!r} must return a non-empty sequence of torch.nn.Module")
    layers: Sequence[nn.Module] = list(made)
    if not layers or not all(isinstance(layer, nn.Module) for layer in layers):
        raise ValueError(f"model: {target!r} must return a non-empty sequence of torch.nn.Module")
    with torch.no_grad():
        x = torch.zeros(1, seq_len, dtype=torch.long)
        shapes = []
        for layer in layers[:-1]:
            x = layer(x)
            shapes.append(tuple(x.shape[1:]))
        logits = layers[-1](x)
    if len(set(shapes)) > 1:
        raise ValueError(
            f"model: layers of {target!r} must share one activation shape, got {sorted(set(shapes))}"
        )
    inner = shapes[0] if shapes else (seq_len,)
    widths = [int(logits.shape[-1])] if isinstance(logits, torch.Tensor) and logits.dim() == 3 else []
    rows = getattr(layers[0], "num_embeddings", None)
    widths += [rows] if isinstance(rows, int) else []
    return ModelSpec(
        name=target,
        num_layers=len(layers),
        build=lambda index: copy.deepcopy(layers[index]),
        vocab=min(widths) if widths else (vocab or 32),
        seq_len=seq_len,
        hidden_shape=lambda micro: (micro, *inner),
    )


def hf_model(spec: str, seq_len: int | None = 16, seed: int = 0) -> ModelSpec:
    """A Hugging Face causal LM as an ordered layer list: embedding, decoder blocks, head (see `_hf_models`).

    `spec` is `hf:<dir>`, `hf:<family>?key=value&...` or a built-in profile name (`llama2-7b`, ...);
    `seq_len` None means the model's maximum positions. Needs `transformers` (and `safetensors`)."""
    from . import _hf_models

    if spec.startswith(_hf_models.PREFIX):
        model = _hf_models.open_spec(spec, seed)
    else:
        model = _hf_models.open_profile(spec, seed)
    length = model.max_positions if seq_len is None else seq_len
    if length < 1:
        raise ValueError(f"seq_len: must be >= 1, got {length}")
    if model.family == "gpt2" and length > model.max_positions:
        raise ValueError(f"seq_len: {length} exceeds the {model.max_positions} positions of {spec}")
    hidden = model.hidden
    return ModelSpec(
        name=spec,
        num_layers=model.num_layers,
        build=model.layer,
        vocab=model.vocab,
        seq_len=length,
        hidden_shape=lambda micro: (micro, length, hidden),
        build_empty=model.allocate,
        tied=model.tied,
        hf=model,
    )


def load_model(name: str, **overrides: object) -> ModelSpec:
    """`gpt`, `llama`, `sleep` (built-ins, with ModelConfig overrides), `hf:<dir>`, `hf:<family>?...` or a
    built-in profile name such as `llama2-7b` (overrides: `seq_len`, default the model's positions, and
    `seed`), or `module:function`."""
    from resilientjob.protocol.models import ENCODER_PROFILES

    from ._hf_models import PROFILE_MODELS

    if name.startswith("hf:") or name in PROFILE_MODELS or name in ENCODER_PROFILES:
        seq_len = overrides.get("seq_len", 16 if name.startswith("hf:") else None)
        return hf_model(
            name,
            seq_len=None if seq_len is None else int(seq_len),  # type: ignore[call-overload]
            seed=int(overrides.get("seed", 0)),  # type: ignore[call-overload]
        )
    if ":" in name:
        vocab = overrides.get("vocab")
        return user_model(
            name,
            vocab=None if vocab is None else int(vocab),  # type: ignore[call-overload]
            seq_len=int(overrides.get("seq_len", 16)),  # type: ignore[call-overload]
            seed=int(overrides.get("seed", 0)),  # type: ignore[call-overload]
        )
    try:
        kind = ModelKind(name)
    except ValueError:
        raise ValueError(
            f"model: expected one of {[k.value for k in ModelKind]}, hf:<dir>, hf:<family>?..., "
            f"{sorted(PROFILE_MODELS)} or module:function, got {name!r}"
        ) from None
    return builtin_model(ModelConfig(kind=kind, **overrides))  # type: ignore[arg-type]


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sample loss summed over the micro-batch: each sample's mean token cross-entropy.

    Summing (not averaging) per sample lets the runtime divide by the global batch once, so any split of the
    batch over pipelines and micro-batches yields the gradient of the same global mean.
    """
    if logits.dim() == 3:
        # Over (tokens, vocab) rows, not the (batch, vocab, length) layout: CUDA's softmax over a strided
        # class dimension took a third of a 1.2B Llama's step on an H200 (bench/bench_gpu.py --profile).
        per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        return per_token.view_as(targets).mean(dim=1).sum()
    return F.mse_loss(logits, torch.zeros_like(logits), reduction="sum") / max(1, logits[0].numel())
