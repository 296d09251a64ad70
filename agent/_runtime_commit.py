"""Atomic step commit, and the retirement of process groups a failure left with pending operations.

Why a vote: the runtime's commit all-reduce alone is not atomic. A peer killed inside it can leave it
completed on some ranks (gloo's ring finishes on a rank once that rank holds every chunk) and failed on
others, so survivors would stand one step apart. The vote makes the decision a property of the job's store:

1. After the gradient sum, every rank of the world votes for step s: `compare_set(commit/<g>/<s>/<rank>,
   "", "<its loss share>,<its squared-gradient-norm share>")`. One store round trip, and the rank's shares
   travel with it. Just before, it appends the ids of the samples it computed losses for to the step's
   record (`samples/<s>`, under g): a committed step proves every rank voted, so its record is whole even
   when a voter dies right after voting. An abandoned step's entries are superseded by the later
   generation that trains it again.
2. Then the commit all-reduce (loss and "newer plan seen" flag). A rank enters it only after its vote is in,
   so the all-reduce completing anywhere proves that every rank voted: the step is committed, and the
   fast path costs nothing more.
3. A rank whose all-reduce fails (a peer died or the failure notice tripped) closes the vote: it writes
   "abort" into every vote key that is still empty (`compare_set` is atomic, so each key is decided exactly
   once, by its voter or by a closer) and then reads every key. Every closer reads the same final values,
   so all survivors decide alike: commit if every rank had voted (a peer that dies after voting does not
   stop the step; the loss is the sum of the votes), abandon otherwise. A voter that finds its key already
   closed abandons without entering the all-reduce.

Result: all survivors are always at the same committed step; no snapshot or rollback is needed, as long as
the store keeps the votes.

Why a catch-up at the rendezvous (`agree_on_step`): the votes live in the job's store, and a store that is
replaced (its pod died and was created again, empty) loses them. A rank whose commit all-reduce timed out
then closes the vote on the new store, finds no votes and abandons, while the ranks whose all-reduce had
completed committed: the survivors meet the next rendezvous one step apart. The all-reduce completing on any
rank proves that every rank had voted, and a rank votes only after its gradient sums, so each rank behind
still holds the summed gradients of the step its peers committed. It applies that step there (the same
clipping, from the squared norm the committed ranks bring, and the same learning rate): every replica's
weights and optimizer state end as if it had committed with them. Steps further apart, or a rank behind
whose gradients are gone, still stop the job (`ReconfigurationError`: the checkpoint path must take over).

Why retirement: destroying a gloo group whose collective is still pending behind a dead peer joins the
group's worker threads, which stay blocked until the group's own timeout (and, with the GIL held, the whole
process stalls; a survivor hung for minutes in `~ProcessGroupGloo`). So after an abandoned step the trainer
keeps the old groups and their pending work alive in a `Retirement` for a few generations: by the time an
entry is dropped its operations have long failed with the collective timeout. Backends that can abort
pending operations (NCCL) are aborted instead, which frees them at once.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from resilientjob.planner.plan import Plan
from resilientjob.protocol.store_keys import samples_key, vote_key

from ._data_files import DataError
from ._runtime_wait import Wait
from ._termination import WorkloadError
from .data import ORDER_VERSION

_ABORT = "abort"
_NOBODY = -(2**62)
"""What a joining rank votes for the lowest step in the agreement: it has no step of its own."""


class ReconfigurationError(RuntimeError):
    """The new world cannot resume live (workers disagree on the step); the checkpoint path must take over."""


class CommitPhase(StrEnum):
    """Points of a step where a fault can be injected (tests kill a worker there, torchft style)."""

    VOTE = "vote"
    """Gradients summed; this rank has not voted yet."""
    VOTED = "voted"
    """This rank's vote is in; the commit all-reduce has not started."""
    REDUCED = "reduced"
    """The commit all-reduce completed on this rank; its optimizers have not stepped."""


FaultHook = Callable[[int, CommitPhase], None]
"""Called as hook(step, phase) at every `CommitPhase` of every step (fault injection in tests)."""


@dataclass(frozen=True, slots=True)
class CommitVote:
    """The store-side vote of one step of one generation (see the module doc)."""

    store: Store
    generation: int
    step: int
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size: must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: must be in [0, {self.world_size}), got {self.rank}")
        if self.step < 0:
            raise ValueError(f"step: must be >= 0, got {self.step}")

    def vote(self, shares: Sequence[float], sample_ids: Sequence[int] = ()) -> bool:
        """Record "ready" with this rank's shares of the step's sums (loss, squared gradient norm), after
        appending `sample_ids` (the samples whose loss this rank computed) to the step's record. False: a
        closer got there first (abandon the step)."""
        if sample_ids:
            record = f"{self.generation}:{','.join(map(str, sample_ids))};"
            self.store.append(samples_key(self.step), record)  # type: ignore[attr-defined]
        key = vote_key(self.generation, self.step, self.rank)
        text = ",".join(repr(float(value)) for value in shares)
        return bytes(self.store.compare_set(key, "", text)) != _ABORT.encode()

    def close(self) -> list[float] | None:
        """Block every vote not yet cast, then decide: the element-wise sums of the shares if every rank had
        voted (commit), None if some rank had not (abandon). Every caller gets the same answer."""
        values = [
            bytes(self.store.compare_set(vote_key(self.generation, self.step, rank), "", _ABORT))
            for rank in range(self.world_size)
        ]
        if any(value == _ABORT.encode() for value in values):
            return None
        rows = [[float(item) for item in value.decode().split(",")] for value in values]
        return [sum(column) for column in zip(*rows, strict=True)]


@dataclass(frozen=True, slots=True)
class _Retired:
    generation: int
    keep: tuple[object, ...]
    """Process groups and pending work items; holding them is the point (see the module doc)."""


@dataclass(slots=True)
class Retirement:
    """Old process groups kept alive after an abandoned step, at most `capacity` generations of them."""

    capacity: int = 8
    """Generations kept. Each entry's pending operations end with the collective timeout, which passes
    long before `capacity` further reconfigurations; the bound caps the threads and sockets held."""
    _entries: deque[_Retired] = field(init=False)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {self.capacity}")
        self._entries = deque(maxlen=self.capacity)

    def retire(self, generation: int, keep: list[object]) -> None:
        """Keep the groups and work items of `generation`; the oldest entry goes once full."""
        self._entries.append(_Retired(generation, tuple(keep)))

    def generations(self) -> list[int]:
        return [entry.generation for entry in self._entries]

    def __len__(self) -> int:
        return len(self._entries)


def leave_world(retirement: Retirement, generation: int, keep: list[object], abandoned: bool) -> None:
    """Leave the current default process group (and its subgroups).

    After a clean step nothing is pending and the groups are destroyed. After an abandoned step the groups
    may have operations blocked on a dead peer: an NCCL world is aborted (that breaks them), any other
    backend's groups are retired, then unregistered without running their destructors."""
    if not dist.is_initialized():
        return
    if not abandoned:
        dist.destroy_process_group()
        return
    if dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()
        return
    world = dist.distributed_c10d._get_default_group()
    retirement.retire(generation, [world, *keep])
    dist.destroy_process_group()


@dataclass(frozen=True, slots=True)
class VotedStep:
    """The step this rank voted for and has not applied: its gradients are that step's whole-batch sums."""

    generation: int
    step: int
    plan: Plan
    """The plan it was trained under: which layers this rank holds, and checkpoints, for it."""


@dataclass(frozen=True, slots=True)
class CommittedStep:
    """The last step this rank committed: what a rank left behind needs to apply it the same way, and what
    the next world's rank 0 records if the old one died before it could."""

    generation: int
    step: int
    loss: float
    sq_norm: float
    checkpoint: bool = False
    """World rank 0's clock asked for a checkpoint of it (the time interval), in its commit all-reduce."""


@dataclass(frozen=True, slots=True)
class RolledStep:
    """A step this rank applied at a rendezvous because its peers had committed it (see the module doc)."""

    generation: int
    """The generation that trained it: its loss record carries that one (its sample ids were recorded with
    its vote)."""
    step: int
    loss: float
    sq_norm: float
    plan: Plan
    """The plan it was trained under (`VotedStep.plan`)."""
    checkpoint: bool = False
    """Its peers checkpointed it on the time interval (`CommittedStep.checkpoint`): so must this rank."""


def reduce_dtype(device: torch.device) -> torch.dtype:
    """The float type of the commit's and the catch-up's all-reduces: float64, except on an Ascend NPU,
    whose HCCL reduces no float64 (float32 then: the loss and squared norm keep seven digits)."""
    return torch.float32 if device.type == "npu" else torch.float64


def agree_on_step(
    step: int,
    joining: bool,
    voted: VotedStep | None,
    committed: CommittedStep | None,
    comm_device: torch.device,
    wait: Wait,
    num_samples: int = 0,
    data_fingerprint: int = 0,
    order_version: int = ORDER_VERSION,
) -> tuple[int, RolledStep | None]:
    """The step every rank of a new world resumes at, and the step this rank must apply first to get there
    (None when it is there already). A collective: every rank of the world calls it, right after joining.

    A joining rank has no step of its own: it votes for neither bound and takes the agreed one. Ranks one
    step behind catch up if they can (module doc); otherwise every rank raises `ReconfigurationError`.

    Every rank also states how many samples its data set holds (`num_samples`) and a digest of a few of
    them (`data_fingerprint`, `data.fingerprint`): the order of the samples follows from the first, and
    two ranks that opened different data (a file that grew or was replaced while the job ran, nodes with
    different copies) would feed one micro-batch's first and last stages different samples without
    anything failing. Every rank then raises `DataError` naming `spec.data.path`. So with the version of the
    sample order of its image (`data.ORDER_VERSION`): `WorkloadError` naming `spec.image`."""
    mine = (0, _NOBODY) if joining else (step, -step)
    stated = [num_samples, -num_samples, data_fingerprint, -data_fingerprint, order_version, -order_version]
    bounds = torch.tensor([*mine, *stated], dtype=torch.int64, device=comm_device)
    wait(dist.all_reduce(bounds, op=dist.ReduceOp.MAX, async_op=True), "step agreement")
    high, low = int(bounds[0]), -int(bounds[1])
    most, fewest = int(bounds[2]), -int(bounds[3])
    if most != fewest:
        raise DataError(
            "spec.data.path",
            f"the workers opened data sets of {fewest} to {most} samples: the data changed while the job "
            "ran, or the nodes read different copies",
        )
    if int(bounds[6]) != -int(bounds[7]):
        raise WorkloadError(
            "spec.image",
            f"the workers' images order the samples differently (versions {-int(bounds[7])} to "
            f"{int(bounds[6])}): a tag such as :latest was pulled at different times; pin the image by "
            "digest",
        )
    if int(bounds[4]) != -int(bounds[5]):
        raise DataError(
            "spec.data.path",
            f"the workers opened data sets of {num_samples} samples with different contents: the data "
            "changed while the job ran, or the nodes read different copies",
        )
    if low in (high, -_NOBODY):  # agreed (or a world of joiners only)
        return high, None
    if high != low + 1:
        raise ReconfigurationError(f"step: workers disagree ({low}..{high})")
    behind = not joining and step == low
    stuck = behind and (voted is None or voted.step != low)
    ahead = not joining and step == high and committed is not None and committed.step == low
    facts = torch.tensor(
        [
            committed.sq_norm if ahead and committed is not None else -math.inf,
            committed.loss if ahead and committed is not None else -math.inf,
            1.0 if stuck else 0.0,
            1.0 if ahead and committed is not None and committed.checkpoint else 0.0,
        ],
        dtype=reduce_dtype(comm_device),
        device=comm_device,
    )
    wait(dist.all_reduce(facts, op=dist.ReduceOp.MAX, async_op=True), "step catch-up")
    sq_norm, loss, someone_stuck, checkpoint = (float(value) for value in facts.tolist())
    if someone_stuck > 0 or sq_norm == -math.inf:
        raise ReconfigurationError(
            f"step: workers disagree ({low}..{high}); a worker behind no longer holds step {low}'s gradients"
        )
    if not behind or voted is None:
        return high, None
    return high, RolledStep(voted.generation, low, loss, sq_norm, voted.plan, checkpoint > 0)
