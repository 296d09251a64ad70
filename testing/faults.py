"""Fault injection for the test harness: a worker that crashes at the start of a given step, or as it starts
writing the trained model out, or stalls at a step with every process alive.

torchft's `fail_at(rank, step)` style: the worker leaves through `os._exit` (no clean-up, no flushed
sockets), exactly as a killed process, so its peers find out from their collectives and the store. The
product's only seam is the trainer's hooks (`agent.hooks.StepHooks`, handed to `worker.worker_main`);
what happens there lives here.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from torch._C._distributed_c10d import Store

from resilientjob.agent.hooks import StepHooks
from resilientjob.protocol.store_keys import fail_event_key

FAILURE_EXIT_CODE = 17
"""The exit status of a crashed worker (any non-zero status is a failure to torch elastic)."""


@dataclass(frozen=True, slots=True)
class CrashAt(StepHooks):
    """Trainer hooks that kill node `node`'s worker when step `step` begins, after recording the moment in
    the job's store (`store_keys.fail_event_key`) for the recovery's timeline. Picklable: torch elastic hands
    it to the worker process."""

    node: int
    step: int

    def before_step(self, store: Store | None, generation: int, step: int, world_rank: int | None) -> None:
        if step == self.step and store is not None:
            store.set(fail_event_key(self.node), repr(time.time()))
            os._exit(FAILURE_EXIT_CODE)  # a crash: no cleanup, peers find out from their sockets


@dataclass(frozen=True, slots=True)
class CrashAtExport(StepHooks):
    """Trainer hooks that kill node `node`'s worker as it is about to write its first file of the trained
    model, after the job trained its last step (a node lost while the model is written out)."""

    node: int

    def before_export(self, store: Store, items: list[int]) -> None:
        store.set(fail_event_key(self.node), repr(time.time()))
        os._exit(FAILURE_EXIT_CODE)


@dataclass(frozen=True, slots=True)
class StallAt(StepHooks):
    """Trainer hooks that hold node `node`'s worker for `seconds` when step `step` begins (a stuck kernel
    that comes back): its peers' waits on it run past their collective timeout, with every process
    alive."""

    node: int
    step: int
    seconds: float

    def before_step(self, store: Store | None, generation: int, step: int, world_rank: int | None) -> None:
        if step == self.step:
            time.sleep(self.seconds)
