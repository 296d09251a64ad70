"""The trained model comes out whole when a worker dies while writing it (`agent._final_export`).

Which node writes what, and, through the test launcher (real worker processes, real TCPStore; it plans
around a dead worker as the operator does), a writer that dies after the last step committed: the layers
only it held come from the checkpoint of the last step, and `transformers` loads the output, which computes
what the plain PyTorch run's model does."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _training_support import (
    BATCH,
    MICRO,
    SEQ,
    VOCAB,
    gpt2_directory,
    hf_job_config,
    plain_pytorch,
    tiny_plan,
    token_file,
    transformers,
)

from resilientjob.agent._final_export import METADATA, assigned, writers
from resilientjob.agent.profiler import measure_profile
from resilientjob.cli import main
from resilientjob.testing.launcher import Launcher
from resilientjob.testing.plans import RuntimePlanner

STEPS = 12


def test_each_layer_has_one_writer_the_lowest_live_holder() -> None:
    held = {0: {0, 1}, 1: {2, 3}, 2: {0, 1}, 3: {2, 3}}  # two pipelines of two stages
    assert writers(held, {0, 1, 2, 3}, 4) == {0: 0, 1: 0, 2: 1, 3: 1}
    assert assigned(0, held, {0, 1, 2, 3}, 4) == {0, 1, METADATA}
    assert assigned(1, held, {0, 1, 2, 3}, 4) == {2, 3}
    # Node 0 died writing: its replica's node writes its layers and the metadata.
    assert assigned(2, held, {1, 2, 3}, 4) == {0, 1, METADATA}
    assert assigned(1, held, {1, 2, 3}, 4) == {2, 3}
    # Both holders of layers 0 and 1 gone: nobody holds them, the lowest live node reads them back.
    assert writers(held, {1, 3}, 4) == {0: None, 1: None, 2: 1, 3: 1}
    assert assigned(1, held, {1, 3}, 4) == {0, 1, 2, 3, METADATA}
    assert assigned(3, held, {1, 3}, 4) == set()


def _checkpointed(
    tmp_path: Path, model_dir: Path, tokens: Path, pp: int, output: Path | None = None, **launcher: Any
) -> Launcher:
    """The tiny model on one pipeline of `pp` stages, checkpointed into `tmp_path/ckpt` every 5 steps: an
    interval the last step (STEPS) is not on, so it is saved because it is the last."""
    config = hf_job_config(model_dir, tokens, steps=STEPS, output=output)
    saved = config.workload.checkpoint.model_copy(
        update={"path": str(tmp_path / "ckpt"), "interval_steps": 5}
    )
    config = dataclasses.replace(config, workload=config.workload.model_copy(update={"checkpoint": saved}))
    planner = RuntimePlanner.for_job(
        measure_profile(config.load_model(), timed=False),
        nodes=pp,
        global_batch=BATCH,
        microbatch_size=MICRO,
        fault_tolerance=0,
    )
    return Launcher(config, tiny_plan(dp=1, pp=pp), planner, tmp_path / "run", **launcher)


@pytest.mark.torch
@pytest.mark.slow
def test_layers_nobody_holds_any_more_come_from_the_last_steps_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One pipeline of two stages, no replica: node 1 alone holds layers 2 and 3 and dies as it starts to
    write them. (A lost writer with a replica: tests/agent/test_pod_training.py, through the operator.)"""
    model_dir = gpt2_directory(tmp_path / "gpt2")
    tokens = token_file(tmp_path / "tokens.bin")
    output = tmp_path / "trained"
    launcher = _checkpointed(tmp_path, model_dir, tokens, pp=2, output=output, crash_at_export=frozenset({1}))
    result = launcher.run(timeout_s=240)
    assert sorted(result.losses) == list(range(STEPS))
    assert launcher.failed == {1}
    # The failure was planned around after the last step, and nobody restarted.
    assert launcher.recoveries and launcher.recoveries[-1].committed_before == STEPS
    assert not any(r.restarted for r in launcher.recoveries)
    _, trained = plain_pytorch(model_dir, tokens, STEPS)
    exported = transformers.AutoModelForCausalLM.from_pretrained(output).eval()
    tokens_in = torch.arange(2 * SEQ).reshape(2, SEQ) % VOCAB
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens_in).logits, trained(tokens_in).logits, atol=2e-4, rtol=0)

    # `rjob export` writes the same model from the checkpoint alone, and an earlier step it kept.
    checkpoints, model = str(tmp_path / "ckpt"), f"hf:{model_dir}"
    data_tokenizer = tmp_path / "tok"  # the job's spec.data.tokenizer (the model's directory has none)
    data_tokenizer.mkdir()
    (data_tokenizer / "tokenizer.json").write_text('{"data": true}')
    argv = ["export", checkpoints, "--model", model, "--out", str(tmp_path / "again")]
    assert main([*argv, "--tokenizer", str(data_tokenizer)]) == 0
    assert f"wrote step {STEPS} of {model} (4 layers)" in capsys.readouterr().out
    assert (tmp_path / "again" / "tokenizer.json").read_text() == '{"data": true}'
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    assert (
        main(["export", checkpoints, "--model", model, "--out", str(tmp_path / "early"), "--step", "10"]) == 0
    )
    early = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "early").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(tokens_in).logits, exported(tokens_in).logits, atol=0, rtol=0)
        assert (early(tokens_in).logits - exported(tokens_in).logits).abs().max() > 1e-4
    # Bad input: one line naming what to change.
    deeper = gpt2_directory(tmp_path / "deeper", layers=3)
    wider = tmp_path / "wider"
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=SEQ)
    ).save_pretrained(wider)
    capsys.readouterr()
    for argv, said in [
        ([checkpoints, "--model", model, "--out", str(tmp_path / "x"), "--step", "7"], "--step: "),
        ([str(tmp_path / "none"), "--model", model, "--out", str(tmp_path / "x")], "checkpoint: "),
        ([checkpoints, "--model", f"hf:{deeper}", "--out", str(tmp_path / "x")], "checkpoint: "),
        ([checkpoints, "--model", f"hf:{wider}", "--out", str(tmp_path / "x")], "--model: "),
        (
            [checkpoints, "--model", model, "--out", str(tmp_path / "x"), "--tokenizer", str(tmp_path)],
            "--tokenizer: ",
        ),
    ]:
        assert main(["export", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"rjob: error: {said}") and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()  # nothing written before the checkpoint was found to fit


@pytest.mark.torch
def test_the_last_step_is_saved_and_the_steps_before_it_pruned(tmp_path: Path) -> None:
    """The last step is saved whatever the interval, and the job keeps `keep` (2) steps once it is on disk:
    the prune after its save ran while it was still being written, and left three."""
    model_dir, tokens = gpt2_directory(tmp_path / "gpt2"), token_file(tmp_path / "tokens.bin")
    _checkpointed(tmp_path, model_dir, tokens, pp=1).run(timeout_s=120)
    assert sorted(d.name for d in (tmp_path / "ckpt").glob("step*")) == ["step10", f"step{STEPS}"]


def test_a_tensor_parallel_nodes_export_rounds_survive_a_replaced_store() -> None:
    """The node's first device announces what its other devices gather with it, round by round. A store
    replaced mid-export (it comes back empty, under a newer generation) lost a round they had not read yet:
    they waited `STALL_S` and failed the job. The rounds are announced again, and "done" is only left once
    every other device said it read it."""
    import threading
    from datetime import timedelta

    from torch.distributed import TCPStore

    from resilientjob.agent._final_export import _Rounds
    from resilientjob.protocol.store_keys import GENERATION_KEY, export_ack_key, export_round_key

    def server() -> TCPStore:
        return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))

    old, new = server(), server()
    rounds = _Rounds(node=3, degree=2)
    rounds.announce(old, "[0, 1]")
    rounds.announce(old, "[2]")
    rounds.replay(new)  # the old store is gone with its keys: the new one gets them all
    assert [new.get(export_round_key(3, r)).decode() for r in (0, 1)] == ["[0, 1]", "[2]"]

    # "done" goes out and is lost before device 1 reads it (the store replaced: the key gone, a newer
    # generation committed): the first device announces it again, and waits for device 1's word.
    read: list[str] = []

    def device_1() -> None:  # its own client, as another process has
        client = TCPStore("127.0.0.1", new.port, is_master=False, timeout=timedelta(seconds=10))
        client.wait([export_round_key(3, 2)])
        client.delete_key(export_round_key(3, 2))
        client.add(GENERATION_KEY, 1)
        deadline = time.monotonic() + 10
        while not client.check([export_round_key(3, 2)]) and time.monotonic() < deadline:
            time.sleep(0.01)
        read.append(client.get(export_round_key(3, 2)).decode())
        client.set(export_ack_key(3, 1), "1")

    reader = threading.Thread(target=device_1)
    reader.start()
    assert rounds.finish(new, deadline_s=20)
    reader.join(10)
    assert read == ["done"]
    assert not _Rounds(node=4, degree=2).finish(new, deadline_s=0.3)  # nobody answers: gives up, says so
