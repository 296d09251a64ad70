"""The worker process: one per device, driven by plans the launcher publishes in the job's TCPStore.

The job's TCPStore (the launcher hosts it; in a cluster the store pod, which mirrors the operator's Redis
plan into it) holds the plans, the rendezvous, failure notices, commit votes and the step records: its keys
and what each holds are `resilientjob.protocol.store_keys`.

`publish_plan` and `announce_failures` are the writer's side (the launcher here; in a cluster the pod agent,
which mirrors the operator's Redis plan into the job's store), `run_from_plan` the worker's entry point.
"""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

import torch
from torch._C._distributed_c10d import Store, TCPStore

from resilientjob.planner.plan import Plan, Policy
from resilientjob.protocol.messages import abort_line
from resilientjob.protocol.store_keys import (
    COMMITTED_KEY,
    FAILURES_KEY,
    GENERATION_KEY,
    accounted_key,
    applied_key,
    checkin_key,
    event_key,
    joining_key,
    loss_key,
    plan_key,
    received_key,
    restored_key,
    steptime_key,
)

from ._dtensor import local
from ._final_export import export_model
from ._plan_store import read_generation, read_plan
from ._runtime_commit import ReconfigurationError, RolledStep
from ._runtime_schedule import designated_holders, held_layers, world_nodes
from ._runtime_wait import ComputeError
from ._tensor_parallel import full_parameters, tp_degree
from ._termination import WorkloadError
from .checkpoint import Checkpointer
from .config import JobConfig
from .hooks import StepHooks
from .optim import warm_up
from .p2p import LayerState
from .runtime import Trainer


def device_name(kind: str, local_rank: int) -> str:
    """The name of the pod's `local_rank`-th device of `kind` (`cpu`, or `cuda:1`), as torch writes it."""
    return "cpu" if kind == "cpu" else f"{kind}:{local_rank}"


def worker_device(kind: str, local_rank: int) -> str:
    """This worker's device: the pod's `local_rank`-th visible accelerator (the device plugin exposes only
    the pod's own devices, numbered from 0), or the CPU."""
    if kind == "cpu":
        return "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
            raise ValueError(f"device: cuda:{local_rank} is not visible in this pod")
        torch.cuda.set_device(local_rank)
    elif kind == "npu":
        import torch_npu  # noqa: F401  - registers torch.npu (extra `ascend`)

        torch.npu.set_device(local_rank)  # type: ignore[attr-defined]
    else:
        raise ValueError(f"device: expected cpu, cuda or npu, got {kind!r}")
    return device_name(kind, local_rank)


def publish_plan(store: Store, plan: Plan, failures_accounted: int) -> None:
    """Make `plan` the job's newest plan. `failures_accounted`: the failure count the plan was made with."""
    store.set(plan_key(plan.generation), plan.model_dump_json())
    # Written before the generation: a worker that sees the plan also sees which failures it covers.
    store.set(accounted_key(plan.generation), str(failures_accounted))
    store.set(GENERATION_KEY, str(plan.generation))


def announce_failures(store: Store, count: int) -> int:
    """Tell every worker at once that `count` more peers died; returns the total announced so far."""
    return int(store.add(FAILURES_KEY, count))


def wait_for_plan_after(store: Store, generation: int, timeout_s: float) -> Plan:
    """Block until a plan newer than `generation` is published; return the newest."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        latest = read_generation(store)
        if latest > generation:
            return read_plan(store, latest)
        time.sleep(0.02)
    raise TimeoutError(f"plan_timeout_s: no plan after generation {generation} within {timeout_s} s")


class JobFinished(Exception):
    """The job's workers committed its last step while this one waited to join them."""


def finished(store: Store, steps: int | None) -> bool:
    return steps is not None and int(store.add(COMMITTED_KEY, 0)) >= steps


def wait_for_plan_with(
    store: Store, node: int, plan: Plan, timeout_s: float, steps: int | None = None
) -> Plan | None:
    """`plan` if it gives `node` a part, else the first newer plan that does (a node that joins waits for
    the plan that takes it in); None after `timeout_s` without one. `JobFinished` when the job trained its
    `steps` meanwhile."""
    deadline = time.monotonic() + timeout_s
    while node not in world_nodes(plan):
        if finished(store, steps):
            raise JobFinished
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            plan = wait_for_plan_after(store, plan.generation, min(left, 1.0))
        except TimeoutError:
            continue
    return plan


def await_peers(
    store: Store,
    plan: Plan,
    node: int,
    degree: int,
    timeout_s: float,
    steps: int | None = None,
    key: str | None = None,
) -> bool:
    """Check in for plan `plan.generation` and wait for every worker of its world before the rendezvous,
    whose timeout is the collective timeout (seconds). Workers reach a rendezvous far apart: at a fresh start
    (minutes apart on a loaded machine or a slow image pull; node 0, which ran the pre-flight, has its model
    loaded already), after a store replacement (each reconnects when its own backoff lets it), after a
    failure (a worker blocked in a collective notices only at its timeout). A rendezvous entered that far
    apart fails with no peer dead, and then nothing publishes a newer plan. Stops waiting when a newer plan
    appears (a peer died meanwhile) or after `timeout_s`; then the rendezvous decides as before. False when
    it gave up. `JobFinished` when the job trained its `steps` meanwhile (a replacement that joins as the
    job ends waits for peers that have exited). `key`: the counter to count in (default: the generation's
    check-ins)."""
    nodes = world_nodes(plan)
    if node not in nodes:
        return True
    key = key or checkin_key(plan.generation)
    expected = len(nodes) * degree
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if int(store.add(key, 0)) >= expected or read_generation(store) > plan.generation:
            return True
        if finished(store, steps):
            raise JobFinished
        time.sleep(0.01)
    return False


def check_in(
    trainer: Trainer,
    store: Store,
    plan: Plan,
    timeout_s: float,
    restart: bool,
    checkpointer: Checkpointer | None,
    steps: int | None = None,
) -> None:
    """Wait for the plan's world (`await_peers`); for a `restart`, then load the newest complete checkpoint
    (`_restore`), and wait for the world again. Each worker's own saves are on disk before it checks in, so
    that past the barrier every worker finds the same newest step: a survivor still writing the newest
    checkpoint when the restart came made a peer that looked first restore the step before, and the
    rendezvous failed the job on the disagreement. Loading takes each node its own time (minutes for a large
    model, from a shared volume): a node that loaded a collective timeout after its peers failed their
    rendezvous, and the restart with it."""
    if restart and checkpointer is not None:
        checkpointer.wait()
    await_peers(store, plan, trainer.node, trainer.degree, timeout_s, steps)
    if restart:
        _restore(trainer, checkpointer, plan)
        loaded = restored_key(plan.generation)
        await_peers(store, plan, trainer.node, trainer.degree, timeout_s, steps, key=loaded)


def _restore(trainer: Trainer, checkpointer: Checkpointer | None, plan: Plan) -> None:
    """A plan of policy `checkpoint` after generation 0: the job restarts from the last complete
    checkpoint (weights, optimizer state; the schedule and the data position follow from the step), in
    this process. Layers are allocated for the new plan and overwritten from disk; with none complete the
    job starts over from the initial weights."""
    if checkpointer is None:
        raise ReconfigurationError("checkpoint: the plan restarts from a checkpoint but none is configured")
    checkpointer.wait()
    restored = checkpointer.latest_complete(trainer.model.num_layers)
    trainer.layers.clear()
    trainer.step = restored or 0
    # A replacement pod started as a joiner (the job had trained) has a step of its own now, and its layers:
    # a joiner votes for no step at the rendezvous, and a restart world of replacements only (every node of
    # the job lost) agreed on step 0, trained from there on the restored weights and deleted every saved step
    # past 0 (`discard_after`).
    trainer.joining = False
    if trainer.degree > 1:
        trainer.init_layers(plan)  # sharded, then loaded, once the plan's world exists (`_load_shards`)
        return
    for index in sorted(held_layers(plan).get(trainer.node, set())):
        layer = trainer.make_layer(index, initial=restored is None)
        if restored is not None:
            checkpointer.load(restored, layer)
        trainer.layers[index] = layer
    print(f"node {trainer.node}: restarted from checkpoint step {restored}", flush=True)


def _load_shards(trainer: Trainer, checkpointer: Checkpointer | None, restored: int | None) -> None:
    if checkpointer is not None and restored is not None and trainer.degree > 1:
        for layer in trainer.layers.values():
            checkpointer.load(restored, layer)


def _settle(
    trainer: Trainer,
    store: Store,
    plan: Plan,
    timeout_s: float,
    checkpointer: Checkpointer | None = None,
    steps: int | None = None,
) -> bool:
    """Apply `plan`, or the next one if a peer dies during the switch. False if this node is left out."""
    while True:
        restart = plan.policy == Policy.CHECKPOINT and plan.generation > max(trainer.generation, 0)
        try:
            check_in(trainer, store, plan, timeout_s, restart, checkpointer, steps)
            joined = trainer.apply_plan(plan, store)
            if restart and checkpointer is not None and joined:
                _load_shards(trainer, checkpointer, trainer.step or None)
                # The step is agreed and nobody of this world has trained past it. A node the restart left
                # out must not: by the time it looks, a newer world may be saving a later step (a
                # replacement that read an old restart plan deleted the step its peer was writing).
                checkpointer.discard_after(trainer.step)
        except ReconfigurationError:
            raise
        except torch.OutOfMemoryError as exc:
            # This node's own memory, not a peer: a re-formed world would fail alike, up to its limit of
            # tries. The worker exits with it, and the fail-stop path plans around the node.
            raise ComputeError(f"switch to generation {plan.generation}: {abort_line(exc)}") from exc
        except RuntimeError as exc:
            _abandon_switch(trainer, store, plan, exc)
            plan = wait_for_plan_after(store, plan.generation, timeout_s)
            continue
        generation = plan.generation
        _record_losses(trainer, store)
        store.add(applied_key(generation), 1)  # every worker counts: the launcher expects nodes x degree
        timings = trainer.timings
        for record in trainer.received:
            if record.dst == trainer.node:
                store.append(  # type: ignore[attr-defined]
                    received_key(generation), f"{record.layer},{record.src},{record.dst},{record.bytes};"
                )
        trainer.received.clear()
        if trainer.local_rank > 0:  # events are per node: local rank 0 writes them
            return joined
        if joined:  # a node left out keeps the last switch's timings: nothing to report
            trainer.hooks.on_applied(generation, timings.rendezvous_s, timings.copy_s, timings.bytes_received)
        store.set(
            event_key("applied", generation, trainer.node),
            json.dumps(
                {
                    "time": time.time(),
                    "rendezvous_s": timings.rendezvous_s,
                    "copy_s": timings.copy_s,
                    "bytes": timings.bytes_received,
                }
            ),
        )
        return joined


def _abandon_switch(trainer: Trainer, store: Store, plan: Plan, exc: RuntimeError) -> None:
    """The switch to `plan` failed here (its rendezvous, a layer copy): said as an abandoned step is. A
    peer's death is answered by the fail-stop path anyway; with every node alive nothing else would publish
    the generation the workers wait for: they waited out their plan timeout, and every pod exited."""
    if trainer.node in world_nodes(plan):
        _abandon(trainer, store, plan.generation, trainer.step + 1, exc, switching=True)


def _abandon(
    trainer: Trainer, store: Store, generation: int, step: int, exc: RuntimeError, switching: bool = False
) -> None:
    """This node abandons `step` of `generation` (or the switch to it). First the peers waiting for its
    part learn it (the notice, once the generation's world is this trainer's), then the operator, through
    the agent: with every node alive, no failure detector would publish the plan it now waits for
    (`operator/_aborts`)."""
    if trainer.generation == generation:
        trainer.notice.abandon()
    store.set(event_key("abort", generation, trainer.node), repr(time.time()))
    trainer.hooks.on_abort(generation, step, abort_line(exc), switching=switching)


def _record_losses(trainer: Trainer, store: Store) -> None:
    """After a rendezvous, record the losses a failure may have kept from the store, where it lacks them:
    of the steps this worker applied there (its peers had committed them; a replaced store starts empty),
    and, on the new world's rank 0, of the last step committed before the switch (the old rank 0 may have
    died between its commit and its record). Sample ids need nothing: they go in with each vote."""
    if trainer.local_rank == 0:
        committed = [trainer.last_committed] if trainer.world_rank == 0 else []
        for record in [*trainer.rolled, *committed]:
            if record is not None:
                store.compare_set(loss_key(record.step), "", f"{record.generation}:{record.loss!r}")
    trainer.rolled.clear()


def worker_main(
    node: int,
    config: JobConfig,
    host: str,
    port: int,
    hooks: StepHooks | None,
    restore: bool,
    local_rank: int = 0,
    store: Store | None = None,
) -> dict[str, object]:
    """Entry point of one worker process (started by the launcher through torch elastic): device
    `local_rank` of `node` (the plan's stages span as many devices as the node runs workers). `store`: the
    job's store at `host:port` as the caller connected it (a pod's worker reconnects: `_store_client`).
    `hooks`: called around the trainer's plans and steps (`hooks`: the pod's probe, a test
    harness's crash), or none."""
    torch.set_num_threads(1)
    # Each layer is checkpointed by one process (`no_dist=True` on purpose); DCP says so at every save, from
    # its writer thread, which would fill the pod's log.
    warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
    if store is None:
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=config.plan_timeout_s))
    workload = config.workload
    device = worker_device(workload.device, local_rank)
    model = config.load_model()
    dataset = config.open_dataset(model)
    plan = read_plan(store, read_generation(store))
    # Not in the newest plan, or started after the job trained (a replacement pod under a new node id): a
    # join, not a start. The node holds nothing; the plan that takes it in copies its layers to it.
    joining = not restore and (node not in world_nodes(plan) or int(store.add(COMMITTED_KEY, 0)) > 0)
    if joining:
        warm_up(device, workload.training)  # before it says it is ready: the switch waits on its receives
        store.set(joining_key(node), "1")
        try:
            found = wait_for_plan_with(store, node, plan, config.plan_timeout_s, config.steps)
        except JobFinished:
            return _finished_without(node, store)
        if found is None:
            return {"node": node, "step": 0, "left": True}
        plan = found
    degree = tp_degree(plan)
    checkpointer = config.checkpointer(shard=local_rank, shards=degree)
    trainer = Trainer(
        node=node,
        local_rank=local_rank,
        degree=degree,
        model=model,
        dataset=dataset,
        global_batch=plan.global_batch,
        training=workload.training,
        collective_timeout_s=config.collective_timeout_s,
        device=device,
        checkpoint_interval_s=workload.checkpoint.interval_s if checkpointer is not None else 0.0,
        joining=joining,
        hooks=hooks or StepHooks(),
        p2p_in_order=config.p2p_in_order,
    )
    if checkpointer is not None:
        trainer.on_rolled = lambda rolled: checkpoint_rolled(trainer, checkpointer, rolled, config.steps)
    if not joining:  # a joining node gets every layer it holds from its peers (the plan's transfers)
        trainer.init_layers(plan)
    restored: int | None = None
    if restore:
        if checkpointer is None:
            raise ValueError("checkpoint: a restart needs a checkpoint directory")
        restored = checkpointer.latest_complete(model.num_layers)
        # Whole layers load now; shards once the plan is joined and the layers are sharded.
        if restored is not None and degree == 1:
            for layer in trainer.layers.values():
                checkpointer.load(restored, layer)
        trainer.step = restored or 0  # nothing complete yet: start over from the initial weights
        if trainer.step >= config.steps:
            # The checkpoint is the trained model's: the job ended before this node could take part (a
            # replacement joining a restart as its last step committed). Taken back by the next plan and
            # left again by this one, it looped between training and probing, and the job never completed.
            trainer.close()
            return _finished_without(node, store)
    try:
        if not _settle(trainer, store, plan, config.plan_timeout_s, checkpointer, config.steps):
            return {"node": node, "step": trainer.step, "left": True}
    except JobFinished:
        trainer.close()
        return _finished_without(node, store)
    _load_shards(trainer, checkpointer, restored)
    resumed_generation = -1
    first_grads: dict[int, list[torch.Tensor]] = {}
    while trainer.step < config.steps:
        step = trainer.step
        began = time.perf_counter()
        try:
            loss, switch, _ = trainer.run_step(read_generation(store))
        except ComputeError:
            with contextlib.suppress(Exception):  # the error to report is the step's, not the close's
                trainer.close()  # its peers see the process go; an embedding caller gets its group back
            raise
        except ReconfigurationError:
            raise
        except RuntimeError as exc:
            _abandon(trainer, store, trainer.generation, step + 1, exc)
            new_plan = wait_for_plan_after(store, trainer.generation, config.plan_timeout_s)
            if not _settle(trainer, store, new_plan, config.plan_timeout_s, checkpointer):
                break
            continue
        if config.return_state and step == 0:
            first_grads = _grads(trainer.layers)
        if trainer.generation != resumed_generation:
            resumed_generation = trainer.generation
            if local_rank == 0:
                store.set(event_key("resumed", trainer.generation, node), repr(time.time()))
        if trainer.world_rank == 0:
            store.set(loss_key(step), f"{trainer.generation}:{loss!r}")
            store.set(COMMITTED_KEY, str(trainer.step))
            store.append(  # type: ignore[attr-defined]
                steptime_key(trainer.generation), f"{time.perf_counter() - began!r};"
            )
        # The last step is always saved: the trained model's layers that nobody holds any more come from it
        # if a worker dies while writing them out (`_final_export`).
        last = trainer.step >= config.steps
        due = checkpointer is not None and (checkpointer.due(trainer.step) or trainer.checkpoint_due or last)
        if checkpointer is not None and due and trainer.plan is not None:
            _save_step(checkpointer, trainer, trainer.step, trainer.plan)
            checkpointer.prune(trainer.model.num_layers, trainer.step)
        latest = read_plan(store, read_generation(store)) if switch else None
        if latest is not None and not _settle(trainer, store, latest, config.plan_timeout_s, checkpointer):
            break
    if checkpointer is not None:
        checkpointer.wait()
        # Its prune ran while the last step was still being written (asynchronously): judged again, on disk.
        checkpointer.prune(trainer.model.num_layers, trainer.step)
    finished = trainer.step >= config.steps
    if finished and workload.output is not None and trainer.active:
        tokenizer = Path(workload.data.tokenizer) if workload.data.tokenizer else None
        _export(trainer, store, Path(workload.output.path), checkpointer, tokenizer)
    result: dict[str, object] = {"node": node, "step": trainer.step, "left": not finished}
    if config.return_state and (degree == 1 or trainer.active):
        # Gathered over the stage's ranks (a collective when sharded: every local rank runs it, in order).
        result["params"] = {
            index: full_parameters(trainer.layers[index].module, degree) for index in sorted(trainer.layers)
        }
        result["first_grads"] = first_grads
        result["local_rank"] = local_rank
    trainer.close()
    return result


def checkpoint_rolled(trainer: Trainer, checkpointer: Checkpointer, rolled: RolledStep, steps: int) -> None:
    """Save a step this rank applied at a rendezvous (`Trainer.on_rolled`: its peers committed it, its own
    commit was lost) as its peers saved it when they committed it, with the layers it is the designated
    writer of under the plan that trained it: on the step interval, on the time interval (its peers' commit
    said so, `RolledStep.checkpoint`), and at the last step. Without this, a due step's checkpoint lacked
    this rank's layers, and a last step's left the trained model's fallback (`_final_export`) incomplete."""
    step = rolled.step + 1  # the committed steps once it is applied, as the training loop counts them
    if checkpointer.due(step) or rolled.checkpoint or step >= steps:
        _save_step(checkpointer, trainer, step, rolled.plan)


def _save_step(checkpointer: Checkpointer, trainer: Trainer, step: int, plan: Plan) -> None:
    """Save `step` (committed steps) with the layers this node is the designated writer of under `plan`,
    the plan that trained it."""
    owners = designated_holders(plan)
    mine = {i for i, owner in owners.items() if owner == trainer.node and i in trainer.layers}
    checkpointer.save(step, trainer.layers, mine)


def _finished_without(node: int, store: Store) -> dict[str, object]:
    """A replacement that joined as the job ended: its peers trained the last step and exported without it,
    so it ends as they did (its pod completes, and with it the generation that took it in)."""
    print(f"node {node}: the job trained its last step before this node could join", flush=True)
    return {"node": node, "step": int(store.add(COMMITTED_KEY, 0)), "left": False}


def _export(
    trainer: Trainer,
    store: Store,
    directory: Path,
    checkpointer: Checkpointer | None,
    tokenizer: Path | None = None,
) -> None:
    """Write the trained model in Hugging Face layout, whole even if a peer dies meanwhile
    (`_final_export`), with the data's tokenizer when the model's directory had none."""
    try:
        export_model(trainer, store, directory, checkpointer, tokenizer)
    except OSError as exc:
        # The spec's fault, not this node's: its pod says so, and the operator fails the job (`_termination`).
        reason = exc.strerror or type(exc).__name__
        raise WorkloadError(
            "spec.output.path", f"{directory}: cannot write the trained model: {reason}"
        ) from None


def run_from_plan(
    node: int,
    config: JobConfig,
    host: str,
    port: int,
    local_rank: int = 0,
    store: Store | None = None,
    hooks: StepHooks | None = None,
) -> dict[str, object]:
    """Train this node's share of the job's newest plan to `steps` committed steps, following every plan
    published after it; the entry point for a pod agent (one call per device, in its own process:
    `local_rank` j for the j-th device of the node's stage).

    The job's store at `host:port` must hold a plan (`publish_plan`). A plan of policy `checkpoint` after
    generation 0 means the job restarted: the worker loads the last complete checkpoint first.
    """
    if store is None:
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=config.plan_timeout_s))
    plan = read_plan(store, read_generation(store))
    # A node the restart left out (a replacement started after it) joins as any joiner does: it says it is
    # ready (`joining_key`) and waits for the plan that takes it in. Taken for one of the restart's nodes,
    # it restored the checkpoint, found no part in the plan and left, while the store host held the plan
    # with it until it said it was ready: the job never grew back, and ran on at the restart's size.
    restore = plan.policy == Policy.CHECKPOINT and plan.generation > 0 and node in world_nodes(plan)
    if restore and not config.checkpoint_dir:
        raise ValueError("checkpoint: the newest plan restarts from a checkpoint but none is configured")
    return worker_main(
        node,
        config,
        host,
        port,
        hooks,
        restore=restore,
        local_rank=local_rank,
        store=store,
    )


def _grads(layers: Mapping[int, LayerState]) -> dict[int, list[torch.Tensor]]:
    """The synchronised gradients of a step (optimizers leave them in place until the next step)."""
    return {
        index: [
            local(p.grad).clone() if p.grad is not None else torch.zeros_like(local(p))
            for p in layer.module.parameters()
        ]
        for index, layer in layers.items()
    }
