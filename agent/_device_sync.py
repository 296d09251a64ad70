"""An accelerator's queued work and the host's clock: kernels run asynchronously, so a timing taken without
waiting for them (`synchronize`) measures their launch, not their execution, and a wait that begins while
the device still runs work queued before it is partly that work (`compute_mark`)."""

from __future__ import annotations

from typing import Protocol

import torch


def synchronize(device: torch.device) -> None:
    """Block until `device` has run everything queued on it (the CPU has nothing queued). An Ascend NPU's
    `torch.npu` exists once torch_npu is imported, which choosing that device did (`worker.worker_device`)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]


class ComputeMark(Protocol):
    """A device event (`torch.Event`): passed once the device ran what was queued before it."""

    def query(self) -> bool: ...


def compute_mark(device: torch.device | None) -> ComputeMark | None:
    """An event recorded now on `device`'s current stream, without waiting (None on the CPU, where the host
    is the device, and where the backend has no events). Used by the tracer on every call it traces: it never
    fails the call."""
    if device is None or device.type in ("cpu", "meta"):
        return None
    try:
        event = torch.Event(device=device)
        event.record()
    except (RuntimeError, AttributeError, TypeError):
        return None
    return event
