"""The agent's own device work runs off its process on an accelerator (`agent/_device_work.py`).

No accelerator here: what is checked is where the work runs (the agent's process or a spawned child), that the
pre-flight and the probe survive the trip (arguments and results pickle, the child imports what they need),
and how workers start. On a GPU the point is that the agent never initialises CUDA, which a forked worker
cannot survive."""

from __future__ import annotations

import os

import pytest

from resilientjob.agent import _parked
from resilientjob.agent._device_work import DeviceWork, worker_start_method
from resilientjob.agent._model_profile import make_report
from resilientjob.protocol.messages import ModelProfileRequest
from resilientjob.protocol.workload import DataFormat, DataSpec, Workload


async def test_cpu_work_runs_in_the_agents_process() -> None:
    work = DeviceWork("cpu")
    assert await work.run(os.getpid) == os.getpid()


@pytest.mark.parametrize("kind", ["cuda", "npu"])
async def test_accelerator_work_runs_in_one_spawned_child_until_closed(kind: str) -> None:
    work = DeviceWork(kind)
    try:
        child = await work.run(os.getpid)
        assert child != os.getpid()
        assert await work.run(os.getpid) == child  # the parked node's probes reuse it
        work.close()
        assert await work.run(os.getpid) not in (child, os.getpid())  # a fresh one after close
    finally:
        work.close()


def test_workers_fork_on_the_cpu_and_spawn_on_an_accelerator() -> None:
    assert worker_start_method("cpu") == "fork"
    assert worker_start_method("cuda") == "spawn"
    assert worker_start_method("npu") == "spawn"


@pytest.mark.torch
async def test_the_pre_flight_and_the_probe_run_in_the_child() -> None:
    work = DeviceWork("cuda")  # isolated, while the workload itself is on the CPU, which this host has
    try:
        data = DataSpec(format=DataFormat.SYNTHETIC, num_samples=16, seq_len=8)
        request = ModelProfileRequest(model="gpt", seq_len=8, microbatch_size=1, profile=True, measure=True)
        report = await work.run(make_report, request, Workload(model="gpt", data=data), {"layers": 4}, 0)
        assert not report.error and report.num_layers == 4 and report.measured
        assert await work.run(_parked.measure, "cpu", 32, 2) > 0
    finally:
        work.close()
