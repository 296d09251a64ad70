"""Hugging Face GPT-2 and Llama configurations as the runtime's ordered layer lists (`models.load_model`).

Spec string: `hf:<family>?<key>=<value>&...`, family `gpt2` or `llama`, keys any field of `GPT2Config` /
`LlamaConfig`; values are parsed as int, float, `true`/`false`, else kept as text. Examples:
    hf:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=32&n_positions=16
    hf:llama?num_hidden_layers=2&hidden_size=32&intermediate_size=64&num_attention_heads=2&vocab_size=32
Nothing is downloaded: the configuration is built from the keys (random initialisation by the modules' own
constructors, layer i seeded on its own as for the built-in models). The layers are
    embedding (GPT-2: token + position embedding; Llama: token embedding), the configuration's decoder
    blocks (`GPT2Block`, `LlamaDecoderLayer` with its rotary embedding), head (final norm + LM projection).
Differences from the `transformers` model classes, on purpose: the LM head is not tied to the embedding
(a plan may place them on different workers, and a layer owns its parameters); GPT-2's dropouts default to
0 (the runtime's data order is deterministic and its tests compare with a single-process run; set
`resid_pdrop` etc. to enable them); attention is SDPA with its causal mask. `transformers` is optional
(`pip install transformers`); without it an `hf:` spec raises ValueError naming the model.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Any
from urllib.parse import parse_qsl

import torch
from torch import nn

PREFIX = "hf:"


class HFFamily(StrEnum):
    GPT2 = "gpt2"
    LLAMA = "llama"


def _value(text: str) -> int | float | bool | str:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def parse_spec(spec: str) -> tuple[HFFamily, dict[str, Any]]:
    """`hf:<family>?k=v&...` -> (family, configuration keys); ValueError naming the model otherwise."""
    if not spec.startswith(PREFIX):
        raise ValueError(f"model: an hf spec starts with {PREFIX!r}, got {spec!r}")
    family_text, _, query = spec[len(PREFIX) :].partition("?")
    try:
        family = HFFamily(family_text)
    except ValueError:
        raise ValueError(
            f"model: hf family must be one of {[f.value for f in HFFamily]}, got {family_text!r}"
        ) from None
    keys: dict[str, Any] = {}
    for key, text in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key in keys:
            raise ValueError(f"model: {spec!r} sets {key} twice")
        keys[key] = _value(text)
    return family, keys


def _config(family: HFFamily, keys: dict[str, Any]) -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError(f"model: hf:{family} needs transformers (pip install transformers)") from None
    if family is HFFamily.GPT2:
        keys = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **keys}
        if int(keys.get("vocab_size", 50257)) <= 50256:
            # GPT-2's special token ids (50256) lie outside a small vocabulary; the runtime uses none.
            keys = {"bos_token_id": None, "eos_token_id": None, **keys}
        cls: Any = transformers.GPT2Config
    else:
        cls = transformers.LlamaConfig
    known = set(cls().to_dict()) | {"num_hidden_layers", "hidden_size", "num_attention_heads"}
    unknown = sorted(set(keys) - known)
    if unknown:
        raise ValueError(f"model: hf:{family} has no configuration key {unknown[0]!r}")
    config = cls(**keys)
    config._attn_implementation = "sdpa"  # the causal mask without an explicit attention mask
    return config


class _GPT2Embedding(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        out: torch.Tensor = self.drop(self.wte(tokens) + self.wpe(positions)[None])
        return out


class _Block(nn.Module):
    """One decoder block; Llama's needs the rotary embedding of the positions, which its model computes."""

    def __init__(self, block: nn.Module, rotary: nn.Module | None) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        options: dict[str, Any] = {}
        if self.rotary is not None:
            positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
            options = {"position_ids": positions, "position_embeddings": self.rotary(hidden, positions)}
        out: torch.Tensor = self.block(hidden, **options)
        return out


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, hidden: int, vocab: int) -> None:
        super().__init__()
        self.norm = norm
        self.proj = nn.Linear(hidden, vocab, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(self.norm(hidden))
        return out


def hf_layers(spec: str) -> tuple[int, int, int, Callable[[int], nn.Module]]:
    """(layers, vocabulary, hidden size, build(i)) of an `hf:` spec; build(i) is not seeded here."""
    family, keys = parse_spec(spec)
    config = _config(family, keys)
    if family is HFFamily.GPT2:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        blocks, hidden = config.n_layer, config.n_embd

        def build(index: int) -> nn.Module:
            if index == 0:
                return _GPT2Embedding(config)
            if index == blocks + 1:
                return _Head(nn.LayerNorm(hidden, eps=config.layer_norm_epsilon), hidden, config.vocab_size)
            return _Block(GPT2Block(config, layer_idx=index - 1), None)  # type: ignore[no-untyped-call]

    else:
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )

        blocks, hidden = config.num_hidden_layers, config.hidden_size

        def build(index: int) -> nn.Module:
            if index == 0:
                return nn.Embedding(config.vocab_size, hidden)
            if index == blocks + 1:
                return _Head(LlamaRMSNorm(hidden, eps=config.rms_norm_eps), hidden, config.vocab_size)
            return _Block(LlamaDecoderLayer(config, layer_idx=index - 1), LlamaRotaryEmbedding(config))

    return blocks + 2, int(config.vocab_size), int(hidden), build
