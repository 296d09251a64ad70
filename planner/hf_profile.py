"""The profile of a Hugging Face causal LM computed from its config.json alone: no weights, no torch.

`profile_from_hf_config` gives the `ModelProfile` of the layer list the runtime builds for a GPT-2, Llama,
Qwen2 or Mistral model (agent/_hf_models: embedding, decoder blocks, head), per micro-batch:
- parameter bytes: exact for the runtime's fp32 layers; a tied LM head counts as its own copy, as the
  runtime holds it;
- optimizer bytes: exactly as agent/p2p.layer_state_bytes counts AdamW's state, 2 x the parameter bytes
  (exp_avg, exp_avg_sq) plus one 4-byte step per parameter tensor;
- times: FLOPs at the device's nominal speed, backward = 2 x forward. FLOPs are 2 per matmul weight per
  token plus the attention scores and weighted sum, 4 x seq x width per token (`matmul_flops`,
  `attention_flops`, `embedding_flops`: the formulas scripts/gen_profiles.py also uses);
- activation bytes: an estimate of what autograd keeps for backward in fp32, without recomputation: the
  tensors each operation of the block saves, per token (see `_block_activation`); output bytes: the fp32
  hidden state sent to the next stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import PlannerError
from .profile import LayerProfile, ModelProfile

FAMILIES = ("gpt2", "llama", "qwen2", "mistral")
NOMINAL_FLOPS = 150e12
"""The default device speed: 150 TFLOP/s sustained (an A100 / Ascend 910B class device in bf16)."""
FP32 = 4
"""Bytes per element: the runtime's parameters, AdamW state, activations and step counts are fp32."""
TOKEN_ID = 8
"""Bytes of one int64 token id."""

_ACTIVATION_SAVES = {"gelu_new": 4, "gelu_fast": 4}
"""Tensors of the MLP's width that an activation saves for backward: 1 for a single kernel (gelu, silu,
relu), 4 for the tanh approximations written as elementwise operations."""


def matmul_flops(params: float, tokens: float) -> float:
    """Forward FLOPs of multiplying `tokens` token vectors by `params` weights: a multiply-add each."""
    return 2.0 * params * tokens


def attention_flops(tokens: float, seq: float, width: float) -> float:
    """Forward FLOPs of attention scores (Q K^T) and weighted sum (P V) over `seq` keys of `width` columns."""
    return 4.0 * tokens * seq * width


def embedding_flops(tokens: float, hidden: float) -> float:
    """Forward FLOPs charged to an embedding lookup (2 per output element, as the position add)."""
    return 2.0 * tokens * hidden


@dataclass(frozen=True, slots=True)
class _Shape:
    """The sizes a layer's cost depends on, read from a config of any of the families."""

    family: str
    hidden: int
    blocks: int
    heads: int
    kv_heads: int
    head_dim: int
    inner: int
    vocab: int
    positions: int
    window: int | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    activation_saves: int


def _int(config: Mapping[str, Any], *names: str, default: int | None = None) -> int:
    for name in names:
        value = config.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlannerError(f"config.{name}", f"must be a positive integer, got {value!r}")
            return value
    if default is None:
        raise PlannerError(f"config.{names[0]}", "missing")
    return default


def _shape(config: Mapping[str, Any]) -> _Shape:
    family = config.get("model_type")
    if family not in FAMILIES:
        raise PlannerError("config.model_type", f"{family!r} is not supported ({', '.join(FAMILIES)})")
    hidden = _int(config, "n_embd", "hidden_size")
    heads = _int(config, "n_head", "num_attention_heads")
    if family == "gpt2":
        if hidden % heads:
            raise PlannerError("config.n_head", f"must divide n_embd={hidden}, got {heads}")
        activation = str(config.get("activation_function", "gelu_new"))
        return _Shape(
            family=family,
            hidden=hidden,
            blocks=_int(config, "n_layer", "num_hidden_layers"),
            heads=heads,
            kv_heads=heads,
            head_dim=hidden // heads,
            inner=_int(config, "n_inner", default=4 * hidden),
            vocab=_int(config, "vocab_size"),
            positions=_int(config, "n_positions", "max_position_embeddings"),
            window=None,
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            activation_saves=_ACTIVATION_SAVES.get(activation, 1),
        )
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if family == "qwen2" and (not layer_types or "sliding_attention" not in layer_types):
        window = None  # Qwen2 applies its window only to the layers marked sliding
    attention_bias = bool(config.get("attention_bias", False))
    return _Shape(
        family=family,
        hidden=hidden,
        blocks=_int(config, "num_hidden_layers"),
        heads=heads,
        kv_heads=_int(config, "num_key_value_heads", default=heads),
        head_dim=_int(config, "head_dim", default=hidden // heads),
        inner=_int(config, "intermediate_size"),
        vocab=_int(config, "vocab_size"),
        positions=_int(config, "max_position_embeddings"),
        window=window if isinstance(window, int) and window > 0 else None,
        qkv_bias=family == "qwen2" or (family == "llama" and attention_bias),
        o_bias=family == "llama" and attention_bias,
        mlp_bias=family == "llama" and bool(config.get("mlp_bias", False)),
        activation_saves=_ACTIVATION_SAVES.get(str(config.get("hidden_act", "silu")), 1),
    )


def _embedding_tensors(shape: _Shape) -> list[int]:
    if shape.family == "gpt2":
        return [shape.vocab * shape.hidden, shape.positions * shape.hidden]  # wte, wpe
    return [shape.vocab * shape.hidden]


def _block_tensors(shape: _Shape) -> tuple[list[int], int]:
    """(element count of every parameter tensor, matmul weights) of one decoder block."""
    h, inner = shape.hidden, shape.inner
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if shape.family == "gpt2":
        matrices = [h * 3 * h, h * h, h * inner, inner * h]  # c_attn, attn c_proj, c_fc, mlp c_proj
        vectors = [3 * h, h, inner, h] + [h] * 4  # their biases, ln_1 and ln_2 weight and bias
        return matrices + vectors, sum(matrices)
    matrices = [q * h, kv * h, kv * h, h * q, inner * h, inner * h, h * inner]  # q k v o, gate up down
    vectors = [h, h]  # input_layernorm, post_attention_layernorm
    if shape.qkv_bias:
        vectors += [q, kv, kv]
    if shape.o_bias:
        vectors += [h]
    if shape.mlp_bias:
        vectors += [inner, inner, h]
    return matrices + vectors, sum(matrices)


def _head_tensors(shape: _Shape) -> list[int]:
    norm = [shape.hidden, shape.hidden] if shape.family == "gpt2" else [shape.hidden]
    return [*norm, shape.vocab * shape.hidden]  # the projection, a copy of the embedding's when tied


def _block_activation(shape: _Shape) -> int:
    """fp32 elements a block keeps for backward per token: its input, each norm's statistics and output,
    the attention projections' outputs (q, k, v), SDPA's output and log-sum-exp, the copy the output
    projection reads, the residual sum, the MLP's input and its width-`inner` tensors (activation input
    and what it saves, the up projection and the product for a gated MLP)."""
    h, inner = shape.hidden, shape.inner
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if shape.family == "gpt2":  # LayerNorm saves mean and rstd (2); the MLP is c_fc -> act -> c_proj
        return (
            h + 2 + h + (q + 2 * kv) + q + shape.heads + q + h + 2 + h + (shape.activation_saves + 1) * inner
        )
    # RMSNorm saves rstd (1) and the normalised input (h) before scaling; the MLP is gated (gate, up).
    return (
        h
        + (1 + h)
        + h
        + (q + 2 * kv)
        + q
        + shape.heads
        + q
        + h
        + (1 + h)
        + h
        + (shape.activation_saves + 3) * inner
    )


def _head_activation(shape: _Shape) -> int:
    """fp32 elements the head keeps per token: its input, the norm's, the projection's input and the
    log-softmax of the logits (the loss's)."""
    norm = 2 if shape.family == "gpt2" else 1 + shape.hidden
    return shape.hidden + norm + shape.hidden + shape.vocab


def _layer(
    name: str, tensors: list[int], flops: float, device_flops: float, activation: int, output: int
) -> LayerProfile:
    param_bytes = FP32 * sum(tensors)
    forward = flops / device_flops
    return LayerProfile(
        name=name,
        forward_s=forward,
        backward_s=2 * forward,
        param_bytes=param_bytes,
        optimizer_bytes=2 * param_bytes + FP32 * len(tensors),
        activation_bytes=activation,
        output_bytes=output,
    )


def profile_from_hf_config(
    config: Mapping[str, Any],
    seq_len: int,
    microbatch_size: int = 1,
    device_flops: float = NOMINAL_FLOPS,
    name: str | None = None,
) -> ModelProfile:
    """The runtime's per-layer profile of the model of `config` (a config.json mapping) for micro-batches of
    `microbatch_size` sequences of `seq_len` tokens on a device of `device_flops` FLOP/s.

    Raises PlannerError naming the field for an unsupported family or a bad size."""
    if seq_len < 1:
        raise PlannerError("seq_len", f"must be >= 1, got {seq_len}")
    if microbatch_size < 1:
        raise PlannerError("microbatch_size", f"must be >= 1, got {microbatch_size}")
    if not device_flops > 0:
        raise PlannerError("device_flops", f"must be > 0, got {device_flops}")
    shape = _shape(config)
    tokens = seq_len * microbatch_size
    hidden_out = FP32 * tokens * shape.hidden
    keys = seq_len if shape.window is None else min(seq_len, shape.window)
    block, block_matmul = _block_tensors(shape)
    block_flops = matmul_flops(block_matmul, tokens) + attention_flops(
        tokens, keys, shape.heads * shape.head_dim
    )
    layers = [
        _layer(
            "embedding",
            _embedding_tensors(shape),
            embedding_flops(tokens, shape.hidden),
            device_flops,
            TOKEN_ID * (tokens + (seq_len if shape.family == "gpt2" else 0)),  # ids (and GPT-2's positions)
            hidden_out,
        )
    ]
    layers += [
        _layer(
            f"block{i}",
            block,
            block_flops,
            device_flops,
            FP32 * tokens * _block_activation(shape),
            hidden_out,
        )
        for i in range(shape.blocks)
    ]
    head_flops = matmul_flops(shape.vocab * shape.hidden, tokens)
    layers.append(
        _layer(
            "head", _head_tensors(shape), head_flops, device_flops, FP32 * tokens * _head_activation(shape), 0
        )
    )
    return ModelProfile(name=name or f"hf-{shape.family}", layers=tuple(layers))
