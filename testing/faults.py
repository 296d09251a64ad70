"""Fault injection for the test harness: a worker that crashes at the start of a given step.

torchft's `fail_at(rank, step)` style: the worker leaves through `os._exit` (no clean-up, no flushed
sockets), exactly as a killed process, so its peers find out from their collectives and the store. The
product's only seam is `worker.worker_main`'s `before_step` hook; what happens there lives here.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from torch._C._distributed_c10d import Store

from resilientjob.protocol.store_keys import fail_event_key

FAILURE_EXIT_CODE = 17
"""The exit status of a crashed worker (any non-zero status is a failure to torch elastic)."""


@dataclass(frozen=True, slots=True)
class CrashAt:
    """`worker_main`'s `before_step` hook that kills node `node`'s worker when step `step` begins, after
    recording the moment in the store (`store_keys.fail_event_key`) for the recovery's timeline. Picklable:
    torch elastic hands it to the worker process."""

    node: int
    step: int

    def __call__(self, step: int, store: Store) -> None:
        if step == self.step:
            store.set(fail_event_key(self.node), repr(time.time()))
            os._exit(FAILURE_EXIT_CODE)  # a crash: no cleanup, peers find out from their sockets
