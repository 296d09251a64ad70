"""The user's own model and data through the runtime: a Hugging Face directory (`hf:<dir>`, made here with
`save_pretrained`) and a token file, trained with AdamW + weight decay, warm-up and cosine schedule and
global-norm clipping, on 1 worker and on DP2 x PP2, against a plain single-process PyTorch run of the
`transformers` model itself (one tensor for the tied embedding, `clip_grad_norm_`, `LambdaLR`).

The reference shares nothing with the runtime but the initial weights, the token file and the sample
order, so it checks the runtime's gradient sums, tied-embedding sync, norm, schedule and decay groups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _training_support import (
    BATCH,
    MICRO,
    MODELS,
    SEQ,
    STEPS,
    VOCAB,
    hf_job_config,
    plain_pytorch,
    tiny_plan,
    token_file,
    transformers,
)

from resilientjob.agent.profiler import measure_profile
from resilientjob.testing.launcher import Launcher
from resilientjob.testing.plans import RuntimePlanner


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize(("dp", "pp"), [(1, 1), (2, 2)])
def test_hf_directory_trains_like_plain_pytorch(tmp_path: Path, family: str, dp: int, pp: int) -> None:
    model_dir = MODELS[family](tmp_path / family)
    tokens = token_file(tmp_path / "tokens.bin")
    output = tmp_path / "trained"
    config = hf_job_config(model_dir, tokens, output=output)
    expected, trained = plain_pytorch(model_dir, tokens, STEPS)
    plan = tiny_plan(dp, pp)
    profile = measure_profile(config.load_model(), timed=False)
    planner = RuntimePlanner.for_job(
        profile, nodes=dp * pp, global_batch=BATCH, microbatch_size=MICRO, fault_tolerance=0
    )
    result = Launcher(config, plan, planner, tmp_path / "run").run(timeout_s=240)
    assert sorted(result.losses) == list(range(STEPS))
    # The first step is the model's own loss on the same batch; the rest follow the same optimizer path.
    assert result.losses[0] == pytest.approx(expected[0], abs=1e-5)
    for step in range(STEPS):
        assert result.losses[step] == pytest.approx(expected[step], abs=1e-4), step
    assert expected[-1] < expected[0]  # it learns, so equal curves mean something
    # The trained model comes out in Hugging Face layout, under the input's tensor names, and computes
    # what the plain run's trained model computes.
    exported = transformers.AutoModelForCausalLM.from_pretrained(output).eval()
    names = set(json.loads((output / "model.safetensors.index.json").read_text())["weight_map"])
    original = (model_dir / "model.safetensors").exists()
    assert original and names <= set(safe_open_names(model_dir / "model.safetensors"))
    tokens_in = torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens_in).logits, trained(tokens_in).logits, atol=2e-4, rtol=0)


def safe_open_names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return list(handle.keys())
