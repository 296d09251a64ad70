"""Hugging Face causal LMs as the runtime's ordered layer lists (`models.load_model`).

Three ways to name one:
    hf:<family>?<key>=<value>&...   a configuration, random initialisation. Family gpt2, llama, qwen2 or
        mistral; keys any field of the family's config class (int, float, `true`/`false`, else text), e.g.
        hf:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=32&n_positions=16
    hf:<dir>                        a local directory as `save_pretrained` writes it: config.json and
        model.safetensors, or model.safetensors.index.json and its shards. A path contains `/` or starts with
        `.`, which tells it from a family. Nothing is ever downloaded.
    llama2-7b, gpt3-2.7b, gpt3-6.7b the planner's built-in profiles as configurations (`PROFILE_MODELS`).

The layers are: embedding (GPT-2: token + position embedding), the decoder blocks (transformers' own
`GPT2Block`, `LlamaDecoderLayer`, `Qwen2DecoderLayer`, `MistralDecoderLayer`, each with its family's rotary
embedding), head (final norm + LM projection). A plan may put the embedding and the head on different
workers, so a tied LM head (GPT-2, or `tie_word_embeddings`) is a second copy of the token embedding that
starts equal to it (`HFModel.tied`); the runtime keeps the two equal by summing their gradients.

Layers of a directory are built on the `meta` device, materialised uninitialised on the CPU and then filled
from the checkpoint tensor by tensor (`safe_open(...).get_tensor(name)`), so a worker reads only the tensors
of the layers it holds and spends no time on random initialisation. Rotary embeddings hold non-persistent
buffers (`inv_freq`) that `to_empty` would leave as garbage: they are constructed on the CPU after the rest
of the layer is materialised. Configurations are initialised as `transformers` initialises its models
(normal(0, initializer_range), GPT-2's residual projections scaled by 1/sqrt(2 * layers)), each layer from
its own seed, so every worker builds layer i identically without communicating.

On purpose, unlike the `transformers` classes: dropout is 0 (the runtime's data order is deterministic and
its tests compare with a single-process run; a family spec may set `resid_pdrop` etc.), and attention is
SDPA with its causal mask (a sliding window, where the config has one, is an explicit mask).
`transformers` and `safetensors` are optional; without them an `hf:` model raises ValueError naming it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import torch
from torch import nn

from resilientjob.protocol.models import ENCODER_PROFILES

PREFIX = "hf:"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


class HFFamily(StrEnum):
    GPT2 = "gpt2"
    LLAMA = "llama"
    QWEN2 = "qwen2"
    MISTRAL = "mistral"


_FAMILIES = ", ".join(f.value for f in HFFamily)

CAUSAL_LM_CLASS = {
    HFFamily.GPT2: "GPT2LMHeadModel",
    HFFamily.LLAMA: "LlamaForCausalLM",
    HFFamily.QWEN2: "Qwen2ForCausalLM",
    HFFamily.MISTRAL: "MistralForCausalLM",
}
"""The `transformers` class whose `save_pretrained` names a family's tensors (config `architectures`)."""

PROFILE_MODELS: dict[str, tuple[HFFamily, dict[str, Any]]] = {
    # The shapes of scripts/gen_profiles.py (planner/profiles/*.json): embedding + 32 blocks + head = 34.
    "llama2-7b": (
        HFFamily.LLAMA,
        {
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "intermediate_size": 11008,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    ),
    # GPT-3 shapes (Brown et al., table 2.1) on the GPT-2 architecture (dense attention throughout).
    "gpt3-2.7b": (
        HFFamily.GPT2,
        {
            "n_layer": 32,
            "n_embd": 2560,
            "n_head": 32,
            "n_inner": 10240,
            "vocab_size": 50257,
            "n_positions": 2048,
        },
    ),
    "gpt3-6.7b": (
        HFFamily.GPT2,
        {
            "n_layer": 32,
            "n_embd": 4096,
            "n_head": 32,
            "n_inner": 16384,
            "vocab_size": 50257,
            "n_positions": 2048,
        },
    ),
}
"""Built-in profile names the runtime trains as the real architecture (random initialisation)."""

# `protocol.models` names the profiles the runtime trains and the encoder ones it refuses; this table must
# cover the first exactly (a test checks).


def is_directory_spec(spec: str) -> bool:
    """Whether `hf:<rest>` names a directory (`hf:./m`, `hf:/data/m`, `hf:models/m`) rather than a family."""
    rest = spec[len(PREFIX) :].partition("?")[0]
    return "/" in rest or rest.startswith(".")


# ---- configurations ------------------------------------------------------------------------------------
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
            f"model: hf family must be one of {[f.value for f in HFFamily]}, got {family_text!r} "
            f"(a local directory is written hf:./{family_text} or with its full path)"
        ) from None
    keys: dict[str, Any] = {}
    for key, text in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key in keys:
            raise ValueError(f"model: {spec!r} sets {key} twice")
        keys[key] = _value(text)
    return family, keys


def _transformers(what: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError(f"model: {what} needs transformers (pip install transformers)") from None
    return transformers


def _config_class(family: HFFamily, what: str) -> Any:
    transformers = _transformers(what)
    names = {
        HFFamily.GPT2: "GPT2Config",
        HFFamily.LLAMA: "LlamaConfig",
        HFFamily.QWEN2: "Qwen2Config",
        HFFamily.MISTRAL: "MistralConfig",
    }
    return getattr(transformers, names[family])


def _no_dropout(family: HFFamily) -> dict[str, Any]:
    if family is HFFamily.GPT2:
        return {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return {"attention_dropout": 0.0}


def family_config(family: HFFamily, keys: Mapping[str, Any]) -> Any:
    """The family's config class built from `keys` (unknown keys refused), dropout off unless set."""
    cls = _config_class(family, f"hf:{family}")
    keys = {**_no_dropout(family), **keys}
    if family is HFFamily.GPT2 and int(keys.get("vocab_size", 50257)) <= 50256:
        # GPT-2's special token ids (50256) lie outside a small vocabulary; the runtime uses none.
        keys = {"bos_token_id": None, "eos_token_id": None, **keys}
    known = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}))
    unknown = sorted(set(keys) - known)
    if unknown:
        raise ValueError(f"model: hf:{family} has no configuration key {unknown[0]!r}")
    try:
        config = cls(**keys)
    except Exception as exc:  # transformers' own checks: ValueError, TypeError, huggingface_hub's errors
        said = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise ValueError(f"model: hf:{family}: {said[-1] if said else type(exc).__name__}") from None
    config._attn_implementation = "sdpa"  # the causal mask without an explicit attention mask
    return config


# ---- layers --------------------------------------------------------------------------------------------
class _GPT2Embedding(nn.Module):
    """Token + learned position embedding (GPT-2's `wte`, `wpe`)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        out: torch.Tensor = self.drop(self.wte(tokens) + self.wpe(positions)[None])
        return out


class _Embedding(nn.Module):
    """Token embedding (Llama, Qwen2, Mistral: `embed_tokens`)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.embed_tokens(tokens)
        return out


class _Block(nn.Module):
    """One decoder block. Llama-style blocks need the rotary embedding of the positions (which their model
    class computes once for all blocks), and a sliding-window layer its mask once the sequence is longer."""

    def __init__(self, block: nn.Module, rotary: nn.Module | None, window: int | None) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary
        self.window = window

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        options: dict[str, Any] = {}
        length = hidden.shape[1]
        if self.rotary is not None:
            positions = torch.arange(length, device=hidden.device)[None]
            options = {"position_ids": positions, "position_embeddings": self.rotary(hidden, positions)}
        if self.window is not None and length > self.window:
            index = torch.arange(length, device=hidden.device)
            distance = index[:, None] - index[None, :]  # query - key
            options["attention_mask"] = ((distance >= 0) & (distance < self.window))[None, None]
        out: torch.Tensor = self.block(hidden, **options)
        return out


class _Head(nn.Module):
    """Final norm + LM projection (`ln_f` / `norm`, `lm_head`)."""

    def __init__(self, norm: nn.Module, hidden: int, vocab: int) -> None:
        super().__init__()
        self.norm = norm
        self.proj = nn.Linear(hidden, vocab, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(self.norm(hidden))
        return out


def _block_classes(family: HFFamily) -> tuple[Any, Any, Any]:
    """(decoder layer, RMSNorm or None, rotary embedding or None) of a family, imported on first use."""
    if family is HFFamily.GPT2:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return GPT2Block, None, None
    if family is HFFamily.LLAMA:
        from transformers.models.llama import modeling_llama as llama

        return llama.LlamaDecoderLayer, llama.LlamaRMSNorm, llama.LlamaRotaryEmbedding
    if family is HFFamily.QWEN2:
        from transformers.models.qwen2 import modeling_qwen2 as qwen2

        return qwen2.Qwen2DecoderLayer, qwen2.Qwen2RMSNorm, qwen2.Qwen2RotaryEmbedding
    from transformers.models.mistral import modeling_mistral as mistral

    return mistral.MistralDecoderLayer, mistral.MistralRMSNorm, mistral.MistralRotaryEmbedding


def _window(config: Any, block: int) -> int | None:
    """The sliding attention window of decoder block `block`, None for full causal attention."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # Qwen2: only the blocks marked sliding use the window
        return window if layer_types[block] == "sliding_attention" else None
    return window if window else None


def _hf_init(module: nn.Module, config: Any, gpt2: bool) -> None:
    """Initialise as `transformers` does: matrices normal(0, initializer_range) (GPT-2's residual
    projections `c_proj` scaled by 1/sqrt(2 * layers)), biases 0, norms 1, the padding row 0."""
    std = float(config.initializer_range)
    residual = std / math.sqrt(2 * config.num_hidden_layers)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, residual if gpt2 and name.endswith("c_proj.weight") else std)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)
        for sub in module.modules():
            if isinstance(sub, nn.Embedding) and sub.padding_idx is not None:
                sub.weight[sub.padding_idx].zero_()


# ---- the model -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HFModel:
    """A Hugging Face causal LM as builders of its layers, with the `transformers` names of their tensors."""

    family: HFFamily
    config: Any
    """The family's `PretrainedConfig` (dropout off, SDPA attention)."""
    seed: int = 0
    directory: Path | None = None
    """The checkpoint directory (absolute), or None for a configuration initialised at random."""
    files: Mapping[str, str] = field(default_factory=dict)
    """Directory only: tensor name -> the safetensors file (in `directory`) that holds it."""
    prefixed: bool = True
    """Whether tensor names carry the base model's prefix (`transformer.` / `model.`); checkpoints saved from
    the base model class (GPT-2 as first published, for one) have none."""

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers) + 2

    @property
    def hidden(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab(self) -> int:
        return int(self.config.vocab_size)

    @property
    def max_positions(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def tied(self) -> tuple[tuple[int, str], tuple[int, str]] | None:
        """((0, token weight in layer 0), (last, projection weight in the head)) when `transformers` ties
        the LM head to the embedding, else None."""
        if not getattr(self.config, "tie_word_embeddings", False):
            return None
        token = "wte.weight" if self.family is HFFamily.GPT2 else "embed_tokens.weight"
        return (0, token), (self.num_layers - 1, "proj.weight")

    @property
    def source(self) -> str:
        """Where the weights come from, for error messages."""
        if self.directory is None:
            return f"hf:{self.family} (random initialisation)"
        index = self.directory / WEIGHTS_INDEX
        return str(index if index.is_file() else self.directory / WEIGHTS)

    # ---- names -------------------------------------------------------------------------------------------
    def hf_name(self, index: int, local: str) -> str:
        """The `transformers` tensor name of parameter `local` of layer `index`."""
        gpt2 = self.family is HFFamily.GPT2
        body = ("transformer." if gpt2 else "model.") if self.prefixed else ""
        if index == 0:
            return body + local
        if index == self.num_layers - 1:
            if local.startswith("proj."):
                return "lm_head." + local.removeprefix("proj.")
            return body + ("ln_f." if gpt2 else "norm.") + local.removeprefix("norm.")
        return body + f"{'h' if gpt2 else 'layers'}.{index - 1}." + local.removeprefix("block.")

    def hf_names(self, index: int) -> dict[str, str]:
        """Local parameter name -> `transformers` tensor name, for every parameter of layer `index`."""
        return {local: self.hf_name(index, local) for local, _ in self.meta_layer(index).named_parameters()}

    def tied_source(self, index: int, local: str) -> str | None:
        """The tensor a tied head projection is read from (the embedding's), else None."""
        tied = self.tied
        if tied is None or (index, local) != tied[1]:
            return None
        return self.hf_name(*tied[0])

    # ---- builders ----------------------------------------------------------------------------------------
    def _construct(self, index: int, rotary: bool = True) -> nn.Module:
        """Layer `index` by its modules' constructors, on the current default device."""
        if not 0 <= index < self.num_layers:
            raise ValueError(f"layer: {index} outside [0, {self.num_layers})")
        config, gpt2 = self.config, self.family is HFFamily.GPT2
        block_cls, norm_cls, rotary_cls = _block_classes(self.family)
        if index == 0:
            return _GPT2Embedding(config) if gpt2 else _Embedding(config)
        if index == self.num_layers - 1:
            if gpt2:
                norm: nn.Module = nn.LayerNorm(self.hidden, eps=config.layer_norm_epsilon)
            else:
                norm = norm_cls(self.hidden, eps=config.rms_norm_eps)
            return _Head(norm, self.hidden, self.vocab)
        block = block_cls(config, layer_idx=index - 1)
        rope = rotary_cls(config) if rotary and rotary_cls is not None else None
        return _Block(block, rope, _window(config, index - 1))

    def meta_layer(self, index: int) -> nn.Module:
        """Layer `index` on the meta device (shapes and names only; nothing allocated)."""
        with torch.device("meta"):
            return self._construct(index)

    def allocate(self, index: int) -> nn.Module:
        """Layer `index` on the CPU with uninitialised parameters (to be overwritten) and correct buffers."""
        with torch.device("meta"):
            module = self._construct(index, rotary=False)
        module = module.to_empty(device="cpu")
        stray = [name for name, _ in module.named_buffers()]
        if stray:  # a buffer to_empty left uninitialised: this transformers version needs another rule
            raise RuntimeError(
                f"model: layer {index} of {self.family} has buffers {stray} that meta init loses"
            )
        if isinstance(module, _Block):
            rotary_cls = _block_classes(self.family)[2]
            if rotary_cls is not None:
                with torch.device("cpu"):  # computed here, not left to to_empty
                    module.rotary = rotary_cls(self.config)
        return module

    def layer(self, index: int) -> nn.Module:
        """Layer `index` with its initial weights: read from the directory, else seeded random init (on the
        current default device, so a test may build it under `torch.device("meta")`)."""
        if self.directory is not None:
            module = self.allocate(index)
            self._load(index, module)
            return module
        # Seeding per layer makes layer i's initial weights independent of which other layers a worker holds.
        torch.manual_seed(self.seed * 100_003 + index)
        module = self._construct(index)
        _hf_init(module, self.config, self.family is HFFamily.GPT2)
        tied = self.tied
        if tied is not None and index == tied[1][0]:
            source = self.layer(tied[0][0]).get_parameter(tied[0][1])
            with torch.no_grad():
                module.get_parameter(tied[1][1]).copy_(source)
        return module

    def check_checkpoint(self) -> None:
        """ValueError naming the first tensor of any layer that the directory lacks or holds with another
        shape, or a shard that cannot be read. Reads only the safetensors headers: node 0 runs it before the
        job is planned, so a broken checkpoint fails the job before any worker starts."""
        from safetensors import SafetensorError, safe_open

        if self.directory is None:
            return
        wanted: dict[str, dict[str, tuple[int, tuple[int, ...]]]] = {}  # file -> name -> (layer, shape)
        for index in range(self.num_layers):
            for local, param in self.meta_layer(index).named_parameters():
                name = self.tied_source(index, local) or self.hf_name(index, local)
                file = self.files.get(name)
                if file is None:
                    raise ValueError(f"model: tensor {name!r} of layer {index} not found in {self.source}")
                wanted.setdefault(file, {}).setdefault(name, (index, tuple(param.shape)))
        for file, tensors in wanted.items():
            path = self.directory / file
            try:
                with safe_open(str(path), framework="pt", device="cpu") as reader:
                    present = set(reader.keys())
                    for name, (index, shape) in tensors.items():
                        if name not in present:
                            raise ValueError(f"model: tensor {name!r} of layer {index} not found in {path}")
                        found = tuple(reader.get_slice(name).get_shape())
                        if found != shape:
                            raise ValueError(
                                f"model: tensor {name!r} in {path} has shape {list(found)}, layer {index} "
                                f"expects {list(shape)}"
                            )
            except (OSError, SafetensorError) as exc:  # a missing or truncated shard
                raise ValueError(f"model: cannot read {path}: {exc}") from None

    def _load(self, index: int, module: nn.Module) -> None:
        """Fill every parameter of layer `index` from its own tensors of the checkpoint, strictly."""
        from safetensors import SafetensorError, safe_open

        if self.directory is None:
            raise RuntimeError("model: only a directory's layers are loaded")
        by_file: dict[str, list[tuple[nn.Parameter, str]]] = {}
        for local, param in module.named_parameters():
            name = self.tied_source(index, local) or self.hf_name(index, local)
            file = self.files.get(name)
            if file is None:
                raise ValueError(f"model: tensor {name!r} of layer {index} not found in {self.source}")
            by_file.setdefault(file, []).append((param, name))
        with torch.no_grad():
            for file, wanted in by_file.items():
                path = self.directory / file
                try:
                    with safe_open(str(path), framework="pt", device="cpu") as reader:
                        for param, name in wanted:
                            shape = tuple(reader.get_slice(name).get_shape())
                            if shape != tuple(param.shape):
                                raise ValueError(
                                    f"model: tensor {name!r} in {path} has shape {list(shape)}, layer "
                                    f"{index} expects {list(param.shape)}"
                                )
                            param.copy_(reader.get_tensor(name))
                except (OSError, SafetensorError) as exc:  # a missing or truncated shard
                    raise ValueError(f"model: cannot read {path}: {exc}") from None


# ---- opening ---------------------------------------------------------------------------------------------
def _tensor_files(directory: Path, text: str) -> dict[str, str]:
    """Tensor name -> file, from the index of a sharded checkpoint or the header of a single file."""
    index = directory / WEIGHTS_INDEX
    single = directory / WEIGHTS
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, json.JSONDecodeError, AttributeError) as exc:
            raise ValueError(f"model: {index} is not a safetensors index: {exc}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"model: {index} has no weight_map of tensor name -> file")
        return dict(weight_map)
    if single.is_file():
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(single), framework="pt", device="cpu") as reader:  # the header only
                return dict.fromkeys(reader.keys(), WEIGHTS)
        except (OSError, SafetensorError) as exc:
            raise ValueError(f"model: cannot read {single}: {exc}") from None
    raise ValueError(f"model: no {WEIGHTS} or {WEIGHTS_INDEX} in {text}")


def open_directory(text: str, seed: int = 0) -> HFModel:
    """The model saved in directory `text` (`save_pretrained` layout); ValueError naming what is missing."""
    directory = Path(text).expanduser()
    if not directory.is_dir():
        raise ValueError(f"model: {text} is not a directory")
    config_path = Path(text) / "config.json"
    try:
        data = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"model: {config_path} not found") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model: {config_path} cannot be read: {exc}") from None
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if model_type not in {f.value for f in HFFamily}:
        raise ValueError(f"model: {config_path} model_type {model_type!r} is not supported ({_FAMILIES})")
    family = HFFamily(model_type)
    _transformers(f"hf:{text}")
    files = _tensor_files(directory, text)
    config = _config_class(family, f"hf:{text}").from_dict({**data, **_no_dropout(family)})
    config._attn_implementation = "sdpa"
    # Both conventions occur: names of the causal-LM class, or of its base model (no `transformer.` /
    # `model.` prefix); the embedding's name tells which, and export writes the same names back.
    token = "wte.weight" if family is HFFamily.GPT2 else "embed_tokens.weight"
    for prefixed in (True, False):
        model = HFModel(family, config, seed, directory.resolve(), files, prefixed)
        if model.hf_name(0, token) in files:
            return model
    name = ("transformer." if family is HFFamily.GPT2 else "model.") + token
    raise ValueError(f"model: tensor {name!r} (or {token!r}) not found in {model.source}")


def open_spec(spec: str, seed: int = 0) -> HFModel:
    """An `hf:` spec (directory or family configuration) as an `HFModel`."""
    if is_directory_spec(spec):
        return open_directory(spec[len(PREFIX) :], seed)
    family, keys = parse_spec(spec)
    return HFModel(family, family_config(family, keys), seed)


def open_profile(name: str, seed: int = 0) -> HFModel:
    """A built-in profile name as its architecture; ValueError for an encoder profile."""
    if name in ENCODER_PROFILES:
        raise ValueError(
            f"model: {name} is an encoder profile that the runtime cannot train (it trains causal LMs); use "
            f"synthetic:{name} for a scale test"
        )
    family, keys = PROFILE_MODELS[name]
    return HFModel(family, family_config(family, keys), seed)
