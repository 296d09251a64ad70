"""Per-layer checkpoints round-trip on every path `_dcp_compat` may take: this torch's own `no_dist` entry
points and the older ones torch 2.5.1 (the Ascend image's pin) needs, synchronous and in the background."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import torch
from _support import free_port
from torch import nn

from resilientjob.agent import _dcp_compat
from resilientjob.agent._runtime_commit import RolledStep
from resilientjob.agent._runtime_schedule import held_layers
from resilientjob.agent.checkpoint import OWNER_FILE, Checkpointer, CheckpointTaken, claim
from resilientjob.agent.p2p import LayerState
from resilientjob.agent.runtime import Trainer
from resilientjob.agent.worker import checkpoint_rolled
from resilientjob.planner.profile import ModelProfile
from resilientjob.testing.plans import RuntimePlanner

# One process writes each layer on purpose (the worker silences DCP's note that it assumes so).
pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to (save|load) in a single process")


def _layer(seed: int) -> LayerState:
    torch.manual_seed(seed)
    layer = LayerState(index=0, module=nn.Linear(4, 3))
    for state in layer.optimizer.state.values():
        state["exp_avg"].normal_()
        state["step"].fill_(seed)
    return layer


def _same(a: LayerState, b: LayerState) -> bool:
    left, right = a.named_tensors(), b.named_tensors()
    return left.keys() == right.keys() and all(torch.equal(left[key], right[key]) for key in left)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the older entry points are deprecated on new torch
@pytest.mark.parametrize("asynchronous", [True, False])
@pytest.mark.parametrize("new_entry_points", [True, False], ids=["this-torch", "torch-2.5-entry-points"])
def test_a_layer_saved_and_loaded_back_is_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asynchronous: bool, new_entry_points: bool
) -> None:
    if not new_entry_points:  # what torch 2.5.1 offers: no `no_dist` on async_save, save or load
        for flag in ("ASYNC_SAVE_NO_DIST", "SAVE_NO_DIST", "LOAD_NO_DIST"):
            monkeypatch.setattr(_dcp_compat, flag, False)
        monkeypatch.setattr(_dcp_compat._saver, "async_save", _must_not_be_called)
        monkeypatch.setattr(_dcp_compat._saver, "save", _must_not_be_called)
        monkeypatch.setattr(_dcp_compat._loader, "load", _must_not_be_called)
    checkpointer = Checkpointer(tmp_path, interval=5, asynchronous=asynchronous)
    saved = _layer(seed=1)
    checkpointer.save(5, {0: saved}, owned={0})
    checkpointer.wait()
    assert checkpointer.latest_complete(num_layers=1) == 5

    restored = _layer(seed=2)
    assert not _same(saved, restored)
    checkpointer.load(5, restored)
    assert _same(saved, restored)


def test_the_writer_thread_saves_the_weights_of_the_step_not_later_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_dcp_compat, "ASYNC_SAVE_NO_DIST", False)
    checkpointer = Checkpointer(tmp_path, interval=1)
    layer = _layer(seed=3)
    expected = {key: value.clone() for key, value in layer.named_tensors().items()}
    checkpointer.save(1, {0: layer}, owned={0})
    with torch.no_grad():
        for param in layer.module.parameters():
            param.add_(1.0)  # training goes on while the writer works
    checkpointer.wait()
    restored = _layer(seed=4)
    checkpointer.load(1, restored)
    assert all(torch.equal(restored.named_tensors()[key], value) for key, value in expected.items())


def _must_not_be_called(*_: object, **__: object) -> None:
    raise AssertionError("this entry point has no `no_dist` on the torch being emulated")


def test_old_checkpoints_are_pruned_to_the_newest_complete_ones(tmp_path: Path) -> None:
    """Two nodes write one layer each to a shared directory: a step counts once both layers are in. After
    each save the newest `keep` complete steps and any newer ones still being written stay; on a directory
    of one node's own layers (an emptyDir, never complete), its newest `keep` steps stay."""
    shared = [Checkpointer(tmp_path / "shared", interval=1, asynchronous=False) for _ in range(2)]
    layers = [{0: _layer(seed=1)}, {1: LayerState(index=1, module=nn.Linear(4, 3))}]
    for step in range(1, 6):
        for node, checkpointer in enumerate(shared):
            if step == 5 and node == 1:
                break  # step 5 is still being written by node 1
            checkpointer.save(step, layers[node], owned={node})
            checkpointer.prune(num_layers=2, current=step)
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["step3", "step4", "step5"]
    assert shared[0].latest_complete(num_layers=2) == 4

    local = Checkpointer(tmp_path / "local", interval=1, asynchronous=False, keep=2)
    for step in range(1, 5):
        local.save(step, layers[0], owned={0})
        local.prune(num_layers=2, current=step)  # layer 1 is on another node's disk: never complete here
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["step3", "step4"]

    # A job that started over (nothing complete to restart from) writes step 1 again beside the steps its
    # dead run left: they are not counted, and the step its peers are writing stays.
    local.save(1, layers[0], owned={0})
    local.prune(num_layers=2, current=1)
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["step1", "step3", "step4"]


def test_a_restart_discards_the_steps_its_dead_run_saved_past_it(tmp_path: Path) -> None:
    """A run saved step 6 whole and step 9 in part (node 0's layer), then died; the job restarted from 6.
    When the new run saves step 9 again, node 1's layer first, the dead run's layer 0 must not make step 9
    look complete: a restart then would load layer 0 from the dead run and layer 1 from this one."""
    shared = [Checkpointer(tmp_path, interval=1, asynchronous=False) for _ in range(2)]
    layers = [{0: _layer(seed=1)}, {1: LayerState(index=1, module=nn.Linear(4, 3))}]
    for node in (0, 1):
        shared[node].save(6, layers[node], owned={node})
    shared[0].save(9, layers[0], owned={0})  # the dead run's last, cut short
    assert shared[0].latest_complete(num_layers=2) == 6
    for checkpointer in shared:  # every worker, once the restart's step is agreed
        checkpointer.discard_after(6)
    shared[1].save(9, layers[1], owned={1})  # the new run's step 9, node 0's layer still being written
    assert shared[0].latest_complete(num_layers=2) == 6
    assert sorted(p.name for p in (tmp_path / "step9").iterdir()) == ["layer1"]
    shared[0].save(9, layers[0], owned={0})
    assert shared[1].latest_complete(num_layers=2) == 9


def test_a_restart_waits_for_every_survivors_saves_so_all_restore_the_same_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two survivors on one checkpoint volume; node 1 is still writing step 6 when the restart plan comes.
    Node 0 checks in first: it must not look for the newest checkpoint before node 1's save is on disk (it
    restored step 3, node 1 step 6, and the rendezvous failed the job on the disagreement)."""
    import threading
    import time
    from datetime import timedelta

    from torch._C._distributed_c10d import TCPStore

    from resilientjob.agent._runtime_schedule import designated_holders
    from resilientjob.agent.data import SyntheticDataset
    from resilientjob.agent.models import ModelConfig, builtin_model
    from resilientjob.agent.runtime import Trainer
    from resilientjob.agent.worker import check_in
    from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan

    def plan(policy: Policy, generation: int) -> Plan:
        stages = (StagePlan(layers=(0, 2), node=0), StagePlan(layers=(2, 4), node=1))
        pipelines = (PipelinePlan(stages=stages, microbatches=2),)
        return Plan(
            policy=policy, generation=generation, microbatch_size=2, step_time_s=1.0, pipelines=pipelines
        )

    monkeypatch.setattr(_dcp_compat, "ASYNC_SAVE_NO_DIST", False)  # the checkpointer's own writer thread
    written = _dcp_compat.save_local
    model, data, first = (
        builtin_model(ModelConfig(layers=4)),
        SyntheticDataset(64, seq_len=16, vocab=32),
        plan(Policy.DYNAMIC, 0),
    )
    owners = designated_holders(first)
    trainers = [Trainer(node=node, model=model, dataset=data, global_batch=4) for node in (0, 1)]
    savers = [Checkpointer(tmp_path, interval=3) for _ in (0, 1)]
    for node in (0, 1):
        trainers[node].init_layers(first)
        savers[node].save(3, trainers[node].layers, {i for i, o in owners.items() if o == node})
        savers[node].wait()
    savers[0].save(6, trainers[0].layers, {i for i, o in owners.items() if o == 0})
    savers[0].wait()

    def slow(state: object, target: Path) -> None:
        time.sleep(1.0)  # a large layer on a network volume
        written(state, target)  # type: ignore[arg-type]

    monkeypatch.setattr(_dcp_compat, "save_local", slow)
    savers[1].save(6, trainers[1].layers, {i for i, o in owners.items() if o == 1})
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    restart = plan(Policy.CHECKPOINT, 1)
    errors: list[BaseException] = []

    def survivor(node: int, delay: float) -> None:
        try:
            time.sleep(delay)
            store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
            check_in(trainers[node], store, restart, 20.0, True, savers[node])
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=survivor, args=(0, 0.0)),
        threading.Thread(target=survivor, args=(1, 0.2)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    del server
    assert not errors, errors
    assert [trainer.step for trainer in trainers] == [6, 6]


def _eight_claim_at_once(directory: Path) -> str:
    """Eight jobs claim `directory` at once: exactly one wins, every loser read its whole name (never an
    empty or half-written mark), the mark is readable by any job's user and no temporary is left. The
    winner."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [f"ns/job-{i}" for i in range(8)]

    def attempt(job: str) -> str | None:
        try:
            claim(directory, job)
        except CheckpointTaken as exc:
            return exc.holder
        return None

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(attempt, jobs))
    winners = [job for job, holder in zip(jobs, outcomes, strict=True) if holder is None]
    assert len(winners) == 1, outcomes
    assert {holder for holder in outcomes if holder is not None} == set(winners)
    assert (directory / OWNER_FILE).read_text() == winners[0] + "\n"
    assert (directory / OWNER_FILE).stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in directory.iterdir()) == [OWNER_FILE]
    claim(directory, winners[0])  # the owner again: fine
    return winners[0]


def test_a_checkpoint_directory_is_claimed_by_one_job_whoever_claims_first(tmp_path: Path) -> None:
    _eight_claim_at_once(tmp_path / "ckpt")


def test_a_file_system_without_hard_links_is_claimed_by_one_job_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Object-store volumes (gcsfuse, s3fs) have no hard links: `link` fails EPERM or ENOTSUP there, and a
    claim that needed it failed every job on them. The mark is created exclusively instead."""
    import errno
    import os

    def no_links(src: object, dst: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    _eight_claim_at_once(tmp_path / "ckpt")
    with pytest.raises(CheckpointTaken, match="delete the mark once that job and its steps are gone"):
        claim(tmp_path / "ckpt", "ns/other")


def test_a_rolled_step_is_saved_when_due_with_the_layers_its_plan_gave_this_node(
    tmp_path: Path, gpt_profile: ModelProfile
) -> None:
    """A rank that applied a step at a rendezvous (its commit lost, its peers' not) saves it as the peers did
    when they committed it: on the interval and at the last step, the layers it writes under the plan that
    trained the step, so that step's checkpoint is whole (`worker.checkpoint_rolled`)."""
    plan = RuntimePlanner.for_job(
        gpt_profile, nodes=2, global_batch=4, microbatch_size=2, fault_tolerance=0, dp_range=(1, 1)
    ).initial()
    held = held_layers(plan)
    assert held[0] and held[1] and not held[0] & held[1]  # two stages: each node writes its own layers
    node = {n: SimpleNamespace(node=n, layers={i: _layer(seed=i) for i in held[n]}) for n in (0, 1)}
    checkpointer = Checkpointer(tmp_path, interval=5, asynchronous=False)

    def roll(index: int) -> None:  # node 1 applied step `index`: `index + 1` steps are then committed
        trainer = cast(Trainer, node[1])
        checkpoint_rolled(trainer, checkpointer, RolledStep(0, index, 1.0, 1.0, plan), steps=12)

    roll(3)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # step 4 is not due
    roll(4)
    assert sorted(p.name for p in (tmp_path / "step5").iterdir()) == sorted(f"layer{i}" for i in held[1])
    # Its peer committed step 5 and saved its own layers then: the step is whole.
    checkpointer.save(5, node[0].layers, held[0])
    assert checkpointer.latest_complete(plan.num_layers) == 5
    roll(11)  # the last step, due or not: the trained model's fallback
    assert (tmp_path / "step12").is_dir()
    # Off the step interval, but its peers' commit asked for it (world rank 0's time interval).
    trainer = cast(Trainer, node[1])
    checkpoint_rolled(trainer, checkpointer, RolledStep(0, 6, 1.0, 1.0, plan, checkpoint=True), steps=12)
    assert (tmp_path / "step7").is_dir()
