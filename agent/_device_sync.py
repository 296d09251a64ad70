"""Waiting for an accelerator's queued work before a clock is read: kernels run asynchronously, so a timing
taken without it measures their launch, not their execution."""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    """Block until `device` has run everything queued on it (the CPU has nothing queued). An Ascend NPU's
    `torch.npu` exists once torch_npu is imported, which choosing that device did (`worker.worker_device`)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]
