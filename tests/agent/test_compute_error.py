"""A worker whose own step fails (a shape error in the user's layer, an out-of-memory) exits with that
error at once. It used to take any RuntimeError of a step for a peer's failure: it waited `plan_timeout_s`
for a plan nobody would publish and died of a TimeoutError that hid the real error."""

from __future__ import annotations

import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from _support import free_port
from torch._C._distributed_c10d import TCPStore

from resilientjob.agent._runtime_wait import ComputeError
from resilientjob.agent.config import JobConfig
from resilientjob.agent.worker import publish_plan, worker_main
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan
from resilientjob.protocol.workload import Workload

BUGGY = """
from torch import nn

CALLS = {"n": 0}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        CALLS["n"] += 1
        if CALLS["n"] == 3:  # a bug in the user's layer, after it ran twice
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 9x8)")
        return x + self.linear(x)


def layers():
    return [nn.Embedding(32, 8), Block(), nn.Linear(8, 32)]
"""


@pytest.mark.torch
def test_an_error_in_the_models_own_step_ends_the_worker_with_it_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "buggy_model.py").write_text(textwrap.dedent(BUGGY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "buggy_model", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    stage = StagePlan(layers=(0, 3), node=0)
    plan = Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=2,
        step_time_s=1.0,
        pipelines=(PipelinePlan(stages=(stage,), microbatches=2),),
    )
    publish_plan(store, plan, 0)
    workload = Workload.model_validate({"model": "buggy_model:layers", "training": {"steps": 5}})
    config = JobConfig(workload=workload, plan_timeout_s=20.0, collective_timeout_s=5.0)
    began = time.monotonic()
    try:
        with pytest.raises(ComputeError) as failed:
            worker_main(0, config, "127.0.0.1", port, None, restore=False, store=store)
    finally:
        torch.set_num_threads(threads)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    # It left its process group (this process's: a group left behind broke every later test that forks).
    assert not torch.distributed.is_initialized()
    assert time.monotonic() - began < 10  # not after a plan timeout
    message = str(failed.value)
    assert "mat1 and mat2 shapes cannot be multiplied" in message and "forward of layers 0..2" in message
    assert message.startswith("node 0, step "), message
