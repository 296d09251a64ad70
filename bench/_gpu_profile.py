"""Where a step's time goes, for `bench_gpu.py --profile`: `torch.profiler` over a few steps of one worker,
written as text a reader can compare side by side (ours vs plain PyTorch).

Each report says how long the profiled steps took on the wall, how much of that the device was busy with
kernels, which operators took the most device and host time, and how often the host called something that
can wait on the device (`cudaStreamSynchronize`, `cudaDeviceSynchronize`, copies): a step that synchronises
per micro-batch or per layer keeps the host from running ahead of the device, which shows as a busy fraction
well under 1 at an unchanged kernel time. No Python stacks are recorded: they slow the host side of the
profiled steps, and the CUDA runtime's calls do not carry them anyway."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from resilientjob.agent.hooks import StepHooks
from resilientjob.planner.plan import Plan

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""Host calls that can wait on the device (a `cudaMemcpyAsync` from pageable memory waits too)."""


class StepProfiler:
    """Profiles steps [first, first + count) of a loop that calls `begin(step)` and `end(step)`."""

    def __init__(self, path: Path, first: int, count: int) -> None:
        if first < 0 or count < 1:
            raise ValueError(f"profile: first >= 0 and count >= 1, got {first}, {count}")
        self.path, self.first, self.count = path, first, count
        self._profile: Any = None
        self._began = 0.0

    def begin(self, step: int) -> None:
        if step != self.first:
            return
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self._profile = profile(activities=activities)
        self._profile.__enter__()
        self._began = time.perf_counter()

    def end(self, step: int) -> None:
        """`step`: the index of the step that just ended."""
        if self._profile is None or step != self.first + self.count - 1:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - self._began
        self._profile.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(report(self._profile, wall_s, self.count))
        self._profile = None


def report(prof: Any, wall_s: float, steps: int) -> str:
    averages = prof.key_averages()
    # Kernels only: an operator's row repeats the time of the kernels it launched.
    device_us = sum(e.self_device_time_total for e in averages if e.device_type == DeviceType.CUDA)
    lines = [
        f"{steps} steps profiled: {wall_s:.3f} s on the wall ({wall_s / steps * 1e3:.1f} ms per step)",
        f"device busy with kernels: {device_us / 1e6:.3f} s ({device_us / 1e6 / wall_s:.1%} of the wall)",
        "",
        "== by self device time",
        averages.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60),
        "== by self host time",
        averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60),
        "== host calls that can wait on the device",
    ]
    syncs = [event for event in averages if event.key.startswith(SYNC_OPS)]
    syncs.sort(key=lambda event: event.self_cpu_time_total, reverse=True)
    lines.extend(
        f"{event.key}: {event.count} calls, {event.self_cpu_time_total / 1e3:.1f} ms host" for event in syncs
    )
    return "\n".join(lines) + "\n"


class ProfileHooks(StepHooks):
    """`StepProfiler` as a worker's step hooks (our runtime's side of the comparison)."""

    def __init__(self, path: str, first: int, count: int) -> None:
        self.profiler = StepProfiler(Path(path), first, count)

    def before_step(self, store: Any, generation: int, step: int, world_rank: int | None) -> None:
        self.profiler.begin(step)

    def after_step(self, plan: Plan | None, generation: int, step: int, loss: float, samples: int) -> None:
        self.profiler.end(step - 1)  # `step` counts committed steps: the one that ended is step - 1
