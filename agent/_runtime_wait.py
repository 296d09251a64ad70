"""Waiting on a collective or a message without staying stuck behind a dead peer.

A gloo receive from a peer that is alive but itself blocked (on the dead node, further up the pipeline) only
fails when the process group's timeout fires: gloo's `abort()` does not break pending operations, and a
pending receive's `is_completed()` does not change until somebody calls `wait()`. So the blocking `wait()`
runs on a helper thread and the worker thread waits on that thread's future, looking at the job's failure
notice in the store between slices. The launcher (in a cluster: the agent, from the operator's view) bumps
the `failures` counter the moment it sees a worker die; every plan records how many failures it accounts
for, so any increase beyond that means "abandon this step". Recovery is then bounded by detection plus one
slice, not by the collective timeout.

A world can also break with every worker alive: a reset connection fails one rank's collective, and the
ranks waiting for that rank's part would wait out their collective timeout (`collective_timeout_s`, 5 s in
a pod, on any backend: `Waiter` gives up at it) before they abandon the step too and the operator can
re-form the world (`operator/_aborts`). So a rank that abandons a step says so in its generation's
`abandoned` counter (`FailureNotice.abandon`), which trips every other rank's notice of that generation at
its next look.

An abandoned `wait()` keeps its helper thread until the old group's own timeout fires; the old group can be
destroyed and a new one created meanwhile (the pending operation only ever touches the old group's buffers).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from resilientjob.protocol.store_keys import FAILURES_KEY, abandoned_key, accounted_key


class PeerFailure(RuntimeError):
    """A peer failed (announced in the store) or did not answer in time: abandon the current step."""


class ComputeError(Exception):
    """This worker's own computation failed (the model's code, out of memory, the device), not a peer: no
    new plan would help, so the worker waits for none and exits with the error, which its log shows. Not a
    RuntimeError on purpose: the worker takes any RuntimeError of a step for a peer's failure (gloo reports
    a dead peer as a plain RuntimeError), and a user's shape error or an out-of-memory taken so left the
    worker waiting `plan_timeout_s` for a plan nobody published, then dying of a TimeoutError that hid it."""


Wait = Callable[[dist.Work | None, str], None]
"""How the runtime waits on a work item (`Trainer._wait`): abandonable, bounded, `what` names it in errors."""


@dataclass(slots=True)
class FailureNotice:
    """Reads the job's failure counter; trips once it exceeds what the current plan accounts for, or once a
    rank of `generation` abandoned its step."""

    store: Store | None
    accounted: int = 0
    check_every_s: float = 0.02
    """Seconds between two looks at the store while a wait is in progress."""
    generation: int | None = None
    """The plan generation whose world this notice guards (None: no such world, only deaths count)."""

    def __post_init__(self) -> None:
        if self.check_every_s <= 0:
            raise ValueError(f"check_every_s: must be > 0, got {self.check_every_s}")
        if self.accounted < 0:
            raise ValueError(f"accounted: must be >= 0, got {self.accounted}")

    @classmethod
    def for_generation(cls, store: Store, generation: int, check_every_s: float = 0.02) -> FailureNotice:
        """The notice for a plan; a plan published without a count accounts for every failure so far."""
        key = accounted_key(generation)
        accounted = int(store.get(key)) if store.check([key]) else int(store.add(FAILURES_KEY, 0))
        return cls(store, accounted, check_every_s, generation)

    def failures(self) -> int:
        return 0 if self.store is None else int(self.store.add(FAILURES_KEY, 0))

    def tripped(self) -> bool:
        if self.failures() > self.accounted:
            return True
        if self.store is None or self.generation is None:
            return False
        return int(self.store.add(abandoned_key(self.generation), 0)) > 0

    def abandon(self) -> None:
        """Tell every rank of this generation that this one abandoned its step: their waits abandon it too,
        at their next look, instead of waiting out the collective timeout for this rank's part."""
        if self.store is not None and self.generation is not None:
            self.store.add(abandoned_key(self.generation), 1)


@dataclass(slots=True)
class Waiter:
    """Waits on `torch.distributed` work items, abandoning them when the failure notice trips."""

    timeout_s: float
    """A wait that makes no progress for this long fails even without a notice (the collective timeout)."""
    threads: int = 16
    """Helper threads; abandoned waits hold one each until their group's timeout, so keep a few spare."""
    device: str = "cpu"
    """The worker's device, made current in every helper thread: the current device is per thread, and an
    NCCL `wait()` orders the calling thread's current stream, so a helper left on device 0 gave every
    worker of a node a context on the node's first GPU (an NPU thread without one fails outright)."""
    _pool: ThreadPoolExecutor = field(init=False)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.threads < 1:
            raise ValueError(f"threads: must be >= 1, got {self.threads}")
        self._pool = ThreadPoolExecutor(
            max_workers=self.threads,
            thread_name_prefix="rjob-wait",
            initializer=_use_device,
            initargs=(self.device,),
        )

    def wait(self, work: dist.Work | None, notice: FailureNotice, what: str) -> None:
        """Return once `work` completed; raise PeerFailure if a failure is announced or time runs out, and
        the operation's own RuntimeError if it failed (a peer's socket closed)."""
        if work is None:  # this rank is not part of the group: nothing to wait for
            return
        deadline = time.monotonic() + self.timeout_s
        future: Future[bool] = self._pool.submit(until_complete, work, deadline)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerFailure(f"{what}: no progress within {self.timeout_s} s")
            try:
                completed = future.result(timeout=min(notice.check_every_s, remaining))
            except FutureTimeout:
                if notice.tripped():
                    raise PeerFailure(f"{what}: abandoned, a peer failed") from None
                continue
            # The helper gives up at the same deadline: its False can come back within the last slice,
            # before this loop sees the deadline pass, and is not a completion.
            if completed:
                return
            raise PeerFailure(f"{what}: no progress within {self.timeout_s} s")

    def wait_all(self, works: list[dist.Work], notice: FailureNotice, what: str) -> None:
        for work in works:
            self.wait(work, notice, what)

    def close(self) -> None:
        """Stop accepting work; threads stuck on abandoned operations end with their group's timeout."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _use_device(device: str) -> None:
    """Make `device` this thread's current accelerator (nothing to do on the CPU)."""
    kind, _, index = device.partition(":")
    if kind in ("cuda", "npu"):
        getattr(torch, kind).set_device(int(index or 0))


def until_complete(work: dist.Work, give_up_at: float = math.inf) -> bool:
    """Block this helper thread until `work` has finished on the host's view (False: `give_up_at` on the
    monotonic clock passed first). An NCCL or HCCL `wait()` only orders the current stream after the
    operation and returns at once; were the trainer to learn of a dead peer only at its next host
    synchronisation (a loss read), it would wait for the backend's watchdog, which kills the process,
    instead of the failure notice. Polling `is_completed` keeps every wait abandonable, and the deadline
    (the waiter's own, by which it has abandoned the wait) frees the thread: an operation on a dead peer
    may never complete, and each such poll held one of the pool's threads for good."""
    work.wait()
    completed = getattr(work, "is_completed", None)  # every c10d Work has it; a bare future may not
    while completed is not None and not completed():
        if time.monotonic() > give_up_at:
            return False
        time.sleep(0.0002)
    return True
