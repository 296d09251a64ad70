"""A switch to a new generation that fails with every worker alive, on real gloo workers (`worker_main`):
every worker reports the abandoned switch (`StepHooks.on_abort(..., switching=True)`), and the re-formed
generation carries the switch's copies again (`operator._aborts.copies_to_carry`), less those that were
done (`agent.p2p.switch_copies`).

The layout: three nodes, DP2 PP[2,1]; generation 1 swaps the two stages of the first pipeline, so nodes 0
and 1 give each other their layers and then drop their own. Either node 1 fails amid the copies (at its
third layer), or node 0 fails after them (its pipeline channels cannot be built), when every layer has
landed and the sources have dropped what they gave away. Generation 2 is generation 1 again: it copies only
what had not landed, and asks no source for a layer it dropped (the world would have stopped once more).
The test plays the operator: it publishes the plans and reads the abort reports."""

from __future__ import annotations

import multiprocessing
import time
from datetime import timedelta
from multiprocessing.queues import Queue
from typing import Any

import pytest
import torch
from torch._C._distributed_c10d import TCPStore

from resilientjob.agent.hooks import StepHooks
from resilientjob.agent.worker import JobConfig, publish_plan
from resilientjob.operator._aborts import copies_to_carry
from resilientjob.planner.plan import Plan, Policy, Transfer
from resilientjob.planner.profile import ModelProfile
from resilientjob.protocol.messages import WorkerAbort
from resilientjob.protocol.store_keys import loss_key, received_key
from resilientjob.testing.plans import RuntimePlanner
from resilientjob.testing.reference import reference_run

pytestmark = pytest.mark.torch

GPT8 = {"layers": 8, "hidden": 32, "heads": 2, "vocab": 32, "seq_len": 16}
NODES, STEPS, SWITCH_AT = 3, 5, 2
AMID, AFTER = "amid the copies", "after the copies"


def _config() -> JobConfig:
    return JobConfig.plain(
        "gpt",
        model_options=dict(GPT8),
        num_samples=128,
        steps=STEPS,
        collective_timeout_s=3.0,
        plan_timeout_s=60.0,
    )


def _abort_key(generation: int, node: int) -> str:
    return f"test/abort/{generation}/{node}"


class _Reporting(StepHooks):
    """Plays the agent's part: each abort goes where the test reads it. Node 0 also publishes generation 1
    (stored by the test) once step `SWITCH_AT` committed, so that the switch comes mid-run on every node."""

    def __init__(self, node: int, store: Any) -> None:
        self.node, self.store = node, store

    def on_abort(self, generation: int, step: int, error: str, switching: bool = False) -> None:
        self.store.set(_abort_key(generation, self.node), "switch" if switching else "step")

    def after_step(self, plan: Plan | None, generation: int, step: int, loss: float, samples: int) -> None:
        if self.node == 0 and step == SWITCH_AT and generation == 0:
            publish_plan(self.store, Plan.model_validate_json(self.store.get("test/next")), 0)


def _node(node: int, port: int, when: str, results: Queue[Any]) -> None:
    from resilientjob.agent import runtime
    from resilientjob.agent.worker import worker_main

    torch.set_num_threads(1)
    if when == AFTER and node == 0:
        build_ops = runtime.build_ops

        def fail_after(plan: Plan) -> Any:
            # Every layer landed and this node dropped those it gave away; its pipeline channels fail.
            if plan.generation == 1:
                raise RuntimeError("injected: the switch failed after the copies")
            return build_ops(plan)

        runtime.build_ops = fail_after  # type: ignore[assignment]
    if when == AMID and node == 1:
        receive = runtime.Trainer._receive_layer
        calls: list[int] = []

        def fail_amid(trainer: Any, index: int) -> Any:
            if trainer.plan.generation == 1:
                calls.append(index)
                if len(calls) == 3:  # two layers of node 0's four arrived
                    raise RuntimeError("injected: a layer copy failed")
            return receive(trainer, index)

        runtime.Trainer._receive_layer = fail_amid  # type: ignore[method-assign]
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    result = worker_main(
        node, _config(), "127.0.0.1", port, _Reporting(node, store), restore=False, store=store
    )
    results.put((node, result))


def _swapped(plan: Plan, profile: ModelProfile) -> Plan:
    """`plan` (DP2 PP[2,1]) with the first pipeline's stages swapped between nodes 0 and 1: generation 1."""
    first, second = plan.pipelines
    head, tail = first.stages
    assert (head.node, tail.node, second.nodes) == (0, 1, (2,))
    size = {index: layer.param_bytes + layer.optimizer_bytes for index, layer in enumerate(profile.layers)}
    swaps = [(index, 0, 1) for index in range(*head.layers)] + [
        (index, 1, 0) for index in range(*tail.layers)
    ]
    return plan.model_copy(
        update={
            "generation": 1,
            "pipelines": (
                first.model_copy(
                    update={
                        "stages": (head.model_copy(update={"node": 1}), tail.model_copy(update={"node": 0}))
                    }
                ),
                second,
            ),
            "transfers": tuple(Transfer(layer=i, src=s, dst=d, bytes=size[i]) for i, s, d in swaps),
        }
    )


def _wait_for(store: Any, keys: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        assert time.monotonic() < deadline, f"timed out waiting for {keys}"
        time.sleep(0.02)


@pytest.mark.parametrize("when", [AMID, AFTER])
def test_a_failed_switch_re_forms_and_copies_only_what_had_not_landed(
    gpt_profile: ModelProfile, when: str
) -> None:
    planner = RuntimePlanner.for_job(gpt_profile, nodes=NODES, global_batch=8, microbatch_size=2)
    plan = planner.initial(Policy.DYNAMIC)
    swapped = _swapped(plan, gpt_profile)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    store.set("test/next", swapped.model_dump_json())
    publish_plan(store, plan, 0)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "resilientjob.agent.runtime"])
    results: Queue[Any] = context.Queue()
    workers = [
        context.Process(target=_node, args=(n, store.port, when, results), daemon=True) for n in range(NODES)
    ]
    for worker in workers:
        worker.start()
    try:
        # Every node abandons the switch to generation 1, alive; the operator's part: re-form it.
        _wait_for(store, [_abort_key(1, n) for n in range(NODES)], 60.0)
        kinds = {n: store.get(_abort_key(1, n)).decode() for n in range(NODES)}
        assert kinds == dict.fromkeys(range(NODES), "switch"), kinds
        aborts = {
            node: WorkerAbort(
                node=node,
                generation=1,
                step=SWITCH_AT + 1,
                error="-",
                collective_timeout_s=3.0,
                plan_timeout_s=60.0,
                at=time.time(),
                switching=True if kind == "switch" else None,
            )
            for node, kind in kinds.items()
        }
        carried = copies_to_carry(swapped, aborts)
        assert carried == swapped.transfers  # every one: the workers sort out which had landed
        publish_plan(store, swapped.model_copy(update={"generation": 2, "transfers": carried}), 0)
        finished = dict(results.get(timeout=90) for _ in range(NODES))
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
    assert all(finished[n]["step"] == STEPS and not finished[n]["left"] for n in range(NODES)), finished
    # Each layer crossed once. After the copies, all had landed: generation 2 moved none, and reports
    # generation 1's with the switch that completed. Amid them, node 1 kept the two layers it had whole:
    # generation 2 moved the other six.
    records = [r.split(",") for r in store.get(received_key(2)).decode().split(";") if r]
    moved = sorted((int(layer), int(src), int(dst), int(size)) for layer, src, dst, size in records)
    landed = {0, 1} if when == AMID else set()
    assert moved == sorted(
        (t.layer, t.src, t.dst, t.bytes) for t in swapped.transfers if t.layer not in landed
    )
    # The same training as without the failed switch: the losses of the single-process run.
    reference, _, _ = reference_run(_config(), plan.global_batch, plan.microbatch_size)
    losses = [float(store.get(loss_key(step)).decode().split(":", 1)[1]) for step in range(STEPS)]
    assert losses == pytest.approx(reference[:STEPS], rel=0.01)


def test_out_of_memory_in_a_switch_ends_the_worker_instead_of_re_forming_the_world() -> None:
    """No re-formed world gives a node more memory: three re-formations and the plan timeout were all it
    bought. The worker exits with the error (`ComputeError`), and the fail-stop path plans around it."""
    from types import SimpleNamespace

    from torch._C._distributed_c10d import HashStore

    from resilientjob.agent import worker
    from resilientjob.agent._runtime_wait import ComputeError
    from resilientjob.planner.plan import PipelinePlan, StagePlan

    said: list[tuple[int, bool]] = []

    def apply_plan(plan: Plan, store: Any) -> bool:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    trainer = SimpleNamespace(
        node=0,
        degree=1,
        step=4,
        generation=0,
        apply_plan=apply_plan,
        hooks=SimpleNamespace(on_abort=lambda g, step, error, switching=False: said.append((g, switching))),
    )
    stages = (StagePlan(layers=(0, 8), node=0),)
    plan = Plan(
        generation=1,
        policy=Policy.DYNAMIC,
        microbatch_size=2,
        pipelines=(PipelinePlan(stages=stages, microbatches=2),),
        step_time_s=0.1,
    )
    store = HashStore()
    publish_plan(store, plan, 0)
    with pytest.raises(ComputeError, match="switch to generation 1: OutOfMemoryError: CUDA out of memory"):
        worker._settle(trainer, store, plan, timeout_s=5.0)  # type: ignore[arg-type]
    assert said == []  # no abort reported: nothing for the operator to re-form
