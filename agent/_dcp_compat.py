"""`torch.distributed.checkpoint` without collectives, on every torch the runtime supports.

A checkpoint's layer is written and read by one process (`no_dist=True`): no collective may wait on a peer
that has just died. The keyword came late to the newer entry points: torch 2.5.1, the Ascend image's pin,
has no `no_dist` on `async_save`. Where an entry point lacks it, the older `save_state_dict` and
`load_state_dict`, which have taken `no_dist` since torch 2.0, do the same work, and an asynchronous save
runs in the caller's own writer thread (`Checkpointer`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import state_dict_loader as _loader
from torch.distributed.checkpoint import state_dict_saver as _saver
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

State = dict[str, torch.Tensor]


def _takes_no_dist(function: Callable[..., Any]) -> bool:
    return "no_dist" in inspect.signature(function).parameters


ASYNC_SAVE_NO_DIST = _takes_no_dist(_saver.async_save)
"""Whether this torch's `async_save` can skip collectives (2.13 can; 2.5.1 cannot)."""
SAVE_NO_DIST = _takes_no_dist(_saver.save)
LOAD_NO_DIST = _takes_no_dist(_loader.load)


def save_local(state: State, directory: Path) -> None:
    """Write `state` to `directory`, this process alone."""
    if SAVE_NO_DIST:
        _saver.save(state, checkpoint_id=directory, no_dist=True)
    else:
        _saver.save_state_dict(state, FileSystemWriter(directory), no_dist=True)


def async_save_local(state: State, directory: Path) -> Future[Any]:
    """`save_local` in torch's background writer; only where `ASYNC_SAVE_NO_DIST`."""
    return _saver.async_save(state, checkpoint_id=directory, no_dist=True)  # type: ignore[return-value]


def load_local(state: State, directory: Path) -> None:
    """Overwrite `state`'s tensors in place from `directory`, this process alone."""
    if LOAD_NO_DIST:
        _loader.load(state, checkpoint_id=directory, no_dist=True)
    else:
        _loader.load_state_dict(state, FileSystemReader(directory), no_dist=True)
