"""Atomic step commit, and the retirement of process groups a failure left with pending operations.

Why a vote: the runtime's commit all-reduce alone is not atomic. A peer killed inside it can leave it
completed on some ranks (gloo's ring finishes on a rank once that rank holds every chunk) and failed on
others, so survivors would stand one step apart. The vote makes the decision a property of the job's store:

1. After the gradient sum, every rank of the world votes for step s: `compare_set(commit/<g>/<s>/<rank>,
   "", "<its loss share>,<its squared-gradient-norm share>")`. One store round trip, and the rank's shares
   travel with it.
2. Then the commit all-reduce (loss and "newer plan seen" flag). A rank enters it only after its vote is in,
   so the all-reduce completing anywhere proves that every rank voted: the step is committed, and the
   fast path costs nothing more.
3. A rank whose all-reduce fails (a peer died or the failure notice tripped) closes the vote: it writes
   "abort" into every vote key that is still empty (`compare_set` is atomic, so each key is decided exactly
   once, by its voter or by a closer) and then reads every key. Every closer reads the same final values,
   so all survivors decide alike: commit if every rank had voted (a peer that dies after voting does not
   stop the step; the loss is the sum of the votes), abandon otherwise. A voter that finds its key already
   closed abandons without entering the all-reduce.

Result: all survivors are always at the same committed step; no snapshot or rollback is needed.

Why retirement: destroying a gloo group whose collective is still pending behind a dead peer joins the
group's worker threads, which stay blocked until the group's own timeout (and, with the GIL held, the whole
process stalls; a survivor hung for minutes in `~ProcessGroupGloo`). So after an abandoned step the trainer
keeps the old groups and their pending work alive in a `Retirement` for a few generations: by the time an
entry is dropped its operations have long failed with the collective timeout. Backends that can abort
pending operations (NCCL) are aborted instead, which frees them at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import torch.distributed as dist
from torch._C._distributed_c10d import Store

from resilientjob.protocol.store_keys import vote_key

_ABORT = "abort"


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

    def vote(self, shares: Sequence[float]) -> bool:
        """Record "ready" with this rank's shares of the step's sums (loss, squared gradient norm). False: a
        closer got there first (abandon the step)."""
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
