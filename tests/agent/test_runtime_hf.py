"""The Hugging Face adapter (`hf:gpt2?...`, `hf:llama?...`): the layer list computes what the `transformers`
model of the same configuration computes (GPT-2's LM head tied, as in `transformers`), and trains in the
runtime on 2 gloo workers (PP2) exactly as the single-process reference does. Skipped when `transformers`
is not installed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from resilientjob.agent.models import ModelSpec, load_model
from resilientjob.agent.profiler import measure_profile
from resilientjob.agent.worker import JobConfig
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan
from resilientjob.testing.launcher import Launcher
from resilientjob.testing.plans import RuntimePlanner
from resilientjob.testing.reference import reference_run

transformers = pytest.importorskip("transformers")

GPT2 = "hf:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=32&n_positions=16"
LLAMA = (
    "hf:llama?num_hidden_layers=2&hidden_size=32&intermediate_size=64&num_attention_heads=4"
    "&num_key_value_heads=2&vocab_size=32&max_position_embeddings=16"
)


def _reference_model(model: ModelSpec) -> torch.nn.Module:
    """The `transformers` causal-LM class of the spec's configuration (LM head tied when the spec's is)."""
    assert model.hf is not None
    cls = transformers.GPT2LMHeadModel if model.hf.family == "gpt2" else transformers.LlamaForCausalLM
    reference: torch.nn.Module = cls(model.hf.config).eval()
    return reference


def _copy_layers_into(reference: torch.nn.Module, model: ModelSpec, layers: list[torch.nn.Module]) -> None:
    """Load the adapter's layer weights into the reference model by their `transformers` tensor names."""
    state = {
        name: layers[index].get_parameter(local).detach()
        for index in range(model.num_layers)
        for local, name in model.hf_names(index).items()
    }
    missing, unexpected = reference.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)


@pytest.mark.parametrize("spec", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_layer_list_computes_the_transformers_model(spec: str) -> None:
    model = load_model(spec, seq_len=12)
    assert model.num_layers == 4 and model.vocab == 32
    layers = [model.layer(index) for index in range(model.num_layers)]
    # Each layer is built from its own seed: rebuilding layer 2 alone gives the same weights.
    for got, want in zip(model.layer(2).parameters(), layers[2].parameters(), strict=True):
        assert torch.equal(got, want)
    assert model.tied == (((0, "wte.weight"), (3, "proj.weight")) if spec == GPT2 else None)
    reference = _reference_model(model)
    _copy_layers_into(reference, model, layers)
    tokens = torch.randint(32, (3, 12), generator=torch.Generator().manual_seed(1))
    x: torch.Tensor = tokens
    for layer in layers:
        x = layer(x)
    assert x.shape == (3, 12, 32)
    torch.testing.assert_close(x, reference(tokens).logits, rtol=1e-5, atol=1e-5)


def test_hf_spec_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="hf family"):
        load_model("hf:bert?hidden_size=8")
    with pytest.raises(ValueError, match="no configuration key 'n_lyer'"):
        load_model("hf:gpt2?n_lyer=2")
    with pytest.raises(ValueError, match="twice"):
        load_model("hf:gpt2?n_layer=2&n_layer=3")


@pytest.mark.torch
def test_gpt2_trains_on_two_gloo_workers_pp2_like_the_reference(tmp_path: Path) -> None:
    steps = 3
    config = JobConfig.plain(
        model=GPT2, model_options={"seq_len": 16}, num_samples=64, steps=steps, collective_timeout_s=5.0
    )
    plan = Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=2,
        step_time_s=1.0,
        pipelines=(
            PipelinePlan(
                stages=(StagePlan(layers=(0, 2), node=0), StagePlan(layers=(2, 4), node=1)), microbatches=4
            ),
        ),
    )
    reference, _, _ = reference_run(config, plan.global_batch, plan.microbatch_size)
    profile = measure_profile(load_model(GPT2, seq_len=16), timed=False)
    planner = RuntimePlanner.for_job(profile, nodes=2, global_batch=8, microbatch_size=2, fault_tolerance=0)
    result = Launcher(config, plan, planner, tmp_path).run(timeout_s=120)
    assert sorted(result.losses) == list(range(steps))
    for step in range(steps):
        assert result.losses[step] == pytest.approx(reference[step], abs=1e-5), step
    assert reference[-1] < reference[0]  # it learns
