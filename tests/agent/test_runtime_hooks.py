"""The trainer's hooks (`agent/hooks.py`) are where the pod's probe plugs into the runtime: each is
called at its point of the loop with what it is documented to see. A single-process trainer in a subprocess
(the default process group is process-wide) applies a plan, runs two steps, applies a second plan and runs
one more; the hooks record every call."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json
    from datetime import timedelta

    from torch._C._distributed_c10d import TCPStore

    from resilientjob.agent.hooks import StepHooks
    from resilientjob.agent.data import SyntheticDataset
    from resilientjob.agent.models import load_model
    from resilientjob.agent.runtime import Trainer
    from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan

    class Recorder(StepHooks):
        def __init__(self):
            self.calls = []

        def on_plan(self, plan):
            self.calls.append(["plan", plan.generation])

        def before_step(self, store, generation, step, world_rank):
            self.calls.append(["before", generation, step, world_rank, store is not None])

        def after_step(self, plan, generation, step, loss, samples):
            self.calls.append(["after", plan.generation, generation, step, samples, loss > 0])

    model = load_model("gpt", seq_len=8)
    def plan(generation):
        stages = (StagePlan(layers=(0, model.num_layers), node=0),)
        return Plan(
            generation=generation, policy=Policy.DYNAMIC, microbatch_size=2, step_time_s=1.0,
            pipelines=(PipelinePlan(stages=stages, microbatches=2),),
        )
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    hooks = Recorder()
    trainer = Trainer(
        node=0, model=model, dataset=SyntheticDataset(16, seq_len=8, vocab=model.vocab), global_batch=4,
        hooks=hooks,
    )
    trainer.init_layers(plan(0))
    trainer.apply_plan(plan(0), store)
    trainer.run_step(0)
    trainer.run_step(0)
    trainer.apply_plan(plan(1), store)
    trainer.run_step(1)
    trainer.close()
    print(json.dumps(hooks.calls))
    """
)


@pytest.mark.torch
def test_the_hooks_are_called_around_plans_and_steps_with_what_they_document() -> None:
    command = [sys.executable, "-c", SCRIPT]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = json.loads(done.stdout.strip().splitlines()[-1])
    assert calls == [
        ["plan", 0],
        ["before", 0, 0, 0, True],
        ["after", 0, 0, 1, 4, True],
        ["before", 0, 1, 0, True],
        ["after", 0, 0, 2, 4, True],
        ["plan", 1],
        ["before", 1, 2, 0, True],
        ["after", 1, 1, 3, 4, True],
    ]
