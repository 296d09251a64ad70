"""Write a trained Hugging Face model in the layout `transformers.AutoModelForCausalLM.from_pretrained` reads.

The writer is distributed: each layer is written by exactly one worker (`write_layer`, one safetensors shard
per layer, `model-{i+1:05d}-of-{N:05d}.safetensors`), and one worker writes the rest (`write_metadata`):
config.json, the shard index `model.safetensors.index.json` (computed from the layers' shapes on the meta
device, so it needs no weights) and, for a model read from a directory, its tokenizer files and
generation_config.json. Tensor names are those of the input checkpoint (with or without the base model's
prefix, as it had them), or those `save_pretrained` of the family's causal-LM class writes for a
configuration. A tied LM head is not written: `transformers` ties it to the token embedding on load.

Every file is written under a temporary name in the output directory and renamed into place, so a reader
never sees half a file. Tensors are written as `dtype` (float32 by default, the runtime's master weights)
and config.json says so.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._data_files import tokenizer_file
from ._hf_models import CAUSAL_LM_CLASS, WEIGHTS_INDEX, HFModel
from .models import ModelSpec

METADATA_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
"""Files copied from the input directory when present (what `save_pretrained` of a model and of its
tokenizer write besides the weights and config.json)."""


def shard_name(index: int, num_layers: int) -> str:
    """The safetensors file holding layer `index` of an exported model."""
    return f"model-{index + 1:05d}-of-{num_layers:05d}.safetensors"


def _hf(spec: ModelSpec) -> HFModel:
    if spec.hf is None:
        raise ValueError(
            f"model: {spec.name} is not a Hugging Face model; export needs hf:<dir>, hf:<family>?... or a "
            "built-in profile name"
        )
    return spec.hf


def _exported(hf: HFModel, index: int, names: Mapping[str, str]) -> dict[str, str]:
    """Local name -> tensor name of the tensors layer `index` writes (all but a tied head projection)."""
    tied = hf.tied
    skip = tied[1][1] if tied is not None and index == tied[1][0] else None
    return {local: name for local, name in names.items() if local != skip}


def _atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Write `path` through a temporary file in the same directory, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(temporary)
        # Readable by whoever serves the model (safetensors writes its files 0600): pods run as uid 10001.
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def write_layer(
    spec: ModelSpec, index: int, module: nn.Module, out_dir: str | Path, dtype: torch.dtype = torch.float32
) -> Path:
    """Write layer `index` (`module`, with the spec's local parameter names) as its own shard; return it.

    ValueError when the module's parameters are not the spec's layer's (names or shapes)."""
    from safetensors.torch import save_file

    hf = _hf(spec)
    expected = hf.meta_layer(index)
    shapes = {name: tuple(param.shape) for name, param in expected.named_parameters()}
    found = {name: tuple(param.shape) for name, param in module.named_parameters()}
    if found != shapes:
        wrong = sorted(set(found) ^ set(shapes)) or sorted(n for n in shapes if shapes[n] != found[n])
        raise ValueError(f"module: layer {index} of {spec.name} does not match the model at {wrong[:3]}")
    params = dict(module.named_parameters())
    tensors = {
        name: params[local].detach().to(device="cpu", dtype=dtype).contiguous()
        for local, name in _exported(hf, index, hf.hf_names(index)).items()
    }
    path = Path(out_dir) / shard_name(index, spec.num_layers)
    _atomic(path, lambda target: save_file(tensors, str(target), metadata={"format": "pt"}))
    return path


def _config(hf: HFModel, dtype: torch.dtype) -> dict[str, Any]:
    if hf.directory is not None:
        config: dict[str, Any] = json.loads((hf.directory / "config.json").read_text())
    else:
        config = hf.config.to_dict()
        config.setdefault("architectures", [CAUSAL_LM_CLASS[hf.family]])
    # The tensors are written as `dtype`, whatever the input was: say so, or from_pretrained would cast.
    dtype_name = str(dtype).removeprefix("torch.")
    config["dtype"] = dtype_name
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype_name
    return config


def _copy_from(source: Path) -> Callable[[Path], None]:
    def copy(target: Path) -> None:
        shutil.copyfile(source, target)

    return copy


STALE_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5")
"""Weight files of another model that `from_pretrained` would load instead of (or mix with) the exported
shards: a single-file checkpoint wins over a sharded one, so a directory that held a `save_pretrained`
model loaded its old weights after the export."""


def remove_stale_weights(spec: ModelSpec, out_dir: str | Path) -> list[str]:
    """Remove from `out_dir` the weight files that are not this export's (`STALE_WEIGHTS`, the shards a
    `pytorch_model.bin` index names, and safetensors shards of another layer count); their names."""
    out = Path(out_dir)
    ours = {shard_name(index, spec.num_layers) for index in range(spec.num_layers)}
    stale = [out / name for name in STALE_WEIGHTS]
    stale += [path for path in out.glob("model-*-of-*.safetensors") if path.name not in ours]
    stale += list(out.glob("pytorch_model-*-of-*.bin"))
    removed = []
    for path in stale:
        if path.is_file():
            path.unlink()
            removed.append(path.name)
    return sorted(removed)


def write_metadata(
    spec: ModelSpec, out_dir: str | Path, dtype: torch.dtype = torch.float32, tokenizer: Path | None = None
) -> None:
    """Write config.json, the shard index and the input directory's tokenizer files into `out_dir`, after
    removing the weights of any model it held before (`remove_stale_weights`). `tokenizer`: the one the
    job's data was tokenized with (`spec.data.tokenizer`, a directory or its tokenizer.json), written too
    when the model's directory has none, so that the trained model comes with what reads its input."""
    hf = _hf(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    removed = remove_stale_weights(spec, out)
    if removed:
        print(f"export: removed the weights of the model {out} held before: {removed}", flush=True)
    weight_map: dict[str, str] = {}
    total = 0
    element = torch.empty((), dtype=dtype).element_size()
    for index in range(spec.num_layers):
        params = dict(hf.meta_layer(index).named_parameters())
        for local, name in _exported(hf, index, hf.hf_names(index)).items():
            weight_map[name] = shard_name(index, spec.num_layers)
            total += params[local].numel() * element
    index_document = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    config = _config(hf, dtype)
    _atomic(out / "config.json", lambda target: target.write_text(json.dumps(config, indent=2) + "\n"))
    _atomic(
        out / WEIGHTS_INDEX, lambda target: target.write_text(json.dumps(index_document, indent=2) + "\n")
    )
    if hf.directory is not None:
        _copy_present(hf.directory, out, METADATA_FILES)
    if tokenizer is not None and not (out / "tokenizer.json").is_file():
        tokenizer_files = [name for name in METADATA_FILES if name != "generation_config.json"]
        _copy_present(tokenizer_file(tokenizer).parent, out, tokenizer_files)


def _copy_present(directory: Path, out: Path, names: Iterable[str]) -> None:
    """Copy each of `names` that `directory` holds into `out`."""
    for name in names:
        source = directory / name
        if source.is_file():
            _atomic(out / name, _copy_from(source))


def write_model(
    spec: ModelSpec, layers: Mapping[int, nn.Module], out_dir: str | Path, dtype: torch.dtype = torch.float32
) -> None:
    """Every layer and the metadata from one process (a single worker, a test, a converted checkpoint)."""
    missing = sorted(set(range(spec.num_layers)) - set(layers))
    if missing:
        raise ValueError(f"layers: export of {spec.name} needs every layer, missing {missing}")
    for index in range(spec.num_layers):
        write_layer(spec, index, layers[index], out_dir, dtype)
    write_metadata(spec, out_dir, dtype)


def write_from_checkpoint(
    spec: ModelSpec,
    checkpoint_dir: str | Path,
    step: int | None,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    tokenizer: Path | None = None,
) -> int:
    """Write the model of checkpoint `step` (None: the newest complete one) of a job's checkpoint directory
    in Hugging Face layout: the trained model of a job that ended without writing it (it failed, or had no
    `spec.output`), or of any step it kept. Reads the weights only, not the optimizer state; a layer saved
    in tensor-parallel shards is merged. Every layer is checked against `spec` before a file is written.
    `tokenizer`: the job's `spec.data.tokenizer`, written with the model as the job's own export does.
    Returns the step written; ValueError naming what is wrong (no complete step, a step not there, a
    checkpoint of another model)."""
    from .checkpoint import Checkpointer, check_weights, read_weights, saved_shards

    hf = _hf(spec)
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise ValueError(f"checkpoint: {directory} is not a directory")
    shards = saved_shards(directory)
    complete = Checkpointer(directory, interval=0, asynchronous=False, shards=shards).complete_steps(
        spec.num_layers
    )
    if step is None:
        if not complete:
            raise ValueError(
                f"checkpoint: {directory} holds no complete checkpoint of the {spec.num_layers} layers of "
                f"{spec.name}"
            )
        step = complete[-1]
    elif step not in complete:
        found = ", ".join(map(str, complete)) or "none"
        raise ValueError(f"step: {directory} has no complete checkpoint of step {step} (complete: {found})")
    if tokenizer is not None and not tokenizer_file(tokenizer).is_file():
        raise ValueError(f"tokenizer: {tokenizer} holds no tokenizer.json")
    for index in range(spec.num_layers):
        check_weights(directory, step, index, hf.meta_layer(index), shards)
    out = Path(out_dir)
    for index in range(spec.num_layers):
        module = spec.allocate(index)
        read_weights(directory, step, index, module, shards)
        write_layer(spec, index, module, out, dtype)
    write_metadata(spec, out, dtype, tokenizer=tokenizer)
    return step
