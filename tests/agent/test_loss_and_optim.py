"""The language-model loss and the optimizer choice the runtime makes per device.

The loss reads logits as (tokens, vocab) rows, a layout change made for CUDA's speed (docs/benchmarks/gpu.md):
these tests pin that it still is each sample's mean token cross-entropy, summed over the micro-batch, with the
same value and gradient as the (batch, vocab, length) form it replaced. The fused AdamW path needs CUDA and is
measured by bench/bench_gpu.py; here the CPU keeps the unfused loop the reference runs reproduce."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch import nn

from resilientjob.agent.models import lm_loss
from resilientjob.agent.optim import fused_on, make_adamw
from resilientjob.agent.p2p import LayerState
from resilientjob.protocol.workload import TrainingSpec


def test_lm_loss_is_the_sum_of_each_samples_mean_token_cross_entropy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11)
    targets = torch.randint(0, 11, (3, 7))
    expected = sum(
        -torch.log_softmax(logits[b], dim=-1)[torch.arange(7), targets[b]].mean() for b in range(3)
    )
    assert torch.allclose(lm_loss(logits, targets), expected, atol=1e-6)


def test_lm_loss_matches_the_strided_form_in_value_and_gradient() -> None:
    torch.manual_seed(1)
    base = torch.randn(2, 5, 13, dtype=torch.float64)
    targets = torch.randint(0, 13, (2, 5))
    rows = base.clone().requires_grad_()
    strided = base.clone().requires_grad_()
    ours = lm_loss(rows, targets)
    before = F.cross_entropy(strided.transpose(1, 2), targets, reduction="none").mean(dim=1).sum()
    ours.backward()
    before.backward()
    assert torch.equal(ours.detach(), before.detach())
    assert rows.grad is not None and strided.grad is not None
    assert torch.allclose(rows.grad, strided.grad, atol=1e-12)


def test_lm_loss_accepts_non_contiguous_logits() -> None:
    torch.manual_seed(2)
    wide = torch.randn(2, 6, 20)
    logits = wide[:, :, ::2]  # a strided view, as a slice of a larger head output would be
    targets = torch.randint(0, 10, (2, 6))
    assert not logits.is_contiguous()
    assert torch.allclose(lm_loss(logits, targets), lm_loss(logits.contiguous(), targets))


def test_adamw_stays_unfused_on_the_cpu_with_its_step_counts_there() -> None:
    layer = nn.Linear(4, 3)
    assert not fused_on(layer.parameters())
    assert not fused_on([])
    assert not make_adamw(layer, TrainingSpec()).defaults.get("fused")
    state = LayerState(0, layer)
    steps = [state.optimizer.state[p]["step"] for p in layer.parameters()]
    assert all(step.device.type == "cpu" and step.dtype == torch.float32 for step in steps)


_FIRST_LAYER_PROBE = """
import json, sys
import torch
from resilientjob.agent.models import load_model
from resilientjob.agent.optim import PLAIN_ADAMW, warm_up
from resilientjob.agent.p2p import LayerState
model = load_model("gpt", layers=3, hidden=8, heads=2, vocab=16, seq_len=4)
if sys.argv[1] == "warm":
    warm_up("cpu", PLAIN_ADAMW)
before = set(sys.modules)
LayerState(1, model.allocate(1))
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_after_the_warm_up_a_received_layer_loads_nothing_more() -> None:
    """What a joining node does before it says it is ready (`worker_main`): its first received layer then
    loads no module in the middle of the switch. Without it, that layer's AdamW imported torch._dynamo there
    (2-3 s of a core, while the senders' waits ran against their collective timeout)."""

    def loaded(mode: str) -> list[str]:
        done = subprocess.run(
            [sys.executable, "-c", _FIRST_LAYER_PROBE, mode],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    assert "torch._dynamo" in loaded("cold")
    assert loaded("warm") == []
