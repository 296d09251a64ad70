"""Models from a local Hugging Face directory (`hf:<dir>`), tied embeddings, export, built-in profile names.

Tiny GPT-2, Llama, Qwen2 and Mistral models are made with `transformers` here and `save_pretrained` to a
temporary directory (one file, or sharded with a small `max_shard_size`); nothing is downloaded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from resilientjob.agent.hf_export import write_layer, write_metadata, write_model
from resilientjob.agent.models import ModelSpec, lm_loss, load_model
from resilientjob.cli import main as rjob
from resilientjob.planner.profile import ModelProfile

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

VOCAB, SEQ = 40, 12
SMALL = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # GPT-2 ties its LM head to the token embedding; special token ids must lie inside the tiny vocabulary.
    "gpt2": (
        "GPT2LMHeadModel",
        {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 16, "bos_token_id": 0, "eos_token_id": 0},
    ),
    "llama": ("LlamaForCausalLM", {**SMALL, "num_key_value_heads": 2, "max_position_embeddings": 16}),
    # Qwen2: q/k/v biases and a tied head.
    "qwen2": (
        "Qwen2ForCausalLM",
        {**SMALL, "num_key_value_heads": 2, "max_position_embeddings": 16, "tie_word_embeddings": True},
    ),
    # Mistral: a sliding window shorter than the sequence, so the explicit window mask is exercised.
    "mistral": (
        "MistralForCausalLM",
        {
            **SMALL,
            "num_key_value_heads": 2,
            "max_position_embeddings": 16,
            "head_dim": 8,
            "sliding_window": 5,
        },
    ),
}


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    yield
    transformers.logging.set_verbosity(verbosity)
    transformers.utils.logging.enable_progress_bar()


def _reference(family: str, seed: int = 0) -> Any:
    """A tiny `transformers` model of the family, randomly initialised (biases too, so loading is tested)."""
    class_name, keys = CONFIGS[family]
    cls = getattr(transformers, class_name)
    config = cls.config_class(vocab_size=VOCAB, **keys)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                param.add_(torch.randn_like(param) * 0.1)  # not the constructors' 0 / 1
    return model


def _save(model: Any, directory: Path, sharded: bool) -> Path:
    model.save_pretrained(directory, max_shard_size="8KB" if sharded else "1GB")
    files = {path.name for path in directory.iterdir()}
    assert ("model.safetensors.index.json" in files) == sharded, files
    return directory


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(seed))


def _run(layers: list[torch.nn.Module], tokens: torch.Tensor) -> torch.Tensor:
    x = tokens
    for layer in layers:
        x = layer(x)
    return x


def _layers(spec: ModelSpec) -> list[torch.nn.Module]:
    return [spec.layer(index) for index in range(spec.num_layers)]


CASES = [
    ("gpt2", False),
    ("gpt2", True),
    ("llama", False),
    ("llama", True),
    ("qwen2", False),
    ("mistral", True),
]


@pytest.mark.parametrize(
    ("family", "sharded"), CASES, ids=[f"{f}-{'sharded' if s else 'single'}" for f, s in CASES]
)
def test_directory_layers_compute_the_transformers_model(family: str, sharded: bool, tmp_path: Path) -> None:
    reference = _reference(family)
    directory = _save(reference, tmp_path / family, sharded)
    spec = load_model(f"hf:{directory}", seq_len=SEQ)
    assert spec.num_layers == 4 and spec.vocab == VOCAB and spec.hidden_shape(3) == (3, SEQ, 32)
    layers = _layers(spec)
    tokens = _tokens()
    with torch.no_grad():
        logits = _run(layers, tokens)
        want = reference(tokens)
        torch.testing.assert_close(logits, want.logits, rtol=1e-5, atol=1e-5)
        # HF shifts the labels inside; the runtime gets inputs and next-token targets explicitly.
        hf_loss = reference(tokens, labels=tokens).loss
        ours = lm_loss(_run(layers, tokens[:, :-1]), tokens[:, 1:]) / tokens.shape[0]
    assert ours.item() == pytest.approx(hf_loss.item(), abs=1e-5)


def test_relative_path_and_both_naming_conventions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2 as first published has no `transformer.` prefix (saved from the base model) and no lm_head."""
    reference = _reference("gpt2")
    reference.transformer.save_pretrained(tmp_path / "bare")
    with safetensors.safe_open(str(tmp_path / "bare" / "model.safetensors"), "pt") as reader:
        assert "wte.weight" in set(reader.keys()) and "lm_head.weight" not in set(reader.keys())
    monkeypatch.chdir(tmp_path)
    spec = load_model("hf:./bare", seq_len=SEQ)
    assert spec.hf_names(1)["block.attn.c_attn.weight"] == "h.0.attn.c_attn.weight"
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(
            _run(_layers(spec), tokens), reference(tokens).logits, rtol=1e-5, atol=1e-5
        )
    write_model(spec, dict(enumerate(_layers(spec))), tmp_path / "out")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert "h.0.attn.c_attn.weight" in index["weight_map"]  # the input's names come back


class _Recorder:
    """Wraps safetensors.safe_open: records every tensor read (get_tensor) per file."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.read: list[str] = []
        self.opened = 0

    def __call__(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self.opened += 1
        recorder, handle = self, self.real(path, *args, **kwargs)

        class Reader:
            def __enter__(self) -> Reader:
                handle.__enter__()
                return self

            def __exit__(self, *exc: object) -> None:
                handle.__exit__(*exc)

            def keys(self) -> Any:
                return handle.keys()

            def get_slice(self, name: str) -> Any:
                return handle.get_slice(name)

            def get_tensor(self, name: str) -> torch.Tensor:
                recorder.read.append(name)
                tensor: torch.Tensor = handle.get_tensor(name)
                return tensor

        return Reader()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_layer_reads_only_its_own_tensors(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = _save(_reference(family), tmp_path / family, sharded=True)
    spec = load_model(f"hf:{directory}", seq_len=SEQ)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    recorder = _Recorder(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", recorder)
    seen: list[str] = []
    last = spec.num_layers - 1
    for layer in range(spec.num_layers):
        recorder.read.clear()
        spec.layer(layer)
        names = set(spec.hf_names(layer).values())
        if spec.tied is not None and layer == last:
            names = (names - {"lm_head.weight"}) | {spec.hf_names(0)[spec.tied[0][1]]}
        assert sorted(recorder.read) == sorted(names), layer
        seen += recorder.read
    # Every tensor of the checkpoint is read by exactly one layer (the tied embedding by two).
    assert sorted(set(seen)) == sorted(index["weight_map"])
    assert len(seen) == len(index["weight_map"]) + (spec.tied is not None)
    # A layer that will be overwritten peer-to-peer is allocated without touching the disk.
    recorder.opened = 0
    for layer in range(spec.num_layers):
        spec.allocate(layer)
    assert recorder.opened == 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_allocated_layers_recompute_the_rotary_buffers(family: str, tmp_path: Path) -> None:
    """Meta init + to_empty leaves non-persistent buffers uninitialised; the rotary ones must be right."""
    directory = _save(_reference(family), tmp_path / family, sharded=False)
    spec = load_model(f"hf:{directory}", seq_len=SEQ)
    loaded, empty = spec.layer(1), spec.allocate(1)
    assert spec.hf is not None
    fresh = getattr(transformers, f"{CONFIGS[family][0].removesuffix('ForCausalLM')}Model")(spec.hf.config)
    for module in (loaded, empty):
        assert torch.equal(module.get_buffer("rotary.inv_freq"), fresh.rotary_emb.inv_freq)
    assert [n for n, _ in empty.named_parameters()] == [n for n, _ in loaded.named_parameters()]
    # An allocated layer overwritten with the loaded one's parameters computes the same.
    with torch.no_grad():
        for target, source in zip(empty.parameters(), loaded.parameters(), strict=True):
            target.copy_(source)
        hidden = torch.randn(2, SEQ, 32)
        torch.testing.assert_close(empty(hidden), loaded(hidden), rtol=0, atol=0)


def test_tied_copies_start_equal(tmp_path: Path) -> None:
    reference = _reference("gpt2")
    spec = load_model(f"hf:{_save(reference, tmp_path / 'g', sharded=False)}", seq_len=SEQ)
    assert spec.tied == ((0, "wte.weight"), (3, "proj.weight"))
    embedding, head = spec.layer(0), spec.layer(3)
    assert torch.equal(embedding.get_parameter("wte.weight"), head.get_parameter("proj.weight"))
    assert embedding.get_parameter("wte.weight").data_ptr() != head.get_parameter("proj.weight").data_ptr()
    assert torch.equal(head.get_parameter("proj.weight"), reference.lm_head.weight)
    # Random-init configurations follow tie_word_embeddings (GPT-2's default: tied) and copy the embedding.
    gpt2 = load_model("hf:gpt2?n_layer=1&n_embd=16&n_head=2&vocab_size=24&n_positions=8", seq_len=8)
    assert gpt2.tied == ((0, "wte.weight"), (2, "proj.weight"))
    assert torch.equal(gpt2.layer(0).get_parameter("wte.weight"), gpt2.layer(2).get_parameter("proj.weight"))
    llama = load_model(
        "hf:llama?num_hidden_layers=1&hidden_size=16&intermediate_size=32&num_attention_heads=2"
    )
    assert llama.tied is None
    tied = load_model(
        "hf:llama?num_hidden_layers=1&hidden_size=16&intermediate_size=32&num_attention_heads=2"
        "&vocab_size=24&tie_word_embeddings=true"
    )
    assert tied.tied == ((0, "embed_tokens.weight"), (2, "proj.weight"))
    head = tied.layer(2).get_parameter("proj.weight")
    assert torch.equal(tied.layer(0).get_parameter("embed_tokens.weight"), head)


@pytest.mark.parametrize(("family", "sharded"), [("gpt2", True), ("llama", False), ("qwen2", True)])
def test_export_loads_in_transformers_with_the_same_logits(
    family: str, sharded: bool, tmp_path: Path
) -> None:
    reference = _reference(family)
    source = _save(reference, tmp_path / "in", sharded)
    (source / "tokenizer_config.json").write_text('{"model_max_length": 16}')
    spec = load_model(f"hf:{source}", seq_len=SEQ)
    layers = _layers(spec)
    out = tmp_path / "out"
    for index in reversed(range(spec.num_layers)):  # any order, any writer
        write_layer(spec, index, layers[index], out)
    write_metadata(spec, out)
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 16}'
    assert (out / "generation_config.json").is_file()
    assert not [path for path in out.iterdir() if path.name.endswith(".tmp")]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    with_names = {name for name, _ in reference.state_dict().items()}
    if spec.tied is not None:
        with_names.discard("lm_head.weight")
    assert set(index["weight_map"]) == with_names  # the input's tensor names, the tied head not written
    assert index["metadata"]["total_size"] == sum(
        t.nbytes for n, t in reference.state_dict().items() if n in with_names
    )
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, reference(tokens).logits, rtol=1e-5, atol=1e-5)
    if spec.tied is not None:
        assert loaded.lm_head.weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()


def test_export_round_trips_a_modification(tmp_path: Path) -> None:
    source = _save(_reference("llama"), tmp_path / "in", sharded=True)
    spec = load_model(f"hf:{source}", seq_len=SEQ)
    layers = _layers(spec)
    with torch.no_grad():
        layers[2].get_parameter("block.mlp.up_proj.weight").add_(0.25)
        layers[3].get_parameter("proj.weight").mul_(-1.0)
    write_model(spec, dict(enumerate(layers)), tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    state = loaded.state_dict()
    assert torch.equal(
        state["model.layers.1.mlp.up_proj.weight"], layers[2].get_parameter("block.mlp.up_proj.weight")
    )
    assert torch.equal(state["lm_head.weight"], layers[3].get_parameter("proj.weight"))
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, _run(layers, tokens), rtol=1e-5, atol=1e-5)
    # The export is itself a directory the runtime loads, layer for layer.
    again = load_model(f"hf:{tmp_path / 'out'}", seq_len=SEQ)
    for index, layer in enumerate(layers):
        for got, want in zip(again.layer(index).parameters(), layer.parameters(), strict=True):
            assert torch.equal(got, want), index


def test_export_is_readable_by_others_and_brings_the_datas_tokenizer(tmp_path: Path) -> None:
    """Whoever serves the trained model reads it as another user (the pods run as uid 10001): files 0644,
    not safetensors' 0600. A model directory without a tokenizer gets the one the data was tokenized with
    (`spec.data.tokenizer`); one with its own keeps its own."""
    import os
    import stat

    source = _save(_reference("llama"), tmp_path / "in", sharded=False)
    spec = load_model(f"hf:{source}", seq_len=SEQ)
    data_tokenizer = tmp_path / "tok"
    data_tokenizer.mkdir()
    (data_tokenizer / "tokenizer.json").write_text('{"data": true}')
    (data_tokenizer / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "out"
    write_model(spec, dict(enumerate(_layers(spec))), out)
    write_metadata(spec, out, tokenizer=data_tokenizer / "tokenizer.json")  # the file, or its directory
    assert json.loads((out / "tokenizer.json").read_text()) == {"data": True}
    assert (out / "tokenizer_config.json").is_file()
    modes = {path.name: stat.S_IMODE(os.stat(path).st_mode) for path in out.iterdir()}
    assert all(mode & 0o044 == 0o044 for mode in modes.values()), modes
    # The model's own tokenizer wins.
    (source / "tokenizer.json").write_text('{"model": true}')
    write_metadata(load_model(f"hf:{source}", seq_len=SEQ), tmp_path / "own", tokenizer=data_tokenizer)
    assert json.loads((tmp_path / "own" / "tokenizer.json").read_text()) == {"model": True}


def test_export_over_a_saved_model_replaces_its_weights(tmp_path: Path) -> None:
    """A directory that held a `save_pretrained` model (its single model.safetensors wins over a sharded
    index in `from_pretrained`) loads the exported weights, not the old ones."""
    source = _save(_reference("llama"), tmp_path / "in", sharded=False)
    spec = load_model(f"hf:{source}", seq_len=SEQ)
    layers = _layers(spec)
    with torch.no_grad():
        layers[2].get_parameter("block.mlp.up_proj.weight").add_(0.25)
    out = _save(_reference("llama"), tmp_path / "out", sharded=False)  # the old model, where the new goes
    (out / "pytorch_model.bin").write_bytes(b"not a model")
    write_model(spec, dict(enumerate(layers)), out)
    assert not (out / "model.safetensors").exists() and not (out / "pytorch_model.bin").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(
        loaded.state_dict()["model.layers.1.mlp.up_proj.weight"],
        layers[2].get_parameter("block.mlp.up_proj.weight"),
    )


@pytest.mark.parametrize(
    "spec_text",
    [
        "hf:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=40&n_positions=16",
        "hf:mistral?num_hidden_layers=2&hidden_size=32&intermediate_size=64&num_attention_heads=4"
        "&num_key_value_heads=2&vocab_size=40&max_position_embeddings=16&tie_word_embeddings=true",
    ],
    ids=["gpt2", "mistral-tied"],
)
def test_export_of_a_configuration_uses_the_save_pretrained_names(spec_text: str, tmp_path: Path) -> None:
    spec = load_model(spec_text, seq_len=SEQ)
    layers = _layers(spec)
    write_model(spec, dict(enumerate(layers)), tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert spec.hf is not None
    fresh = type(loaded)(spec.hf.config)
    fresh.save_pretrained(tmp_path / "fresh")
    want = (
        json.loads((tmp_path / "fresh" / "model.safetensors.index.json").read_text())["weight_map"]
        if (tmp_path / "fresh" / "model.safetensors.index.json").exists()
        else _keys(tmp_path / "fresh" / "model.safetensors")
    )
    got = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(got) == set(want)
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, _run(layers, tokens), rtol=1e-5, atol=1e-5)


def _keys(path: Path) -> set[str]:
    with safetensors.safe_open(str(path), "pt") as reader:
        return set(reader.keys())


def test_export_refuses_a_module_of_another_shape(tmp_path: Path) -> None:
    spec = load_model("hf:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=40&n_positions=16", seq_len=SEQ)
    with pytest.raises(ValueError, match="module: layer 1"):
        write_layer(spec, 1, spec.layer(3), tmp_path)
    with pytest.raises(ValueError, match="not a Hugging Face model"):
        write_metadata(load_model("gpt", layers=3), tmp_path)


def test_directory_errors_name_the_model_and_the_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^model: .*nowhere is not a directory"):
        load_model(f"hf:{tmp_path / 'nowhere'}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^model: .*empty/config.json not found"):
        load_model(f"hf:{tmp_path / 'empty'}")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text('{"model_type": "bert"}')
    message = f"model: {bert}/config.json model_type 'bert' is not supported (gpt2, llama, qwen2, mistral)"
    with pytest.raises(ValueError) as caught:
        load_model(f"hf:{bert}")
    assert str(caught.value) == message
    reference = _reference("llama")
    directory = tmp_path / "llama"
    reference.config.save_pretrained(directory)
    with pytest.raises(
        ValueError, match=r"^model: no model.safetensors or model.safetensors.index.json in .*llama$"
    ):
        load_model(f"hf:{directory}")
    # A tensor missing, and one of the wrong shape: the error names the tensor and the file.
    state = {name: t.contiguous() for name, t in reference.state_dict().items()}
    del state["model.layers.1.mlp.up_proj.weight"]
    safetensors.torch.save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    spec = load_model(f"hf:{directory}")
    spec.layer(1)  # other layers load
    with pytest.raises(
        ValueError,
        match=r"tensor 'model.layers.1.mlp.up_proj.weight' of layer 2 not found in .*model.safetensors",
    ):
        spec.layer(2)
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    safetensors.torch.save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"'model.layers.1.mlp.up_proj.weight' in .*model.safetensors has shape \[3, 3\]"
    ):
        load_model(f"hf:{directory}").layer(2)
    with pytest.raises(ValueError, match="hf family"):
        load_model("hf:llama2?x=1")


def test_profile_names_build_the_real_architecture_lazily() -> None:
    spec = load_model("llama2-7b")
    assert spec.hf is not None
    config = spec.hf.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (4096, 32, 32)
    assert (config.intermediate_size, config.vocab_size, spec.seq_len) == (11008, 32000, 4096)
    assert spec.num_layers == ModelProfile.load("llama2-7b").num_layers == 34 and spec.tied is None
    with torch.device("meta"):
        block = spec.layer(1)
    assert sum(p.numel() for p in block.parameters()) == 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    assert all(p.is_meta for p in block.parameters())
    for name, hidden in (("gpt3-2.7b", 2560), ("gpt3-6.7b", 4096)):
        gpt = load_model(name, seq_len=64)
        assert gpt.num_layers == ModelProfile.load(name).num_layers and gpt.hidden_shape(1) == (1, 64, hidden)
        assert gpt.tied == ((0, "wte.weight"), (gpt.num_layers - 1, "proj.weight"))
    with pytest.raises(ValueError, match=r"bert-large is an encoder profile .* synthetic:bert-large"):
        load_model("bert-large")
    with pytest.raises(ValueError, match=r"seq_len: 4096 exceeds the 2048 positions of gpt3-2\.7b"):
        load_model("gpt3-2.7b", seq_len=4096)


def test_rjob_profile_of_a_directory_computed_and_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _save(_reference("qwen2"), tmp_path / "q", sharded=False)
    spec = load_model(f"hf:{directory}", seq_len=8)
    measured, computed = tmp_path / "measured.json", tmp_path / "computed.json"
    assert (
        rjob(["profile", f"hf:{directory}", "--seq-len", "8", "--repeats", "1", "--out", str(measured)]) == 0
    )
    assert rjob(["profile", f"hf:{directory}", "--seq-len", "8", "--computed", "--out", str(computed)]) == 0
    assert "wrote" in capsys.readouterr().out
    profiles = [ModelProfile.load(measured), ModelProfile.load(computed)]
    for profile in profiles:
        assert profile.num_layers == spec.num_layers
    # Bytes agree exactly between the measurement (what the runtime sends) and the formulas.
    assert [a.state_bytes for a in profiles[0].layers] == [b.state_bytes for b in profiles[1].layers]
    # On cpu it is priced at this CPU's own speed, as node 0 prices it: an accelerator's nominal 150 TFLOP/s
    # priced a CPU job's steps about a thousand times too cheap.
    nominal = tmp_path / "nominal.json"
    argv = ["profile", f"hf:{directory}", "--seq-len", "8", "--computed", "--out", str(nominal)]
    assert rjob([*argv, "--device-flops", "150e12"]) == 0
    own, at_nominal = (sum(ModelProfile.load(p).stage_times(0, spec.num_layers)) for p in (computed, nominal))
    assert own > 10 * at_nominal, (own, at_nominal)
    assert rjob(["profile", f"hf:{tmp_path / 'missing'}", "--computed"]) == 2
