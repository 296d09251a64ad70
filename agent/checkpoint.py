"""Checkpoint fallback with `torch.distributed.checkpoint` (DCP): the path for failures beyond f.

Live recovery needs a surviving replica of every layer; when a stage lost all of them the job restarts from
the last complete checkpoint, losing at most one interval. Checkpoints are per layer, so a restarted job with
any new layout loads exactly the layers each worker holds: layer `i` of step `s` lives in
`<dir>/step<s>/layer<i>/` and is written by one designated holder (the lowest node id holding it). Writes use
`dcp.async_save` (a background thread, after a private copy so training can go on updating the weights);
DCP writes a layer's `.metadata` last, so a step counts as complete only when every layer has one.
`no_dist=True` because each layer is written by one process: no collective may block a checkpoint on a peer
that has just died (`_dcp_compat` finds the entry points of this torch that take it). With k devices per
stage (tensor parallelism) each layer is k shards: local rank j of the designated node writes shard j to
`layer<i>-tp<j>of<k>/`, and local rank j loads that shard back.

Steps are named by number only, so a directory holds one job's checkpoints: node 0's pre-flight `claim`s it
for the job (`namespace/name`, in `.resilientjob-owner`) before any worker trains, and a job whose path
another job holds fails naming `spec.checkpoint.path`; run there, each would restore the other's weights
and delete the other's steps. A job applied again under the same name is the same owner: it resumes.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .p2p import LayerState

if TYPE_CHECKING:
    from types import ModuleType


_STEP = re.compile(r"^step(\d+)$")
OWNER_FILE = ".resilientjob-owner"


def _dcp() -> ModuleType:
    """`_dcp_compat`, imported on first use: `torch.distributed.checkpoint` is about a second of CPU at every
    worker's start (`_dtensor`), which a job without checkpoints never repays. A `Checkpointer` imports it
    as it is made, at the worker's start, so no training step waits for it."""
    from . import _dcp_compat

    return _dcp_compat


class CheckpointTaken(Exception):
    """The checkpoint directory holds another job's checkpoints."""

    def __init__(self, directory: Path, holder: str) -> None:
        super().__init__(
            f"{directory} holds the checkpoints of job {holder} (its mark {OWNER_FILE} there; delete the "
            "mark once that job and its steps are gone)"
        )
        self.holder = holder


_NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK)
"""What `link` fails with where a file system has no hard links (object-store FUSE volumes)."""

_MARK_READ_S = 5.0
"""How long a loser waits for the winner's name where the mark is created empty first (no hard links)."""


def claim(directory: Path, job: str) -> None:
    """Mark `directory` as job `job`'s (`namespace/name`), or raise CheckpointTaken naming the job that
    holds it; OSError when it cannot be written. A directory of checkpoints from before owners were marked
    is claimed as it is. The mark appears whole or not at all (a hard link of a written file fails when the
    name exists), so of two jobs claiming at once one wins and the other reads the winner's name. Where the
    file system has no hard links the mark is created exclusively and then written: a loser reads it once
    it holds a name."""
    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / OWNER_FILE
    fd, written = tempfile.mkstemp(prefix=".owner-", dir=directory)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(job + "\n")
        os.chmod(written, 0o644)  # every job's workers read it, whatever user they run as
        os.link(written, marker)
        return
    except FileExistsError:
        holder = _holder(marker)
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        holder = _claim_exclusively(marker, job)
    finally:
        os.unlink(written)
    if holder != job:
        raise CheckpointTaken(directory, holder or "(unnamed)")


def _claim_exclusively(marker: Path, job: str) -> str:
    """The mark created (`O_EXCL`) and written where `link` is not possible; the holder's name."""
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return _holder(marker)
    with os.fdopen(fd, "w") as file:
        file.write(job + "\n")
    os.chmod(marker, 0o644)  # whatever the umask took away
    return job


def _holder(marker: Path) -> str:
    """The name in a mark; one created empty (no hard links) gets its name a moment later."""
    deadline = time.monotonic() + _MARK_READ_S
    while True:
        holder = marker.read_text(errors="replace").strip()
        if holder or time.monotonic() > deadline:
            return holder
        time.sleep(0.05)


@dataclass(slots=True)
class Checkpointer:
    """Saves this node's designated layers every `interval` committed steps; loads any layer back."""

    directory: Path
    interval: int
    """Checkpoint every this many committed steps; 0: only when the trainer asks (time interval)."""
    asynchronous: bool = True
    keep: int = 2
    """Complete checkpoints to keep; every worker deletes older ones after it saved (`prune`)."""
    shard: int = 0
    """This worker's local rank: the shard of each layer it writes and loads."""
    shards: int = 1
    """Shards per layer (devices per stage)."""
    _pending: list[Future[Any]] = field(default_factory=list)
    _writer: ThreadPoolExecutor | None = None
    """Our own background writer where this torch's `async_save` cannot skip collectives."""

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise ValueError(f"keep: must be >= 1, got {self.keep}")
        if self.interval < 0:
            raise ValueError(f"checkpoint_interval: must be >= 0 (0: only when asked), got {self.interval}")
        self.directory = Path(self.directory)
        if self.shards < 1:
            raise ValueError(f"shards: must be >= 1, got {self.shards}")
        if not 0 <= self.shard < self.shards:
            raise ValueError(f"shard: must be in [0, {self.shards}), got {self.shard}")
        _dcp()

    def _layer_dirs(self, index: int) -> list[str]:
        """Directory names of every shard of layer `index` (one, `layer<i>`, when layers are whole)."""
        if self.shards == 1:
            return [f"layer{index}"]
        return [f"layer{index}-tp{j}of{self.shards}" for j in range(self.shards)]

    def _complete(self, child: Path, num_layers: int) -> bool:
        return all(
            (child / name / ".metadata").exists() for i in range(num_layers) for name in self._layer_dirs(i)
        )

    def due(self, step: int) -> bool:
        """Whether `step` falls on the step interval (the time interval is the trainer's `checkpoint_due`)."""
        return step > 0 and self.interval > 0 and step % self.interval == 0

    def save(self, step: int, layers: dict[int, LayerState], owned: set[int]) -> None:
        """Write the layers this node is the designated writer of, as of `step` committed steps."""
        self._reap()
        for index in sorted(owned):
            # A copy in host memory: the async writer must see the weights of this step, not of the steps
            # that follow, and a copy on the accelerator would take another layer's state (weights and both
            # AdamW moments) of its memory at every save, which no plan budgets for.
            state = {
                name: tensor.detach().to("cpu", copy=True)
                for name, tensor in layers[index].named_tensors().items()
            }
            target = self.directory / f"step{step}" / self._layer_dirs(index)[self.shard]
            if self.asynchronous and _dcp().ASYNC_SAVE_NO_DIST:
                self._pending.append(_dcp().async_save_local(state, target))
            elif self.asynchronous:
                if self._writer is None:
                    self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
                self._pending.append(self._writer.submit(_dcp().save_local, state, target))
            else:
                _dcp().save_local(state, target)

    def _reap(self) -> None:
        done = [future for future in self._pending if future.done()]
        for future in done:
            future.result()
            self._pending.remove(future)

    def wait(self) -> None:
        """Block until every pending asynchronous save is on disk."""
        for future in self._pending:
            future.result()
        self._pending.clear()

    def complete_steps(self, num_layers: int) -> list[int]:
        """The steps whose every layer has been fully written, ascending."""
        steps = []
        if self.directory.exists():
            for child in self.directory.iterdir():
                match = _STEP.match(child.name)
                if match and self._complete(child, num_layers):
                    steps.append(int(match.group(1)))
        return sorted(steps)

    def latest_complete(self, num_layers: int) -> int | None:
        """Newest step whose every layer has been fully written, or None."""
        steps = self.complete_steps(num_layers)
        return steps[-1] if steps else None

    def prune(self, num_layers: int, current: int) -> None:
        """Delete the checkpoints older than the newest `keep` complete ones up to `current` (the step just
        saved), and any step left incomplete before them (a save cut short by a failure). A directory that
        never holds a complete checkpoint (an emptyDir of each pod: every node writes only its own layers)
        keeps its newest `keep` steps up to `current`. Steps past `current` are left alone: after a restart
        to an older step they are a run's leftovers that this one writes again, and a worker that counted
        them in deleted the step its peers were writing. Run by every worker after it saved, so a long job's
        checkpoints do not fill its volume; workers deleting the same step at once is harmless."""
        steps: list[int] = []
        complete: list[int] = []
        for child in self.directory.iterdir() if self.directory.exists() else ():
            match = _STEP.match(child.name)
            if match is None or int(match.group(1)) > current:
                continue
            steps.append(int(match.group(1)))
            if self._complete(child, num_layers):
                complete.append(steps[-1])
        kept = sorted(complete or steps)[-self.keep :]
        if len(kept) < self.keep:
            return
        for step in steps:
            if step < kept[0]:
                shutil.rmtree(self.directory / f"step{step}", ignore_errors=True)

    def discard_after(self, step: int) -> None:
        """Delete every step past `step`, the one the job restarted from: what a dead run saved there is
        not this run's past. Left, a step the new run saves again looked complete while it was being
        written (the dead run's `.metadata` of the layers not yet rewritten), and a restart then could load
        a mix of both runs. Called by every worker once the restart's step is agreed and before its first
        step, so that no peer can have saved a step of the new run yet."""
        for child in self.directory.iterdir() if self.directory.exists() else ():
            match = _STEP.match(child.name)
            if match is not None and int(match.group(1)) > step:
                shutil.rmtree(child, ignore_errors=True)

    def load(self, step: int, layer: LayerState) -> None:
        """Overwrite `layer`'s parameters and optimizer state in place from checkpoint `step`."""
        state = layer.named_tensors()
        with torch.no_grad():
            source = self.directory / f"step{step}" / self._layer_dirs(layer.index)[self.shard]
            _dcp().load_local(state, source)


def saved_shards(directory: Path) -> int:
    """How many tensor-parallel shards each layer of the checkpoints in `directory` was saved in (1: whole
    layers; `layer<i>-tp<j>of<k>/` directories: k)."""
    for child in sorted(directory.glob("step*/layer0-tp0of*")):
        match = re.fullmatch(r"layer0-tp0of(\d+)", child.name)
        if match is not None:
            return int(match.group(1))
    return 1


def _stored(source: Path) -> dict[str, Any]:
    """The tensors a layer directory holds: name -> its stored metadata (size, properties)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    return dict(FileSystemReader(source).read_metadata().state_dict_metadata)


def _layer_sources(directory: Path, step: int, index: int, shards: int) -> list[Path]:
    names = [f"layer{index}"] if shards == 1 else [f"layer{index}-tp{j}of{shards}" for j in range(shards)]
    return [directory / f"step{step}" / name for name in names]


def check_weights(
    directory: Path, step: int, index: int, layer: torch.nn.Module, shards: int
) -> list[dict[str, Any]]:
    """ValueError naming `model` unless checkpoint `step` holds layer `index`'s weights as `layer` has them
    (names and shapes, its tensor-parallel shards merged); reads the metadata only (`layer` may be `meta`),
    which it returns, shard by shard."""
    from ._tensor_parallel import merge_shards

    params = dict(layer.named_parameters())
    metadata = [_stored(source) for source in _layer_sources(directory, step, index, shards)]
    missing = sorted({name for name in params for stored in metadata if f"param.{name}" not in stored})
    if missing:
        raise ValueError(f"model: layer {index} has {missing[0]}, which step {step} of {directory} lacks")
    # Merged as `meta` tensors: the shapes of the whole layer, with nothing read.
    shapes = merge_shards(
        layer,
        [
            {name: torch.empty(tuple(stored[f"param.{name}"].size), device="meta") for name in params}
            for stored in metadata
        ],
    )
    for name, param in params.items():
        if tuple(shapes[name].shape) != tuple(param.shape):
            raise ValueError(
                f"model: layer {index}'s {name} has shape {list(param.shape)}, in step {step} of {directory} "
                f"{list(shapes[name].shape)}"
            )
    return metadata


def read_weights(directory: Path, step: int, index: int, layer: torch.nn.Module, shards: int) -> None:
    """Overwrite `layer` (a whole layer: unsharded) in place with layer `index`'s weights of checkpoint
    `step`, its tensor-parallel shards merged (`_tensor_parallel.merge_shards`); no process group and no
    optimizer state. ValueError naming `model` when the checkpoint's tensors are not the layer's."""
    from ._tensor_parallel import merge_shards

    metadata = check_weights(directory, step, index, layer, shards)
    params = dict(layer.named_parameters())
    loaded = []
    for source, stored in zip(_layer_sources(directory, step, index, shards), metadata, strict=True):
        state = {  # as stored (the runtime keeps float32 master weights): `copy_` below casts
            f"param.{name}": torch.empty(
                tuple(stored[f"param.{name}"].size), dtype=stored[f"param.{name}"].properties.dtype
            )
            for name in params
        }
        with warnings.catch_warnings():  # one process reads it: DCP says so at every load
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            _dcp().load_local(state, source)
        loaded.append({name: state[f"param.{name}"] for name in params})
    with torch.no_grad():
        for name, value in merge_shards(layer, loaded).items():
            params[name].copy_(value)
