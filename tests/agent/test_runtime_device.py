"""Every tensor the runtime makes is made where the trainer's device says, never on torch's default device.

There is no accelerator here, so the test turns the question around: the trainer runs on the CPU while
torch's *default* device is `meta`. Any allocation that relies on the default (a receive buffer, the commit
tensor, rotary tables, data, optimizer state, gradient-norm sums) lands on `meta`, and the step fails on the
first operation that mixes it with a real tensor or reads it back. On a GPU the same slip would leave a
tensor on the CPU. A tied GPT-2 directory and a Llama directory (rotary embedding) run a step with clipping
and the schedule, then a layer is allocated for a peer-to-peer copy and a checkpoint is written and read.

The worker runs in a subprocess: the default device is process-wide."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

SCRIPT = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    from pathlib import Path

    import torch
    from torch._C._distributed_c10d import TCPStore

    from resilientjob.agent.checkpoint import Checkpointer
    from resilientjob.agent.data import SyntheticDataset
    from resilientjob.agent.models import load_model
    from resilientjob.agent.runtime import Trainer
    from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan
    from resilientjob.protocol.workload import Schedule, TrainingSpec

    model = load_model("hf:" + sys.argv[1], seq_len=8)
    plan = Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=2,
        step_time_s=1.0,
        pipelines=(PipelinePlan(stages=(StagePlan(layers=(0, model.num_layers), node=0),), microbatches=2),),
    )
    training = TrainingSpec(steps=3, warmup_steps=1, schedule=Schedule.COSINE, grad_clip_norm=0.1)
    dataset = SyntheticDataset(16, seq_len=8, vocab=model.vocab)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    trainer = Trainer(node=0, model=model, dataset=dataset, global_batch=4, training=training)
    trainer.init_layers(plan)  # the model's own construction may follow the default device; not the runtime
    torch.set_default_device("meta")
    trainer.apply_plan(plan, store)
    losses = [trainer.run_step(0)[0] for _ in range(2)]
    received = trainer.make_layer(1, initial=False)
    assert all(t.device.type == "cpu" for t in received.tensors()), "a received layer left the device"
    checkpointer = Checkpointer(Path(sys.argv[2]), interval=1, asynchronous=False)
    checkpointer.save(trainer.step, trainer.layers, set(trainer.layers))
    checkpointer.load(trainer.step, received)
    trainer.close()
    print("losses", *losses, "norm", trainer.last_grad_norm)
    """
)


def _directory(tmp_path: Path, family: str) -> Path:
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=24, n_positions=8, bos_token_id=0, eos_token_id=0
        )
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=24, max_position_embeddings=8,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / family)
    return tmp_path / family


@pytest.mark.torch
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_runtime_allocates_on_its_device_not_the_default_one(tmp_path: Path, family: str) -> None:
    directory = _directory(tmp_path, family)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(directory), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    words = done.stdout.split()
    losses = [float(words[1]), float(words[2])]
    assert all(math.isfinite(loss) and loss > 0 for loss in losses)  # real numbers, not meta placeholders
    assert float(words[-1]) > 0.1  # the norm was computed (and clipped to 0.1)


def test_an_accelerators_groups_outlast_the_runtimes_own_timeout() -> None:
    """NCCL's watchdog takes the process down at its group's timeout: were that the runtime's 5 s, the
    survivors of a failure died before the next plan came. Gloo's operations fail by it, as they should."""
    from resilientjob.agent.runtime import ACCELERATOR_GROUP_TIMEOUT_S, group_timeout_s

    assert group_timeout_s("cpu", 5.0) == 5.0
    assert group_timeout_s("cuda:1", 5.0) == ACCELERATOR_GROUP_TIMEOUT_S >= 600
