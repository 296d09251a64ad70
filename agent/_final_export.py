"""The trained model written out at the end of a job, whole even when a worker dies while it writes.

Every layer is written by one worker: the lowest live node holding it under the plan that trained the last
step (`writers`); config.json and the shard index by layer 0's writer. A worker marks each file it wrote in
the job's store (`store_keys.exported_key`) and exits only once every file is marked. A worker that dies
meanwhile is a failure like any other: its pod fails, the control plane plans the job around it, and under
that newer plan the next live holder of each of its layers writes the layer. A layer that no live node
holds any more (it had no replica) is read back from the checkpoint of the last step (every job with a
checkpoint path saves its last step) by the lowest live node. Without one, the job fails naming
`spec.output.path`: a job that says Succeeded has a model that loads.

Files are renamed into place (`hf_export`), so a layer written twice (a writer thought dead was slow) is
written whole both times, with the same weights. A store replaced meanwhile comes back empty under a newer
generation, and every worker marks again what it wrote.

With tensor-parallel stages a layer is gathered over the node's devices before its first device writes it,
a collective: the node's first device decides which layers to write and tells the others through the store
(`store_keys.export_round_key`), so that every device gathers the same layers in the same order. It
announces its rounds again on a replaced store (`_Rounds`), and waits for the others to have read the last
one: a round lost with the old store left them waiting `STALL_S`, then failing the job.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Set
from pathlib import Path

import torch
from torch._C._distributed_c10d import Store

from resilientjob.protocol.store_keys import export_ack_key, export_round_key, exported_key

from ._plan_store import read_generation, read_plan
from ._runtime_schedule import held_layers, world_nodes
from ._tensor_parallel import full_parameters
from ._termination import WorkloadError
from .checkpoint import Checkpointer, read_weights
from .runtime import Trainer

METADATA = -1
"""The item that stands for config.json, the shard index and the tokenizer files (written together)."""

STALL_S = 1800.0
"""How long a worker waits for the export to progress (a file marked, a newer plan) before it fails the job:
a writer that hangs without dying (its pod still Running) is never planned around. Long, since one layer of
a large model written to a network volume takes minutes."""

_POLL_S = 0.2
_COUNT_S = 10.0
"""How often the marks are counted for `STALL_S` (a round trip per file: not at every poll)."""


def writers(held: Mapping[int, Set[int]], live: Set[int], num_layers: int) -> dict[int, int | None]:
    """Layer -> the lowest live node that holds it (`held`: node -> layers), None when no live node does."""
    holders: dict[int, list[int]] = {index: [] for index in range(num_layers)}
    for node, layers in held.items():
        if node in live:
            for index in layers:
                holders[index].append(node)
    return {index: min(nodes) if nodes else None for index, nodes in holders.items()}


def assigned(node: int, held: Mapping[int, Set[int]], live: Set[int], num_layers: int) -> set[int]:
    """The items `node` writes while `live` are the live nodes: the layers it is the writer of, the metadata
    with layer 0, and, on the lowest live node, every layer no live node holds (from the checkpoint)."""
    chosen = writers(held, live, num_layers)
    mine = {index for index, writer in chosen.items() if writer == node}
    leader = min(live, default=None) == node
    if leader:
        mine |= {index for index, writer in chosen.items() if writer is None}
    if chosen.get(0) == node or (chosen.get(0) is None and leader):
        mine.add(METADATA)
    return mine


class _Rounds:
    """A tensor-parallel node's first device's export rounds, as announced to its other devices: kept, to be
    announced again on a store that was replaced (it starts empty), and closed by "done" once each of the
    others said it read that."""

    def __init__(self, node: int, degree: int) -> None:
        self.node, self.degree = node, degree
        self.announced: list[str] = []

    def announce(self, store: Store, text: str) -> None:
        store.set(export_round_key(self.node, len(self.announced)), text)
        self.announced.append(text)

    def replay(self, store: Store) -> None:
        for round_, text in enumerate(self.announced):
            store.set(export_round_key(self.node, round_), text)

    def finish(self, store: Store, deadline_s: float = STALL_S) -> bool:
        """Say "done" and wait until every other device read it, announcing the rounds again whenever the
        store was replaced (a newer generation) meanwhile; False when they did not within `deadline_s`."""
        self.announce(store, "done")
        acks = [export_ack_key(self.node, lane) for lane in range(1, self.degree)]
        seen, deadline = read_generation(store), time.monotonic() + deadline_s
        while not store.check(acks):
            if time.monotonic() > deadline:
                return False
            newest = read_generation(store)
            if newest > seen:
                seen = newest
                self.replay(store)
            time.sleep(_POLL_S)
        return True


def export_model(
    trainer: Trainer,
    store: Store,
    directory: Path,
    checkpointer: Checkpointer | None,
    tokenizer: Path | None = None,
) -> None:
    """Write this node's part of the trained model into `directory` and, on the node's first device, wait
    until the whole model is there (see the module's docstring); `tokenizer`: the data's, written with the
    metadata (`hf_export.write_metadata`). OSError when the directory cannot be written; WorkloadError
    naming `spec.output.path` when a layer can no longer be written."""
    if trainer.plan is None:
        return
    if trainer.local_rank > 0:
        _follow(trainer, store, directory)
        return
    num_layers = trainer.model.num_layers
    held = held_layers(trainer.plan)
    live = set(world_nodes(trainer.plan))
    every = {item: exported_key(item) for item in [*range(num_layers), METADATA]}
    seen, written = trainer.generation, set[int]()
    rounds = _Rounds(trainer.node, trainer.degree)
    todo = sorted(assigned(trainer.node, held, live, num_layers))
    progress = counted = time.monotonic()
    marked = 0
    while True:
        if todo:
            _check_sources(trainer, todo, directory, checkpointer, live)
            trainer.hooks.before_export(store, todo)
            if trainer.degree > 1:
                rounds.announce(store, json.dumps(todo))
            _write(trainer, todo, directory, checkpointer, tokenizer)
            for item in todo:
                store.set(every[item], str(trainer.node))
            written.update(todo)
            todo, progress = [], time.monotonic()
        if store.check(list(every.values())):
            break
        newest = read_generation(store)
        if newest > seen:  # a writer died and was planned around, or the store was replaced (marks lost)
            seen = newest
            live &= set(world_nodes(read_plan(store, newest)))
            for item in written:
                store.set(every[item], str(trainer.node))
            rounds.replay(store)  # the other devices may be waiting for a round the old store took along
            todo = sorted(assigned(trainer.node, held, live, num_layers) - written)
            progress = time.monotonic()
            continue
        if time.monotonic() - counted > _COUNT_S:
            counted = time.monotonic()
            now_marked = sum(1 for key in every.values() if store.check([key]))
            if now_marked != marked:
                marked, progress = now_marked, counted
        if time.monotonic() - progress > STALL_S:
            waiting = sorted(item for item, key in every.items() if not store.check([key]))
            chosen = writers(held, live, num_layers)
            named = ", ".join(
                "the metadata" if item == METADATA else f"layer {item} (node {chosen[item]})"
                for item in waiting
            )
            raise WorkloadError(
                "spec.output.path", f"{directory}: no file written for {STALL_S:.0f} s; still missing {named}"
            )
        time.sleep(_POLL_S)
    if trainer.degree > 1 and not rounds.finish(store):
        print(f"node {trainer.node}: its other devices did not say they finished the export", flush=True)
    print(
        f"node {trainer.node}: exported layers {sorted(i for i in written if i >= 0)} to {directory}",
        flush=True,
    )


def _follow(trainer: Trainer, store: Store, directory: Path) -> None:
    """A tensor-parallel stage's other devices: gather the layers the first device announces, round by
    round, until it says the model is whole."""
    round_ = 0
    while True:
        key = export_round_key(trainer.node, round_)
        deadline = time.monotonic() + STALL_S
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise WorkloadError(
                    "spec.output.path",
                    f"{directory}: the node's first device said nothing for {STALL_S:.0f} s",
                )
            time.sleep(_POLL_S)
        announced = store.get(key).decode()
        if announced == "done":
            store.set(export_ack_key(trainer.node, trainer.local_rank), "1")
            return
        _write(trainer, [int(item) for item in json.loads(announced)], directory, None)
        round_ += 1


def _check_sources(
    trainer: Trainer, todo: list[int], directory: Path, checkpointer: Checkpointer | None, live: Set[int]
) -> None:
    """Every layer of `todo` that this node does not hold must come from a whole checkpoint of the last
    step; else the trained model cannot be written whole."""
    lost = [item for item in todo if item != METADATA and item not in trainer.layers]
    if not lost:
        return
    complete = checkpointer.latest_complete(trainer.model.num_layers) if checkpointer is not None else None
    if complete == trainer.step:
        return
    reason = (
        "the job has no spec.checkpoint.path"
        if checkpointer is None
        else f"no whole checkpoint of step {trainer.step} holds them"
    )
    raise WorkloadError(
        "spec.output.path",
        f"{directory}: layers {lost} of the trained model have no holder left (live nodes "
        f"{sorted(live)}) and {reason}; `rjob export` writes the model of a checkpoint step the job kept",
    )


def _write(
    trainer: Trainer,
    items: list[int],
    directory: Path,
    checkpointer: Checkpointer | None,
    tokenizer: Path | None = None,
) -> None:
    """Write `items` (layers and the metadata); a layer this node does not hold is read from the checkpoint
    of the last step (its shards merged offline). A collective over the stage's devices for a layer held in
    tensor-parallel shards."""
    from .hf_export import write_layer, write_metadata

    for item in items:
        if item == METADATA:
            if trainer.local_rank == 0:
                write_metadata(trainer.model, directory, tokenizer=tokenizer)
            continue
        if item not in trainer.layers:  # nobody holds it any more: the last step's checkpoint does
            if trainer.local_rank == 0:
                assert checkpointer is not None  # `_check_sources` said so
                module = trainer.model.allocate(item)
                read_weights(checkpointer.directory, trainer.step, item, module, checkpointer.shards)
                write_layer(trainer.model, item, module, directory)
            continue
        module = trainer.layers[item].module
        if trainer.degree > 1:
            params = full_parameters(module, trainer.degree)  # every device of the stage takes part
            if trainer.local_rank:
                continue
            module = trainer.model.allocate(item)
            with torch.no_grad():
                for target, source in zip(module.parameters(), params, strict=True):
                    target.copy_(source)
        write_layer(trainer.model, item, module, directory)
