"""The worker process: one per device, driven by plans the launcher publishes in the job's TCPStore.

Store layout (the launcher hosts the store; in a cluster the agent mirrors the operator's Redis plan into it):
  generation            newest plan generation (integer)
  plan/<g>              Plan JSON of generation g
  failures              failures announced so far (counter; a wait abandons its step when it grows)
  accounted/<g>         the failure count plan g was computed with
  applied/<g>           count of workers that finished switching to g
  loss/<step>           "<g>:<loss>" written by world rank 0 at each commit
  committed             committed steps so far
  samples/<step>        "<g>:<ids>;" appended by every node that computed losses in that step
  received/<g>          "<layer>,<src>,<dst>,<bytes>;" appended by receivers of the transfer plan
  event/...             timestamps of failures, aborts and resumes (for the recovery benchmark)
  steptime/<g>/<node>   seconds of each committed step under plan g (for the throughput benchmarks)

`publish_plan` and `announce_failures` are the writer's side (the launcher here; in a cluster the pod agent,
which mirrors the operator's Redis plan into the job's store), `run_from_plan` the worker's entry point.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
from torch._C._distributed_c10d import Store, TCPStore

from resilientjob.planner.plan import Plan, Policy

from ._runtime_schedule import held_layers
from ._runtime_wait import FAILURES_KEY, accounted_key
from ._tensor_parallel import full_parameters, local, tp_degree
from .checkpoint import Checkpointer
from .data import SyntheticDataset
from .models import load_model
from .p2p import LayerState
from .runtime import ReconfigurationError, Trainer

FAILURE_EXIT_CODE = 17


@dataclass(frozen=True, slots=True)
class JobConfig:
    """What every worker of a job needs besides the plan."""

    model: str = "gpt"
    model_options: dict[str, object] = field(default_factory=dict)
    num_samples: int = 256
    seed: int = 0
    lr: float = 3e-3
    steps: int = 10
    collective_timeout_s: float = 5.0
    """A collective or receive blocked on a dead peer fails after this long."""
    plan_timeout_s: float = 60.0
    """How long a worker waits for the next plan after a failure before giving up."""
    checkpoint_dir: str | None = None
    checkpoint_interval: int = 5
    async_checkpoint: bool = True
    return_state: bool = False
    """Return each worker's final layer parameters (tests compare them with the reference run)."""

    def __post_init__(self) -> None:
        for name in ("num_samples", "steps", "checkpoint_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("collective_timeout_s", "plan_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")


def publish_plan(store: Store, plan: Plan, failures_accounted: int) -> None:
    """Make `plan` the job's newest plan. `failures_accounted`: the failure count the plan was made with."""
    store.set(f"plan/{plan.generation}", plan.model_dump_json())
    # Written before the generation: a worker that sees the plan also sees which failures it covers.
    store.set(accounted_key(plan.generation), str(failures_accounted))
    store.set("generation", str(plan.generation))


def announce_failures(store: Store, count: int) -> int:
    """Tell every worker at once that `count` more peers died; returns the total announced so far."""
    return int(store.add(FAILURES_KEY, count))


def read_generation(store: Store) -> int:
    return int(store.add("generation", 0))


def read_plan(store: Store, generation: int) -> Plan:
    return Plan.model_validate_json(store.get(f"plan/{generation}"))


def wait_for_plan_after(store: Store, generation: int, timeout_s: float) -> Plan:
    """Block until a plan newer than `generation` is published; return the newest."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        latest = read_generation(store)
        if latest > generation:
            return read_plan(store, latest)
        time.sleep(0.02)
    raise TimeoutError(f"plan_timeout_s: no plan after generation {generation} within {timeout_s} s")


def _settle(trainer: Trainer, store: Store, plan: Plan, timeout_s: float) -> bool:
    """Apply `plan`, or the next one if a peer dies during the switch. False if this node is left out."""
    while True:
        try:
            joined = trainer.apply_plan(plan, store)
        except ReconfigurationError:
            raise
        except RuntimeError:
            plan = wait_for_plan_after(store, plan.generation, timeout_s)
            continue
        generation = plan.generation
        store.add(f"applied/{generation}", 1)  # every worker counts: the launcher expects nodes x degree
        timings = trainer.timings
        for record in trainer.received:
            if record.dst == trainer.node:
                store.append(  # type: ignore[attr-defined]
                    f"received/{generation}", f"{record.layer},{record.src},{record.dst},{record.bytes};"
                )
        trainer.received.clear()
        if trainer.local_rank > 0:  # events are per node: local rank 0 writes them
            return joined
        store.set(
            f"event/applied/{generation}/{trainer.node}",
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


def worker_main(
    node: int,
    config: JobConfig,
    host: str,
    port: int,
    fail_at: int | None,
    restore: bool,
    local_rank: int = 0,
) -> dict[str, object]:
    """Entry point of one worker process (started by the launcher through torch elastic): device
    `local_rank` of `node` (the plan's stages span as many devices as the node runs workers)."""
    torch.set_num_threads(1)
    store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=config.plan_timeout_s))
    model = load_model(config.model, **config.model_options)
    dataset = SyntheticDataset(config.num_samples, seq_len=model.seq_len, vocab=model.vocab, seed=config.seed)
    plan = read_plan(store, read_generation(store))
    degree = tp_degree(plan)
    trainer = Trainer(
        node=node,
        local_rank=local_rank,
        degree=degree,
        model=model,
        dataset=dataset,
        global_batch=plan.global_batch,
        lr=config.lr,
        collective_timeout_s=config.collective_timeout_s,
    )
    checkpointer = (
        Checkpointer(
            Path(config.checkpoint_dir),
            config.checkpoint_interval,
            config.async_checkpoint,
            shard=local_rank,
            shards=degree,
        )
        if config.checkpoint_dir
        else None
    )
    trainer.init_layers(plan)
    restored: int | None = None
    if restore:
        if checkpointer is None:
            raise ValueError("checkpoint_dir: a restart needs a checkpoint directory")
        restored = checkpointer.latest_complete(model.num_layers)
        # Whole layers load now; shards once the plan is joined and the layers are sharded.
        if restored is not None and degree == 1:
            for layer in trainer.layers.values():
                checkpointer.load(restored, layer)
        trainer.step = restored or 0  # nothing complete yet: start over from the seeded initial weights
    if not _settle(trainer, store, plan, config.plan_timeout_s):
        return {"node": node, "step": trainer.step, "left": True}
    if checkpointer is not None and restored is not None and degree > 1:
        for layer in trainer.layers.values():
            checkpointer.load(restored, layer)
    resumed_generation = -1
    first_grads: dict[int, list[torch.Tensor]] = {}
    while trainer.step < config.steps:
        if fail_at is not None and trainer.step == fail_at:
            store.set(f"event/fail/{node}", repr(time.time()))
            os._exit(FAILURE_EXIT_CODE)  # a crash: no cleanup, peers find out from their sockets
        step = trainer.step
        began = time.perf_counter()
        try:
            loss, switch, ids = trainer.run_step(read_generation(store))
        except ReconfigurationError:
            raise
        except RuntimeError:
            store.set(f"event/abort/{trainer.generation}/{node}", repr(time.time()))
            new_plan = wait_for_plan_after(store, trainer.generation, config.plan_timeout_s)
            if not _settle(trainer, store, new_plan, config.plan_timeout_s):
                break
            continue
        if config.return_state and step == 0:
            first_grads = _grads(trainer.layers)
        if trainer.generation != resumed_generation:
            resumed_generation = trainer.generation
            if local_rank == 0:
                store.set(f"event/resumed/{trainer.generation}/{node}", repr(time.time()))
        if trainer.world_rank == 0:
            store.set(f"loss/{step}", f"{trainer.generation}:{loss!r}")
            store.set("committed", str(trainer.step))
            store.append(  # type: ignore[attr-defined]
                f"steptime/{trainer.generation}", f"{time.perf_counter() - began!r};"
            )
        if ids:
            store.append(  # type: ignore[attr-defined]
                f"samples/{step}", f"{trainer.generation}:{','.join(map(str, ids))};"
            )
        if checkpointer is not None and checkpointer.due(trainer.step) and trainer.plan is not None:
            owners = _designated_writers(trainer.plan)
            checkpointer.save(
                trainer.step, trainer.layers, {i for i, owner in owners.items() if owner == node}
            )
        latest = read_plan(store, read_generation(store)) if switch else None
        if latest is not None and not _settle(trainer, store, latest, config.plan_timeout_s):
            break
    if checkpointer is not None:
        checkpointer.wait()
    result: dict[str, object] = {"node": node, "step": trainer.step, "left": trainer.step < config.steps}
    if config.return_state and (degree == 1 or trainer.active):
        # Gathered over the stage's ranks (a collective when sharded: every local rank runs it, in order).
        result["params"] = {
            index: full_parameters(trainer.layers[index].module, degree) for index in sorted(trainer.layers)
        }
        result["first_grads"] = first_grads
        result["local_rank"] = local_rank
    trainer.close()
    return result


def run_from_plan(
    node: int, config: JobConfig, host: str, port: int, local_rank: int = 0
) -> dict[str, object]:
    """Train this node's share of the job's newest plan to `config.steps` committed steps, following every
    plan published after it; the entry point for a pod agent (one call per device, in its own process:
    `local_rank` j for the j-th device of the node's stage).

    The job's store at `host:port` must hold a plan (`publish_plan`). A plan of policy `checkpoint` after
    generation 0 means the job restarted: the worker loads the last complete checkpoint first.
    """
    store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=config.plan_timeout_s))
    plan = read_plan(store, read_generation(store))
    restore = plan.policy == Policy.CHECKPOINT and plan.generation > 0
    if restore and not config.checkpoint_dir:
        raise ValueError("checkpoint_dir: the newest plan restarts from a checkpoint but none is configured")
    return worker_main(node, config, host, port, fail_at=None, restore=restore, local_rank=local_rank)


def _grads(layers: Mapping[int, LayerState]) -> dict[int, list[torch.Tensor]]:
    """The synchronised gradients of a step (optimizers leave them in place until the next step)."""
    return {
        index: [
            local(p.grad).clone() if p.grad is not None else torch.zeros_like(local(p))
            for p in layer.module.parameters()
        ]
        for index, layer in layers.items()
    }


def _designated_writers(plan: Plan) -> dict[int, int]:
    """Layer -> the lowest node holding it: exactly one writer per layer per checkpoint."""
    owners: dict[int, int] = {}
    for node, layers in sorted(held_layers(plan).items()):
        for layer in layers:
            owners.setdefault(layer, node)
    return owners


def reference_run(
    config: JobConfig, global_batch: int, microbatch_size: int
) -> tuple[list[float], dict[int, list[torch.Tensor]], dict[int, list[torch.Tensor]]]:
    """The failure-free single-process run of the same job (same seed, data order and global batch)."""
    from .data import SampleOrder
    from .models import lm_loss

    model = load_model(config.model, **config.model_options)
    dataset = SyntheticDataset(config.num_samples, seq_len=model.seq_len, vocab=model.vocab, seed=config.seed)
    order = SampleOrder(config.num_samples, global_batch, seed=config.seed)
    layers = [LayerState(index, model.layer(index), lr=config.lr) for index in range(model.num_layers)]
    losses = []
    first_grads: dict[int, list[torch.Tensor]] = {}
    for step in range(config.steps):
        for layer in layers:
            layer.zero_grad()
        total = 0.0
        for microbatch in range(global_batch // microbatch_size):
            inputs, targets = dataset.batch(order.microbatch_ids(step, microbatch, microbatch_size))
            x = inputs
            for layer in layers:
                x = layer.module(x)
            loss = lm_loss(x, targets) / global_batch
            torch.autograd.backward([loss])
            total += float(loss.detach())
        if step == 0:
            first_grads = _grads(dict(enumerate(layers)))
        for layer in layers:
            layer.optimizer.step()
        losses.append(total)
    params = {layer.index: [p.detach().clone() for p in layer.module.parameters()] for layer in layers}
    return losses, params, first_grads
