"""Node 0's pre-flight (`agent/_model_profile.make_report`): everything a worker would find unusable at its
start is found once, before any plan, as one line and the spec field to fix; a usable workload is reported
with the layer count of the model the runtime builds (and the profile, when the operator asks for one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resilientjob.agent._model_profile import make_report
from resilientjob.protocol.messages import ModelProfileReport, ModelProfileRequest
from resilientjob.protocol.workload import (
    DataFormat,
    DataSpec,
    OutputSpec,
    TokenDtype,
    Workload,
    WorkloadCheckpoint,
)

pytestmark = pytest.mark.torch
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SEQ_LEN = 8
VOCAB = 64


def _gpt2(directory: Path) -> Path:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=SEQ_LEN, bos_token_id=0, eos_token_id=0
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


def _tokens(path: Path, count: int, high: int = VOCAB, dtype: Any = np.uint16) -> Path:
    np.random.default_rng(0).integers(0, high, count).astype(dtype).tofile(path)
    return path


def _report(model: str, data: DataSpec, *, profile: bool = True) -> ModelProfileReport:
    request = ModelProfileRequest(model=model, seq_len=data.seq_len, microbatch_size=1, profile=profile)
    workload = Workload(model=model, data=data)
    return make_report(request, workload, {}, node=0, cache_dir=None)


def _token_data(path: Path, dtype: TokenDtype = TokenDtype.UINT16) -> DataSpec:
    return DataSpec(path=str(path), format=DataFormat.TOKENS, dtype=dtype, seq_len=SEQ_LEN)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return _gpt2(tmp_path / "gpt2")


@pytest.fixture
def good_data(tmp_path: Path) -> DataSpec:
    return _token_data(_tokens(tmp_path / "train.bin", 10 * SEQ_LEN + 1))


def _failed(report: ModelProfileReport, field: str, *words: str) -> None:
    assert report.profile is None and report.error_field == field, report
    assert "\n" not in report.error and not report.error.startswith(field), report.error
    for word in words:
        assert word in report.error, report.error


def test_a_usable_workload_is_checked_and_profiled_on_request(model_dir: Path, good_data: DataSpec) -> None:
    checked = _report(f"hf:{model_dir}", good_data, profile=False)
    assert not checked.error and checked.profile is None and checked.num_layers == 4
    profiled = _report(f"hf:{model_dir}", good_data)
    assert not profiled.error and profiled.profile is not None and profiled.profile.num_layers == 4


def test_a_missing_model_directory_names_the_model(tmp_path: Path, good_data: DataSpec) -> None:
    _failed(_report(f"hf:{tmp_path / 'nowhere'}", good_data), "spec.model", "nowhere", "not a directory")


def test_a_model_function_that_raises_anything_is_one_line_naming_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, good_data: DataSpec
) -> None:
    """The user's own code may raise any exception while the model is built; node 0's agent reports it as
    one line naming `spec.model` and its type, instead of dying with a traceback."""
    (tmp_path / "broken_layers.py").write_text("def layers():\n    return {}['embedding']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _failed(_report("broken_layers:layers", good_data, profile=False), "spec.model", "KeyError", "embedding")


def test_an_unsupported_family_names_the_model(tmp_path: Path, good_data: DataSpec) -> None:
    directory = tmp_path / "bert"
    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2)
    config.save_pretrained(directory)
    _failed(_report(f"hf:{directory}", good_data, profile=False), "spec.model", "'bert'", "not supported")


def test_a_tensor_missing_from_the_checkpoint_names_it(model_dir: Path, good_data: DataSpec) -> None:
    weights = model_dir / "model.safetensors"
    tensors = safetensors_torch.load_file(weights)
    del tensors["transformer.h.1.mlp.c_fc.weight"]
    safetensors_torch.save_file(tensors, weights, metadata={"format": "pt"})
    report = _report(f"hf:{model_dir}", good_data, profile=False)
    _failed(report, "spec.model", "transformer.h.1.mlp.c_fc.weight", "layer 2")


def test_a_tensor_of_another_shape_names_it_and_both_shapes(model_dir: Path, good_data: DataSpec) -> None:
    weights = model_dir / "model.safetensors"
    tensors = safetensors_torch.load_file(weights)
    tensors["transformer.ln_f.weight"] = tensors["transformer.ln_f.weight"][:8].clone()
    safetensors_torch.save_file(tensors, weights, metadata={"format": "pt"})
    report = _report(f"hf:{model_dir}", good_data, profile=False)
    _failed(report, "spec.model", "transformer.ln_f.weight", "[8]", "[16]")


def test_a_truncated_shard_names_the_file(model_dir: Path, good_data: DataSpec) -> None:
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    _failed(_report(f"hf:{model_dir}", good_data, profile=False), "spec.model", "model.safetensors")


def test_data_shorter_than_one_sample_names_the_path(model_dir: Path, tmp_path: Path) -> None:
    short = _tokens(tmp_path / "short.bin", SEQ_LEN)  # one sample needs seqLen + 1 tokens
    _failed(_report(f"hf:{model_dir}", _token_data(short), profile=False), "spec.data.path", "short.bin")


def test_a_missing_data_file_names_the_path(model_dir: Path, tmp_path: Path) -> None:
    data = _token_data(tmp_path / "absent.bin")
    _failed(_report(f"hf:{model_dir}", data, profile=False), "spec.data.path", "absent.bin", "no such file")


def test_a_size_that_does_not_fit_the_dtype_names_the_dtype(model_dir: Path, tmp_path: Path) -> None:
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00" * (10 * SEQ_LEN + 1))  # uint16 ids read as uint32: not a whole number
    report = _report(f"hf:{model_dir}", _token_data(odd, TokenDtype.UINT32), profile=False)
    _failed(report, "spec.data.dtype", "uint32")


def test_a_token_beyond_the_vocabulary_names_the_data_and_the_token(model_dir: Path, tmp_path: Path) -> None:
    tokens = _tokens(tmp_path / "wide.bin", 10 * SEQ_LEN + 1)
    wide = np.fromfile(tokens, dtype=np.uint16)
    wide[5] = VOCAB + 3
    wide.tofile(tokens)
    report = _report(f"hf:{model_dir}", _token_data(tokens), profile=False)
    _failed(report, "spec.data.path", str(VOCAB + 3), f"vocabulary ({VOCAB})")


def test_a_toy_model_on_bad_data_is_refused_too(tmp_path: Path) -> None:
    """Not only Hugging Face models: every model the runtime trains is checked against its data."""
    data = _token_data(_tokens(tmp_path / "t.bin", 3))
    _failed(_report("gpt", data, profile=False), "spec.data.path", "t.bin")


@pytest.mark.parametrize(
    ("model", "devices", "says"),
    [
        ("hf:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=32&n_positions=16", 2, "GPT-2 blocks have no"),
        (
            "hf:llama?num_hidden_layers=2&hidden_size=32&intermediate_size=64&num_attention_heads=4"
            "&num_key_value_heads=2&vocab_size=32&max_position_embeddings=16",
            4,
            "2 key/value heads do not split evenly",
        ),
    ],
    ids=["gpt2", "llama-kv-heads"],
)
def test_a_stage_split_the_model_cannot_take_names_gpus_per_node(model: str, devices: int, says: str) -> None:
    data = DataSpec(format=DataFormat.SYNTHETIC, num_samples=16, seq_len=8)
    request = ModelProfileRequest(
        model=model, seq_len=8, microbatch_size=1, profile=False, devices_per_stage=devices
    )
    report = make_report(request, Workload(model=model, data=data), {}, node=0)
    assert report.error_field == "spec.gpusPerNode"
    assert says in report.error
    whole = make_report(
        request.model_copy(update={"devices_per_stage": 2 if devices == 4 else 1}),
        Workload(model=model, data=data),
        {},
        node=0,
    )
    assert not whole.error  # the same model on a split it takes


def test_an_output_path_that_cannot_be_written_is_found_before_training(tmp_path: Path) -> None:
    data = DataSpec(format=DataFormat.SYNTHETIC, num_samples=16, seq_len=SEQ_LEN)
    request = ModelProfileRequest(model="gpt", seq_len=SEQ_LEN, microbatch_size=1, profile=False)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for path, ok in ((blocker / "out", False), (tmp_path / "new" / "out", True)):
        workload = Workload(model="gpt", data=data, output=OutputSpec(path=str(path)))
        report = make_report(request, workload, {"layers": 4}, node=0)
        if ok:
            assert not report.error and path.is_dir() and not list(path.iterdir())  # made, left empty
        else:
            assert report.error_field == "spec.output.path", report
            assert "cannot write the trained model there" in report.error and str(path) in report.error


def test_a_data_set_smaller_than_one_global_batch_is_refused() -> None:
    data = DataSpec(format=DataFormat.SYNTHETIC, num_samples=6, seq_len=SEQ_LEN)
    request = ModelProfileRequest(
        model="gpt", seq_len=SEQ_LEN, microbatch_size=1, profile=False, global_batch=8
    )
    report = make_report(request, Workload(model="gpt", data=data), {"layers": 4}, node=0)
    assert report.error_field == "spec.data.path"
    assert "holds 6 samples" in report.error and "fewer than one global batch (8)" in report.error
    enough = request.model_copy(update={"global_batch": 6})
    assert not make_report(enough, Workload(model="gpt", data=data), {"layers": 4}, node=0).error


def test_a_sequence_longer_than_the_models_positions_names_the_data_seq_len(tmp_path: Path) -> None:
    model = f"hf:{_gpt2(tmp_path / 'gpt2')}"
    data = DataSpec(format=DataFormat.SYNTHETIC, num_samples=16, seq_len=2 * SEQ_LEN)
    request = ModelProfileRequest(model=model, seq_len=2 * SEQ_LEN, microbatch_size=1, profile=False)
    report = make_report(request, Workload(model=model, data=data), {}, node=0)
    assert report.error_field == "spec.data.seqLen", report
    assert report.error.startswith(f"{2 * SEQ_LEN} exceeds the {SEQ_LEN} positions"), report.error


def test_a_computed_profile_on_a_cpu_prices_the_layers_at_the_cpus_own_speed() -> None:
    """A CPU job's computed profile at an accelerator's nominal 150 TFLOP/s made its step about a thousand
    times too cheap; it is priced at the CPU's timed matrix-product rate."""
    from resilientjob.agent.validation import gemm_benchmark
    from resilientjob.planner.hf_profile import NOMINAL_FLOPS, profile_from_hf_config

    model = (
        "hf:llama?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
        "&num_key_value_heads=2&vocab_size=64&max_position_embeddings=16"
    )
    data = DataSpec(format=DataFormat.SYNTHETIC, num_samples=16, seq_len=SEQ_LEN)
    request = ModelProfileRequest(model=model, seq_len=SEQ_LEN, microbatch_size=1, profile=True)
    report = make_report(request, Workload(model=model, data=data), {}, node=0)
    assert not report.error and report.profile is not None and not report.measured
    from resilientjob.agent.models import load_model

    nominal = profile_from_hf_config(load_model(model, seq_len=SEQ_LEN).hf.config.to_dict(), SEQ_LEN, 1)
    assert [a.state_bytes for a in report.profile.layers] == [b.state_bytes for b in nominal.layers]
    ratios = [a.forward_s / b.forward_s for a, b in zip(report.profile.layers, nominal.layers, strict=True)]
    assert max(ratios) / min(ratios) < 1.001  # one speed for every layer
    # The nominal speed over this CPU's, within what two timings of a matrix product differ by on a loaded
    # machine (the nominal price would give 1).
    expected = NOMINAL_FLOPS / gemm_benchmark(size=512, repeats=3, stretched=False).flops_per_s
    assert expected / 10 < ratios[0] < expected * 10, (ratios[0], expected)


def test_a_checkpoint_path_another_job_holds_is_refused_before_training(tmp_path: Path) -> None:
    """Steps are named by number: a job on another job's checkpoint path would restore its weights and
    prune its steps. The first job to check the path claims it; the same job (applied again) resumes there."""
    data = DataSpec(format=DataFormat.SYNTHETIC, num_samples=16, seq_len=SEQ_LEN)
    request = ModelProfileRequest(model="gpt", seq_len=SEQ_LEN, microbatch_size=1, profile=False)
    path = tmp_path / "ckpt"
    workload = Workload(model="gpt", data=data, checkpoint=WorkloadCheckpoint(path=str(path)))

    def check(job: str) -> ModelProfileReport:
        return make_report(request, workload, {"layers": 4}, node=0, job=job)

    assert not check("team-a/pretrain").error and path.is_dir()
    (path / "step40").mkdir()  # its first checkpoint
    assert not check("team-a/pretrain").error  # the same job again: its own path
    other = check("team-b/finetune")
    assert other.error_field == "spec.checkpoint.path", other
    assert f"{path} holds the checkpoints of job team-a/pretrain" in other.error
    assert "give this job a path of its own" in other.error
    assert (path / "step40").is_dir()  # nothing of the first job's was touched
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    unwritable = Workload(model="gpt", data=data, checkpoint=WorkloadCheckpoint(path=str(blocker / "c")))
    report = make_report(request, unwritable, {"layers": 4}, node=0, job="team-a/pretrain")
    assert report.error_field == "spec.checkpoint.path" and "cannot write checkpoints there" in report.error
