"""The profile of a Hugging Face causal LM computed from its config (planner/hf_profile.py): bytes exact
against tiny `transformers` models and the runtime's own layers, FLOP times and bytes against the built-in
llama2-7b profile, activation estimates against what autograd really saves."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from resilientjob.planner.errors import PlannerError
from resilientjob.planner.hf_profile import NOMINAL_FLOPS, profile_from_hf_config
from resilientjob.planner.profile import ModelProfile

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4}
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_inner": 176, "n_positions": 48, "vocab_size": 100},
    "llama": {**SMALL, "num_key_value_heads": 2, "vocab_size": 100, "attention_bias": True, "mlp_bias": True},
    "qwen2": {**SMALL, "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": True},
    "mistral": {**SMALL, "num_key_value_heads": 2, "vocab_size": 100, "head_dim": 24},
}
CLASSES = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig"}


def _config(family: str) -> dict[str, Any]:
    """The config.json `save_pretrained` would write for the tiny model of the family."""
    transformers = pytest.importorskip("transformers")
    config: dict[str, Any] = getattr(transformers, CLASSES[family])(**CONFIGS[family]).to_dict()
    return config


def _spec_text(family: str) -> str:
    return f"hf:{family}?" + "&".join(f"{k}={str(v).lower()}" for k, v in CONFIGS[family].items())


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_bytes_are_exact_for_tiny_transformers_models(family: str) -> None:
    transformers = pytest.importorskip("transformers")
    from resilientjob.agent.models import load_model
    from resilientjob.agent.p2p import layer_state_bytes

    config = _config(family)
    profile = profile_from_hf_config(config, seq_len=16, microbatch_size=2, device_flops=1e12)
    spec = load_model(_spec_text(family), seq_len=16)
    assert profile.num_layers == spec.num_layers == 4
    for index, layer in enumerate(profile.layers):
        # Exactly what the runtime stores and sends for the layer (AdamW state included).
        assert (layer.param_bytes, layer.optimizer_bytes) == layer_state_bytes(spec.layer(index)), index
    # The transformers model's own parameters: blocks, and embedding + head (the tied head counted twice).
    model = getattr(
        transformers,
        f"{CLASSES[family].removesuffix('Config')}ForCausalLM" if family != "gpt2" else "GPT2LMHeadModel",
    )(getattr(transformers, CLASSES[family])(**CONFIGS[family]))
    blocks = "transformer.h." if family == "gpt2" else "model.layers."
    for block in range(2):
        count = sum(p.numel() for n, p in model.named_parameters() if n.startswith(f"{blocks}{block}."))
        assert profile.layers[1 + block].param_bytes == 4 * count
    total = sum(p.numel() for p in model.parameters())
    tied = config.get("tie_word_embeddings", family == "gpt2")
    extra = config["vocab_size"] * (config.get("n_embd") or config["hidden_size"]) if tied else 0
    assert sum(layer.param_bytes for layer in profile.layers) == 4 * (total + extra)


def test_llama2_7b_matches_the_builtin_profile() -> None:
    """Same FLOP formulas as scripts/gen_profiles.py; the built-in counts bf16 bytes and omits the norms."""
    transformers = pytest.importorskip("transformers")
    from resilientjob.agent._hf_models import PROFILE_MODELS

    config = transformers.LlamaConfig(**PROFILE_MODELS["llama2-7b"][1]).to_dict()
    computed = profile_from_hf_config(config, seq_len=4096, microbatch_size=1, device_flops=NOMINAL_FLOPS)
    builtin = ModelProfile.load("llama2-7b")
    assert computed.num_layers == builtin.num_layers == 34
    hidden = 4096
    norms = [0] + [2 * hidden] * 32 + [hidden]
    for ours, theirs, norm in zip(computed.layers, builtin.layers, norms, strict=True):
        assert ours.param_bytes // 4 - norm == theirs.param_bytes // 2, ours.name
        assert ours.forward_s == pytest.approx(theirs.forward_s, abs=1e-9)
        assert ours.backward_s == pytest.approx(theirs.backward_s, abs=2e-9)
    assert sum(layer.param_bytes for layer in computed.layers) // 4 == 6_738_415_616  # Llama-2-7B's count


def test_gen_profiles_script_reproduces_the_shipped_profiles() -> None:
    """The script uses these FLOP formulas and its numbers are those shipped in planner/profiles."""
    loader = importlib.util.spec_from_file_location("gen_profiles", ROOT / "scripts" / "gen_profiles.py")
    assert loader is not None and loader.loader is not None
    script = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(script)
    for name, shape in script.MODELS.items():
        shipped = json.loads((ROOT / "planner" / "profiles" / f"{name}.json").read_text())
        assert script.profile(name, *shape)["layers"] == shipped["layers"], name


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_activation_estimate_is_close_to_what_autograd_saves(family: str) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from resilientjob.agent.models import lm_loss, load_model

    seq, micro = 32, 2
    spec = load_model(_spec_text(family), seq_len=seq)
    profile = profile_from_hf_config(_config(family), seq_len=seq, microbatch_size=micro, device_flops=1e12)
    tokens = torch.randint(100, (micro, seq))
    x = tokens
    for index, estimate in enumerate(profile.layers):
        layer = spec.layer(index)
        x = x.detach().requires_grad_() if x.is_floating_point() else x
        stored = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes()}  # the layer's input
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}

        def pack(tensor: Any, stored: dict[int, int] = stored, params: set[int] = params) -> Any:
            if tensor.untyped_storage().data_ptr() not in params:
                stored[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = layer(x)
            if index == spec.num_layers - 1:
                lm_loss(out, tokens)
        measured = sum(stored.values())
        assert estimate.activation_bytes == pytest.approx(measured, rel=0.1), (index, measured)
        assert estimate.output_bytes == (out.numel() * 4 if index < spec.num_layers - 1 else 0)
        x = out


def test_times_follow_flops_and_bad_configs_name_the_field() -> None:
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}
    config |= {"intermediate_size": 128, "vocab_size": 50, "max_position_embeddings": 64}
    one = profile_from_hf_config(config, seq_len=32, microbatch_size=1, device_flops=1e9)
    two = profile_from_hf_config(config, seq_len=32, microbatch_size=2, device_flops=2e9)
    matmul = 4 * 64 * 64 + 3 * 64 * 128
    assert one.layers[1].forward_s == pytest.approx((2 * matmul * 32 + 4 * 32 * 32 * 64) / 1e9)
    for a, b in zip(one.layers, two.layers, strict=True):  # twice the work on a twice as fast device
        assert b.forward_s == pytest.approx(a.forward_s) and b.backward_s == pytest.approx(2 * b.forward_s)
        assert b.param_bytes == a.param_bytes and b.output_bytes == 2 * a.output_bytes
    with pytest.raises(PlannerError, match=r"config\.model_type: 'bert' is not supported"):
        profile_from_hf_config({**config, "model_type": "bert"}, seq_len=8)
    with pytest.raises(PlannerError, match=r"config\.intermediate_size: missing"):
        profile_from_hf_config({k: v for k, v in config.items() if k != "intermediate_size"}, seq_len=8)
    with pytest.raises(PlannerError, match="seq_len"):
        profile_from_hf_config(config, seq_len=0)
