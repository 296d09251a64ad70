"""Per-layer checkpoints round-trip on every path `_dcp_compat` may take: this torch's own `no_dist` entry
points and the older ones torch 2.5.1 (the Ascend image's pin) needs, synchronous and in the background."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from resilientjob.agent import _dcp_compat
from resilientjob.agent.checkpoint import Checkpointer
from resilientjob.agent.p2p import LayerState

# One process writes each layer on purpose (the worker silences DCP's note that it assumes so).
pytestmark = pytest.mark.filterwarnings("ignore:.*assuming the intent is to (save|load) in a single process")


def _layer(seed: int) -> LayerState:
    torch.manual_seed(seed)
    layer = LayerState(index=0, module=nn.Linear(4, 3))
    for state in layer.optimizer.state.values():
        state["exp_avg"].normal_()
        state["step"].fill_(seed)
    return layer


def _same(a: LayerState, b: LayerState) -> bool:
    left, right = a.named_tensors(), b.named_tensors()
    return left.keys() == right.keys() and all(torch.equal(left[key], right[key]) for key in left)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the older entry points are deprecated on new torch
@pytest.mark.parametrize("asynchronous", [True, False])
@pytest.mark.parametrize("new_entry_points", [True, False], ids=["this-torch", "torch-2.5-entry-points"])
def test_a_layer_saved_and_loaded_back_is_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asynchronous: bool, new_entry_points: bool
) -> None:
    if not new_entry_points:  # what torch 2.5.1 offers: no `no_dist` on async_save, save or load
        for flag in ("ASYNC_SAVE_NO_DIST", "SAVE_NO_DIST", "LOAD_NO_DIST"):
            monkeypatch.setattr(_dcp_compat, flag, False)
        monkeypatch.setattr(_dcp_compat._saver, "async_save", _must_not_be_called)
        monkeypatch.setattr(_dcp_compat._saver, "save", _must_not_be_called)
        monkeypatch.setattr(_dcp_compat._loader, "load", _must_not_be_called)
    checkpointer = Checkpointer(tmp_path, interval=5, asynchronous=asynchronous)
    saved = _layer(seed=1)
    checkpointer.save(5, {0: saved}, owned={0})
    checkpointer.wait()
    assert checkpointer.latest_complete(num_layers=1) == 5

    restored = _layer(seed=2)
    assert not _same(saved, restored)
    checkpointer.load(5, restored)
    assert _same(saved, restored)


def test_the_writer_thread_saves_the_weights_of_the_step_not_later_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_dcp_compat, "ASYNC_SAVE_NO_DIST", False)
    checkpointer = Checkpointer(tmp_path, interval=1)
    layer = _layer(seed=3)
    expected = {key: value.clone() for key, value in layer.named_tensors().items()}
    checkpointer.save(1, {0: layer}, owned={0})
    with torch.no_grad():
        for param in layer.module.parameters():
            param.add_(1.0)  # training goes on while the writer works
    checkpointer.wait()
    restored = _layer(seed=4)
    checkpointer.load(1, restored)
    assert all(torch.equal(restored.named_tensors()[key], value) for key, value in expected.items())


def _must_not_be_called(*_: object, **__: object) -> None:
    raise AssertionError("this entry point has no `no_dist` on the torch being emulated")
