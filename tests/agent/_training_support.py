"""A tiny Hugging Face model directory, a token file and a plain single-process PyTorch run of the same job:
what the runtime's training tests compare the runtime against (tests/agent/test_runtime_training.py and
tests/agent/test_pod_training.py). The plain run shares nothing with the runtime but the initial weights, the
token file and the sample order: one `transformers` model (one tensor for a tied embedding), one AdamW,
`clip_grad_norm_` and a `LambdaLR`."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from resilientjob.agent.data import SampleOrder
from resilientjob.agent.worker import JobConfig
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan
from resilientjob.protocol.workload import DataSpec, OutputSpec, Schedule, TokenDtype, TrainingSpec, Workload

transformers = pytest.importorskip("transformers")

SEQ, VOCAB, STEPS, BATCH, MICRO = 8, 48, 5, 8, 2
TRAINING = TrainingSpec(
    steps=STEPS,
    lr=2e-2,
    betas=(0.9, 0.95),
    weight_decay=0.1,
    warmup_steps=2,
    schedule=Schedule.COSINE,
    min_lr=2e-3,
    grad_clip_norm=0.5,  # small enough that every step clips: the norm must be the whole model's
)


def gpt2_directory(directory: Path, layers: int = 2) -> Path:
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(1)
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


def llama_directory(directory: Path) -> Path:
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(2)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


MODELS = {"gpt2": gpt2_directory, "llama": llama_directory}


def token_file(path: Path) -> Path:
    rng = np.random.default_rng(0)
    # Learnable: a noisy cycle through the vocabulary, so the loss falls within a few steps.
    stream = (np.arange(40 * SEQ + 1) * 7 + (rng.random(40 * SEQ + 1) < 0.1) * 3) % VOCAB
    stream.astype(np.uint16).tofile(path)
    return path


def hf_job_config(model_dir: Path, tokens: Path, steps: int = STEPS, output: Path | None = None) -> JobConfig:
    workload = Workload(
        model=f"hf:{model_dir}",
        data=DataSpec(path=str(tokens), dtype=TokenDtype.UINT16, seq_len=SEQ, seed=3),
        training=TRAINING.model_copy(update={"steps": steps}),
        output=OutputSpec(path=str(output)) if output else None,
    )
    return JobConfig(workload=workload, collective_timeout_s=5.0)


def plain_pytorch(model_dir: Path, tokens: Path, steps: int) -> tuple[list[float], torch.nn.Module]:
    """The same job as one `transformers` model, one AdamW, `clip_grad_norm_` and a LambdaLR: the losses
    and the trained model."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    flat = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": TRAINING.weight_decay}, {"params": flat, "weight_decay": 0.0}],
        lr=TRAINING.lr,
        betas=TRAINING.betas,
        eps=TRAINING.eps,
    )

    def factor(step: int) -> float:
        if step < TRAINING.warmup_steps:
            return (step + 1) / TRAINING.warmup_steps
        progress = (step - TRAINING.warmup_steps) / max(1, steps - TRAINING.warmup_steps - 1)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return (TRAINING.min_lr + (TRAINING.lr - TRAINING.min_lr) * cosine) / TRAINING.lr

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    data = np.fromfile(tokens, dtype=np.uint16).astype(np.int64)
    order = SampleOrder((len(data) - 1) // SEQ, BATCH, seed=3)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        ids = order.step_ids(step)
        batch = torch.from_numpy(np.stack([data[i * SEQ : (i + 1) * SEQ + 1] for i in ids]))
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.transpose(1, 2), batch[:, 1:])  # mean over samples and tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAINING.grad_clip_norm)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
    return losses, model.eval()


def tiny_plan(dp: int, pp: int) -> Plan:
    """The tiny model's four layers (embedding, two blocks, head) on dp pipelines of pp stages (1 or 2),
    nodes numbered pipeline by pipeline."""
    bounds = [(0, 2), (2, 4)] if pp == 2 else [(0, 4)]
    pipelines = tuple(
        PipelinePlan(
            stages=tuple(StagePlan(layers=b, node=p * pp + s) for s, b in enumerate(bounds)),
            microbatches=BATCH // MICRO // dp,
        )
        for p in range(dp)
    )
    return Plan(policy=Policy.DYNAMIC, microbatch_size=MICRO, step_time_s=1.0, pipelines=pipelines)
