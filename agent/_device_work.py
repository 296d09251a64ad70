"""The device work a pod agent does itself (node 0's pre-flight check and profile, a parked node's probes),
kept out of the agent's process on an accelerator.

CUDA cannot be used in a process forked from one that initialised it ("Cannot re-initialize CUDA in forked
subprocess"; torch_npu has the same rule), and `torch.cuda.is_bf16_supported()` or a probe's `set_device`
initialises it. Done in the agent, they broke every worker it started afterwards, and left the agent holding a
device context and cached memory on the pod's first accelerator for its whole life. So on an accelerator the
agent hands that work to a spawned child (a fresh interpreter, one job at a time, kept while there is work:
the parked node's probes reuse it, and it goes when the node trains again) and starts its workers by spawn
too (`worker_start_method`). On the CPU nothing of this applies: the work runs in a thread and workers fork
(torch is imported already, which halves their start-up on few cores).
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


def worker_start_method(device_kind: str) -> str:
    """How the agent starts its workers: fork on the CPU, spawn on an accelerator."""
    return "fork" if device_kind == "cpu" else "spawn"


@dataclass(slots=True)
class DeviceWork:
    """Runs functions that touch `device_kind`'s devices: in a thread on the CPU, in a spawned child (one,
    reused until `close`) on an accelerator. The functions and their arguments must pickle there."""

    device_kind: str
    _pool: ProcessPoolExecutor | None = field(default=None, init=False)

    @property
    def isolated(self) -> bool:
        return self.device_kind != "cpu"

    async def run(self, function: Callable[..., T], /, *args: object) -> T:
        if not self.isolated:
            return await asyncio.to_thread(function, *args)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(function, *args))

    def close(self) -> None:
        """End the child (its device context with it); the next `run` starts another."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
