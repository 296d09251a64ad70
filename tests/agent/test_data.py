"""The data layer on real files: token files (memory-mapped samples, sizes, vocabulary checks), the sample
order over epochs, the spec's refusals, JSON lines tokenized with a tokenizer built here, `open_dataset`."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from resilientjob.agent import _data_files
from resilientjob.agent.data import (
    DataError,
    SampleOrder,
    SyntheticDataset,
    TokenFileDataset,
    open_dataset,
    tokenize_jsonl,
)
from resilientjob.protocol.workload import DataFormat, DataSpec, TokenDtype

NUMPY_DTYPES = {TokenDtype.UINT16: np.uint16, TokenDtype.UINT32: np.uint32}


def _write_tokens(path: Path, tokens: np.ndarray[Any, Any]) -> Path:
    tokens.tofile(path)
    return path


def _random_tokens(count: int, dtype: TokenDtype, high: int, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, high, size=count).astype(NUMPY_DTYPES[dtype])


def _one_line_naming(error: pytest.ExceptionInfo[DataError], field: str) -> str:
    message = str(error.value)
    assert error.value.field == field
    assert message.startswith(f"{field}: ")
    assert "\n" not in message
    return message


# --- token files -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(TokenDtype))
def test_samples_are_the_slices_of_the_file_sharing_the_boundary_token(
    tmp_path: Path, dtype: TokenDtype
) -> None:
    seq_len, count = 7, 7 * 9 + 4  # 9 whole samples (+ their shared boundary token) and 3 spare tokens
    # Token ids above 65535 for uint32 show the file is read as uint32, not as pairs of uint16.
    tokens = _random_tokens(count, dtype, high=70_000 if dtype is TokenDtype.UINT32 else 60_000)
    dataset = TokenFileDataset(_write_tokens(tmp_path / "t.bin", tokens), dtype, seq_len)

    assert dataset.num_samples == (count - 1) // seq_len == 9
    for sample_id in range(dataset.num_samples):
        expected = tokens[sample_id * seq_len : (sample_id + 1) * seq_len + 1].astype(np.int64)
        np.testing.assert_array_equal(dataset.sample(sample_id).numpy(), expected)
    ids = [8, 0, 3, 3, 5]
    inputs, targets = dataset.batch(ids)
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.shape == targets.shape == (len(ids), seq_len)
    for row, sample_id in enumerate(ids):
        start = sample_id * seq_len
        np.testing.assert_array_equal(inputs[row].numpy(), tokens[start : start + seq_len])
        np.testing.assert_array_equal(targets[row].numpy(), tokens[start + 1 : start + seq_len + 1])
    for sample_id in range(dataset.num_samples - 1):
        # The last target of one sample is the first input of the next.
        assert dataset.sample(sample_id)[-1] == dataset.sample(sample_id + 1)[0]
    if dtype is TokenDtype.UINT32:
        assert int(dataset.batch(list(range(9)))[0].max()) >= 65_536
    with pytest.raises(ValueError, match="sample_ids"):
        dataset.batch([9])
    with pytest.raises(ValueError, match="sample_ids"):
        dataset.batch([-1])


@pytest.mark.parametrize(("count", "samples"), [(5, 1), (8, 1), (9, 2), (12, 2), (13, 3), (401, 100)])
def test_num_samples_is_tokens_minus_one_over_seq_len(tmp_path: Path, count: int, samples: int) -> None:
    path = _write_tokens(tmp_path / "t.bin", np.arange(count, dtype=np.uint16))
    dataset = TokenFileDataset(path, TokenDtype.UINT16, seq_len=4)
    assert dataset.num_samples == (count - 1) // 4 == samples
    # The last sample ends inside the file.
    assert int(dataset.sample(samples - 1)[-1]) == samples * 4 <= count - 1


def test_the_file_is_memory_mapped_not_loaded(tmp_path: Path) -> None:
    path = _write_tokens(tmp_path / "t.bin", np.arange(1001, dtype=np.uint16))
    dataset = TokenFileDataset(path, TokenDtype.UINT16, seq_len=10)
    assert isinstance(dataset.tokens, np.memmap)
    assert dataset.tokens.mode == "r"
    # A write to the file after opening shows in the next batch: samples are read from the shared mapping,
    # not from a copy taken at start-up.
    assert int(dataset.sample(50)[3]) == 503
    with path.open("r+b") as handle:
        handle.seek(503 * 2)
        handle.write(np.asarray([7], dtype=np.uint16).tobytes())
    assert int(dataset.sample(50)[3]) == 7
    assert int(dataset.batch([50])[0][0, 3]) == 7


def _resident_pages(path: Path) -> np.ndarray[Any, Any]:
    """Which of the file's pages are in the page cache (mincore on a fresh mapping)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    mapping = np.memmap(path, dtype=np.uint8, mode="r")
    vector = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(mapping.ctypes.data), ctypes.c_size_t(size), vector) == 0
    resident: np.ndarray[Any, Any] = np.frombuffer(bytes(vector), dtype=np.uint8) & 1 == 1
    return resident


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and posix_fadvise: Linux")
def test_a_cold_batch_reads_its_own_pages_not_the_neighbourhood(tmp_path: Path) -> None:
    """Random access: a batch brings in its rows' pages and not megabytes of read-around per sample."""
    seq_len, count = 1024, 16 * 2**20  # 32 MiB of uint16
    path = tmp_path / "t.bin"
    with path.open("wb") as out:
        _random_tokens(count, TokenDtype.UINT16, high=1000).tofile(out)
        out.flush()
        os.fsync(out.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if _resident_pages(path).mean() > 0.01:
        pytest.skip("this file system keeps the file in memory (tmpfs?): nothing to measure")
    dataset = TokenFileDataset(path, TokenDtype.UINT16, seq_len, vocab=1000)
    ids = [5, 3000, 9000, 16000]
    dataset.batch(ids)
    resident = _resident_pages(path)
    for sample_id in ids:
        first = sample_id * seq_len * 2 // mmap.PAGESIZE
        last = ((sample_id + 1) * seq_len * 2 + 1) // mmap.PAGESIZE
        assert resident[first : last + 1].all()
    # Four samples of 2 KB touch at most 8 pages; allow some slack, far below any read-around window.
    assert resident.sum() <= 64


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(DataError) as error:
        TokenFileDataset(tmp_path / "absent.bin", TokenDtype.UINT16, seq_len=4)
    assert "absent.bin" in _one_line_naming(error, "spec.data.path")


@pytest.mark.parametrize(("dtype", "size"), [(TokenDtype.UINT16, 101), (TokenDtype.UINT32, 102)])
def test_size_not_a_multiple_of_the_dtype_names_the_dtype(
    tmp_path: Path, dtype: TokenDtype, size: int
) -> None:
    path = tmp_path / "t.bin"
    path.write_bytes(bytes(size))
    with pytest.raises(DataError) as error:
        TokenFileDataset(path, dtype, seq_len=4)
    message = _one_line_naming(error, "spec.data.dtype")
    assert str(size) in message and dtype.value in message


def test_shorter_than_one_sample_names_the_path(tmp_path: Path) -> None:
    path = _write_tokens(tmp_path / "t.bin", np.arange(8, dtype=np.uint32))
    with pytest.raises(DataError) as error:
        TokenFileDataset(path, TokenDtype.UINT32, seq_len=8)  # needs 9 tokens
    assert "8 tokens" in _one_line_naming(error, "spec.data.path")
    assert TokenFileDataset(path, TokenDtype.UINT32, seq_len=7).num_samples == 1


def test_check_vocab_finds_a_token_beyond_the_vocabulary(tmp_path: Path) -> None:
    tokens = _random_tokens(5000, TokenDtype.UINT16, high=100)
    tokens[1234] = 150
    tokens[2345] = 200
    dataset = TokenFileDataset(_write_tokens(tmp_path / "t.bin", tokens), TokenDtype.UINT16, seq_len=16)
    dataset.check_vocab(201)
    with pytest.raises(DataError) as error:
        dataset.check_vocab(120)
    message = _one_line_naming(error, "spec.data.path")
    # The message names a bad token and where it is, consistently.
    assert "token 150 at position 1234" in message
    assert "(120)" in message
    with pytest.raises(DataError) as error:
        dataset.check_vocab(180)
    assert "token 200 at position 2345" in _one_line_naming(error, "spec.data.path")


def test_a_file_read_as_the_wrong_token_type_names_the_dtype(tmp_path: Path) -> None:
    """uint16 ids read as uint32 are all large: the field to change is `dtype`, not the data."""
    tokens = _random_tokens(5000, TokenDtype.UINT16, high=100)
    path = _write_tokens(tmp_path / "t.bin", tokens)
    dataset = TokenFileDataset(path, TokenDtype.UINT32, seq_len=16)
    with pytest.raises(DataError) as error:
        dataset.check_vocab(100)
    message = _one_line_naming(error, "spec.data.dtype")
    assert "is the file's token type uint32?" in message and "outside the model's vocabulary (100)" in message


def _unchecked_positions(count: int) -> np.ndarray[Any, Any]:
    """Token positions that check_vocab's evenly spaced chunks do not read, for a file of `count` tokens."""
    chunk = _data_files.CHECK_CHUNK_TOKENS
    checked = np.zeros(count, dtype=bool)
    starts = np.linspace(0, count - chunk, num=_data_files.CHECK_CHUNKS, dtype=np.int64)
    for start in starts:
        checked[start : start + chunk] = True
    return np.flatnonzero(~checked)


def test_a_token_beyond_the_vocabulary_where_check_vocab_does_not_look_is_caught_by_batch(
    tmp_path: Path,
) -> None:
    seq_len, vocab = 1000, 50
    count = 2 * _data_files.CHECK_CHUNKS * _data_files.CHECK_CHUNK_TOKENS + 1
    unchecked = _unchecked_positions(count)
    assert len(unchecked) > 0
    # An unchecked position inside a sample (not on a boundary token), far from the file's ends.
    position = int(next(p for p in unchecked[len(unchecked) // 2 :] if p % seq_len not in (0, 1)))
    bad_sample = position // seq_len
    tokens = _random_tokens(count, TokenDtype.UINT16, high=vocab)
    tokens[position] = vocab + 7
    path = _write_tokens(tmp_path / "t.bin", tokens)
    dataset = TokenFileDataset(path, TokenDtype.UINT16, seq_len, vocab=vocab)

    dataset.check_vocab(vocab)  # does not read there
    good = [bad_sample - 1, bad_sample + 1, 0]
    inputs, _ = dataset.batch(good)
    assert int(inputs.max()) < vocab
    with pytest.raises(DataError) as error:
        dataset.batch([*good, bad_sample])
    message = _one_line_naming(error, "spec.data.path")
    assert f"sample {bad_sample} " in message
    assert f"token {vocab + 7}" in message
    # Without a vocabulary the same batch is read as it is.
    plain = TokenFileDataset(path, TokenDtype.UINT16, seq_len)
    assert int(plain.sample(bad_sample)[position % seq_len]) == vocab + 7
    # And open_dataset's start-up check passes while the batch still refuses the sample.
    opened = open_dataset(DataSpec(path=str(path), seq_len=seq_len), vocab=vocab, cache_dir=tmp_path)
    with pytest.raises(DataError, match=f"sample {bad_sample} "):
        opened.batch([bad_sample])


# --- the sample order --------------------------------------------------------------------------------------


def test_every_sample_exactly_once_per_epoch_and_micro_batches_make_the_step() -> None:
    num_samples, global_batch = 103, 12  # 12 does not divide 103: steps straddle epochs
    order = SampleOrder(num_samples, global_batch, seed=5)
    steps = -(-3 * num_samples // global_batch) + 1
    stream: list[int] = []
    for step in range(steps):
        ids = order.step_ids(step)
        assert len(ids) == global_batch
        for size in (1, 2, 3, 4, 6, 12):
            micro = [order.microbatch_ids(step, m, size) for m in range(global_batch // size)]
            assert [i for batch in micro for i in batch] == ids
        stream.extend(ids)
    epochs = [stream[e * num_samples : (e + 1) * num_samples] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(num_samples))
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != list(range(num_samples))
    assert [order.epoch_of(s) for s in (0, 8, 9, 17, 18)] == [0, 0, 1, 1, 2]
    with pytest.raises(ValueError, match="microbatch_size"):
        order.microbatch_ids(0, 0, 5)
    with pytest.raises(ValueError, match="microbatch"):
        order.microbatch_ids(0, 3, 4)


def test_the_order_depends_only_on_seed_and_step() -> None:
    num_samples, global_batch = 1000, 24
    steps = list(range(0, 200, 7))
    first = {step: SampleOrder(num_samples, global_batch, seed=3).step_ids(step) for step in steps}
    # Other orders in between (other epochs, seeds and sizes) and a fresh object asked in reverse order.
    for seed in range(6):
        SampleOrder(num_samples, global_batch, seed=seed).step_ids(150)
        SampleOrder(num_samples + 1, global_batch, seed=3).step_ids(seed * 40)
    fresh = SampleOrder(num_samples, global_batch, seed=3)
    assert {step: fresh.step_ids(step) for step in reversed(steps)} == first
    # Positions, not step numbers, decide: step 3 of batch 8 is positions 24..31, the start of step 1 here.
    assert SampleOrder(num_samples, 8, seed=3).step_ids(3) == fresh.step_ids(1)[:8]
    assert SampleOrder(num_samples, global_batch, seed=4).step_ids(0) != first[0]


# --- the spec ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"format": "tokens"}, "path"),
        ({"format": "jsonl", "path": "/data/a.jsonl"}, "tokenizer"),
        ({"format": "tokens", "path": "/data/t.bin", "dtype": "int8"}, "dtype"),
    ],
)
def test_the_spec_refuses_incomplete_or_wrong_data(fields: dict[str, str], named: str) -> None:
    with pytest.raises(ValidationError) as error:
        DataSpec.model_validate(fields)
    (problem,) = error.value.errors()
    # A field error is located at the field; a cross-field one says which field in its message.
    assert problem["loc"] == (named,) or problem["msg"].startswith(f"Value error, {named}: ")
    assert DataSpec.model_validate({**fields, "path": "/p", "tokenizer": "/t", "dtype": "uint32"})


# --- JSON lines --------------------------------------------------------------------------------------------

WORDS = ["[UNK]", "</s>", "the", "cat", "sat", "on", "a", "mat", "dog", "ran"]


def _tokenizer_dir(root: Path) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = Tokenizer(WordLevel({word: index for index, word in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(["</s>"])
    directory = root / "tokenizer"
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


DOCUMENTS = ["the cat sat on a mat", "a dog ran", "the dog sat on the cat", "mat"]


def _expected_ids(documents: list[str]) -> list[int]:
    eos = WORDS.index("</s>")
    return [i for text in documents for i in [*(WORDS.index(w) for w in text.split()), eos]]


def _write_jsonl(path: Path, documents: list[str], key: str = "text") -> Path:
    lines = [json.dumps({key: text, "id": n}) for n, text in enumerate(documents)]
    lines.insert(2, "")  # blank lines are skipped
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("dtype", list(TokenDtype))
def test_jsonl_becomes_each_documents_ids_and_eos(tmp_path: Path, dtype: TokenDtype) -> None:
    source = _write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS, key="body")
    cache = tmp_path / "cache"
    tokens_path = tokenize_jsonl(source, _tokenizer_dir(tmp_path), "body", dtype, cache)
    assert tokens_path.parent == cache
    written = np.fromfile(tokens_path, dtype=NUMPY_DTYPES[dtype])
    assert written.tolist() == _expected_ids(DOCUMENTS)
    assert os.listdir(cache) == [tokens_path.name]  # no temporary file left behind


def test_the_tokenized_file_is_reused_until_the_source_changes(tmp_path: Path) -> None:
    source = _write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    tokenizer, cache = _tokenizer_dir(tmp_path), tmp_path / "cache"
    first = tokenize_jsonl(source, tokenizer, "text", TokenDtype.UINT16, cache)
    stamp = first.stat().st_mtime_ns
    inode = first.stat().st_ino
    again = tokenize_jsonl(source, tokenizer, "text", TokenDtype.UINT16, cache)
    assert again == first
    assert (again.stat().st_mtime_ns, again.stat().st_ino) == (stamp, inode)

    # Another text field or dtype is another file.
    other = tokenize_jsonl(source, tokenizer, "text", TokenDtype.UINT32, cache)
    assert other != first

    # Changing the source makes a new file with the new content.
    changed = ["a cat ran", "the mat"]
    _write_jsonl(source, changed)
    renewed = tokenize_jsonl(source, tokenizer, "text", TokenDtype.UINT16, cache)
    assert renewed != first
    assert np.fromfile(renewed, dtype=np.uint16).tolist() == _expected_ids(changed)


def test_a_same_size_edit_with_the_old_timestamp_is_not_served_from_the_cache(tmp_path: Path) -> None:
    """Copies that keep timestamps (cp -p, rsync -t) leave size and mtime as they were: the cache must
    notice the change all the same (the kernel's change time does)."""
    source = _write_jsonl(tmp_path / "docs.jsonl", ["the cat sat", "a dog ran"])
    tokenizer, cache = _tokenizer_dir(tmp_path), tmp_path / "cache"
    first = tokenize_jsonl(source, tokenizer, "text", TokenDtype.UINT16, cache)
    before = source.stat()
    time.sleep(0.05)  # past the file system's timestamp granularity (a jiffy on ext4)
    _write_jsonl(source, ["the dog sat", "a cat ran"])  # same length
    os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert source.stat().st_size == before.st_size and source.stat().st_mtime_ns == before.st_mtime_ns
    assert source.stat().st_ino == before.st_ino
    renewed = tokenize_jsonl(source, tokenizer, "text", TokenDtype.UINT16, cache)
    assert np.fromfile(renewed, dtype=np.uint16).tolist() == _expected_ids(["the dog sat", "a cat ran"])
    assert renewed != first
    # A file put in its place (another inode) with the same size and timestamps is a different file too.
    replacement = _write_jsonl(tmp_path / "other.jsonl", ["a dog sat", "the cat ran"])
    os.utime(replacement, ns=(before.st_atime_ns, before.st_mtime_ns))
    replacement.rename(source)
    replaced = tokenize_jsonl(source, tokenizer, "text", TokenDtype.UINT16, cache)
    assert np.fromfile(replaced, dtype=np.uint16).tolist() == _expected_ids(["a dog sat", "the cat ran"])
    assert replaced not in (first, renewed)


@pytest.mark.parametrize(
    ("bad_line", "what"),
    [
        ('{"text": "the cat", ', "not JSON (Expecting property name enclosed in double quotes at column 21)"),
        ('{"text": 7}', '"text" is int, not a string'),
        ('{"text": null}', '"text" is null, not a string'),
        ('["the cat"]', "not a JSON object"),
        ('{"text": "the \\ud800 cat"}', "holds no text at character 4"),  # a lone surrogate: valid JSON
    ],
)
def test_a_bad_line_names_the_path_and_line_number(tmp_path: Path, bad_line: str, what: str) -> None:
    source = tmp_path / "docs.jsonl"
    source.write_text('{"text": "the cat"}\n\n' + bad_line + '\n{"text": "a dog"}\n')
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as error:
        tokenize_jsonl(source, _tokenizer_dir(tmp_path), "text", TokenDtype.UINT16, cache)
    message = _one_line_naming(error, "spec.data.path")
    assert "line 3" in message and what in message and str(source) in message
    assert os.listdir(cache) == []  # nothing half-written stays in the cache


def test_a_line_without_the_text_field_names_the_field_and_the_keys_it_has(tmp_path: Path) -> None:
    source = tmp_path / "docs.jsonl"
    source.write_text('{"text": "the cat"}\n{"body": "the cat", "id": 3}\n')
    with pytest.raises(DataError) as error:
        tokenize_jsonl(source, _tokenizer_dir(tmp_path), "text", TokenDtype.UINT16, tmp_path / "cache")
    message = _one_line_naming(error, "spec.data.textField")
    assert f'{source}: line 2: no "text" field (it has "body", "id")' in message


def test_the_tokenizer_may_be_given_as_its_tokenizer_json(tmp_path: Path) -> None:
    """The directory `save_pretrained` writes, or the tokenizer.json in it: the same tokens."""
    source = _write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    directory = _tokenizer_dir(tmp_path)
    by_dir = tokenize_jsonl(source, directory, "text", TokenDtype.UINT16, tmp_path / "a")
    by_file = tokenize_jsonl(source, directory / "tokenizer.json", "text", TokenDtype.UINT16, tmp_path / "b")
    assert np.fromfile(by_dir, dtype=np.uint16).tolist() == np.fromfile(by_file, dtype=np.uint16).tolist()
    other = tmp_path / "vocab.txt"
    other.write_text("x")
    with pytest.raises(DataError) as error:
        tokenize_jsonl(source, other, "text", TokenDtype.UINT16, tmp_path / "c")
    _one_line_naming(error, "spec.data.tokenizer")


@pytest.mark.parametrize("config", ["{not json", "[]", '"</s>"'])
def test_a_tokenizer_config_that_is_no_json_object_names_the_tokenizer(tmp_path: Path, config: str) -> None:
    tokenizer = _tokenizer_dir(tmp_path)
    (tokenizer / "tokenizer_config.json").write_text(config)
    source = _write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    with pytest.raises(DataError) as error:
        tokenize_jsonl(source, tokenizer, "text", TokenDtype.UINT16, tmp_path / "cache")
    assert "tokenizer_config.json" in _one_line_naming(error, "spec.data.tokenizer")


def test_an_edited_tokenizer_config_is_not_served_from_the_cache(tmp_path: Path) -> None:
    """The config names the token that ends each document: tokens made with the old one are stale."""
    tokenizer, cache = _tokenizer_dir(tmp_path), tmp_path / "cache"
    source = _write_jsonl(tmp_path / "docs.jsonl", ["the cat", "a dog"])
    first = tokenize_jsonl(source, tokenizer, "text", TokenDtype.UINT16, cache)
    assert np.fromfile(first, dtype=np.uint16).tolist() == _expected_ids(["the cat", "a dog"])
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"eos_token": "mat"}))
    again = tokenize_jsonl(source, tokenizer, "text", TokenDtype.UINT16, cache)
    mat = WORDS.index("mat")
    assert np.fromfile(again, dtype=np.uint16).tolist() == [2, 3, mat, 6, 8, mat]


def test_a_line_that_is_not_utf8_names_the_path_and_line_number(tmp_path: Path) -> None:
    source = tmp_path / "docs.jsonl"
    source.write_bytes(b'{"text": "the cat"}\n{"text": "a \xff\xfe dog"}\n')
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as error:
        tokenize_jsonl(source, _tokenizer_dir(tmp_path), "text", TokenDtype.UINT16, cache)
    assert "line 2" in _one_line_naming(error, "spec.data.path")
    assert os.listdir(cache) == []


def test_token_ids_beyond_the_dtype_name_the_dtype(tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = Tokenizer(WordLevel({"[UNK]": 0, "</s>": 1, "big": 70_000}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    directory = tmp_path / "big-tokenizer"
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    source = _write_jsonl(tmp_path / "docs.jsonl", ["big big", "big"])
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as error:
        tokenize_jsonl(source, directory, "text", TokenDtype.UINT16, cache)
    assert "70000" in _one_line_naming(error, "spec.data.dtype")
    assert os.listdir(cache) == []
    wide = tokenize_jsonl(source, directory, "text", TokenDtype.UINT32, cache)
    assert np.fromfile(wide, dtype=np.uint32).tolist() == [70_000, 70_000, 1, 70_000, 1]


def test_a_missing_tokenizer_names_the_tokenizer_and_a_missing_source_the_path(tmp_path: Path) -> None:
    source = _write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    with pytest.raises(DataError) as error:
        tokenize_jsonl(source, empty, "text", TokenDtype.UINT16, tmp_path / "cache")
    assert str(empty) in _one_line_naming(error, "spec.data.tokenizer")
    with pytest.raises(DataError) as error:
        tokenize_jsonl(
            tmp_path / "absent.jsonl", _tokenizer_dir(tmp_path), "text", TokenDtype.UINT16, tmp_path
        )
    assert "absent.jsonl" in _one_line_naming(error, "spec.data.path")


def _save_tokenizer(directory: Path, tokenizer: Any, config: dict[str, Any] | None = None) -> Path:
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _word_tokenizer(words: list[str], special: list[str]) -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = Tokenizer(WordLevel({word: index for index, word in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(special)
    return tokenizer


@pytest.mark.parametrize("config_form", ["string", "added-token dict"])
def test_the_eos_named_by_tokenizer_config_separates_documents(tmp_path: Path, config_form: str) -> None:
    # "<|stop|>" is no usual EOS name, and "</s>" is in the vocabulary as an ordinary word: only the
    # config says which one ends a document.
    words = ["[UNK]", "</s>", "<|stop|>", "the", "cat", "sat"]
    eos: Any = "<|stop|>" if config_form == "string" else {"content": "<|stop|>", "special": True}
    directory = _save_tokenizer(tmp_path / "tok", _word_tokenizer(words, ["<|stop|>"]), {"eos_token": eos})
    source = _write_jsonl(tmp_path / "docs.jsonl", ["the cat", "sat"])
    tokens = tokenize_jsonl(source, directory, "text", TokenDtype.UINT16, tmp_path / "cache")
    assert np.fromfile(tokens, dtype=np.uint16).tolist() == [3, 4, 2, 5, 2]


def test_without_an_eos_documents_are_joined_as_they_are(tmp_path: Path) -> None:
    words = ["[UNK]", "the", "cat", "sat"]
    directory = _save_tokenizer(tmp_path / "tok", _word_tokenizer(words, []))
    source = _write_jsonl(tmp_path / "docs.jsonl", ["the cat", "sat", "cat"])
    tokens = tokenize_jsonl(source, directory, "text", TokenDtype.UINT16, tmp_path / "cache")
    assert np.fromfile(tokens, dtype=np.uint16).tolist() == [1, 2, 3, 2]


def test_an_eos_the_tokenizer_already_appends_is_not_doubled(tmp_path: Path) -> None:
    from tokenizers.processors import TemplateProcessing

    tokenizer = _word_tokenizer(WORDS, ["</s>"])
    eos = WORDS.index("</s>")
    tokenizer.post_processor = TemplateProcessing(single="$A </s>", special_tokens=[("</s>", eos)])
    directory = _save_tokenizer(tmp_path / "tok", tokenizer)
    assert tokenizer.encode("a dog").ids == [WORDS.index("a"), WORDS.index("dog"), eos]
    source = _write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    tokens = tokenize_jsonl(source, directory, "text", TokenDtype.UINT16, tmp_path / "cache")
    assert np.fromfile(tokens, dtype=np.uint16).tolist() == _expected_ids(DOCUMENTS)


def test_a_tokenizer_json_that_does_not_parse_names_the_tokenizer(tmp_path: Path) -> None:
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"}}')
    source = _write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    with pytest.raises(DataError) as error:
        tokenize_jsonl(source, directory, "text", TokenDtype.UINT16, tmp_path / "cache")
    assert "tokenizer.json: not a tokenizer" in _one_line_naming(error, "spec.data.tokenizer")
    assert os.listdir(tmp_path / "cache") == []


_RACER = """
import sys, time
from pathlib import Path
from resilientjob.agent.data import tokenize_jsonl
from resilientjob.protocol.workload import TokenDtype
source, tokenizer, cache, ready, go = map(Path, sys.argv[1:])
ready.touch()
while not go.exists():
    time.sleep(0.001)
path = tokenize_jsonl(source, tokenizer, "text", TokenDtype.UINT16, cache)
print(path, path.stat().st_ino)
"""


@pytest.mark.slow
def test_workers_preparing_the_same_file_at_once_tokenize_it_once(tmp_path: Path) -> None:
    """Two processes released together: one tokenizes, the other waits and is given that very file (an
    unlocked second worker would have tokenized too and replaced it: another inode)."""
    documents = [" ".join(WORDS[2 + (n * 7 + k) % 8] for k in range(40)) for n in range(40_000)]
    source = _write_jsonl(tmp_path / "docs.jsonl", documents)  # about a second to tokenize
    tokenizer, cache, go = _tokenizer_dir(tmp_path), tmp_path / "cache", tmp_path / "go"
    readies = [tmp_path / f"ready{number}" for number in range(2)]
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, *map(str, [source, tokenizer, cache, ready, go])],
            stdout=subprocess.PIPE,
        )
        for ready in readies
    ]
    try:
        deadline = time.monotonic() + 120
        while not all(ready.exists() for ready in readies):  # both imported and waiting: release them
            assert time.monotonic() < deadline and all(racer.poll() is None for racer in racers)
            time.sleep(0.01)
        go.touch()
        results = []
        for racer in racers:
            out, _ = racer.communicate(timeout=120)
            assert racer.returncode == 0
            results.append(out.decode().split())
    finally:
        for racer in racers:
            if racer.poll() is None:
                racer.kill()
                racer.wait()
    (path, inode), (other_path, other_inode) = results
    assert path == other_path and os.listdir(cache) == [Path(path).name]
    assert inode == other_inode == str(Path(path).stat().st_ino)
    assert np.fromfile(path, dtype=np.uint16).tolist() == _expected_ids(documents)


# --- open_dataset ------------------------------------------------------------------------------------------


def test_open_dataset_synthetic(tmp_path: Path) -> None:
    spec = DataSpec(format=DataFormat.SYNTHETIC, num_samples=40, seq_len=12, seed=9)
    dataset = open_dataset(spec, vocab=17, cache_dir=tmp_path)
    assert isinstance(dataset, SyntheticDataset)
    assert (dataset.num_samples, dataset.seq_len, dataset.seed) == (40, 12, 9)
    inputs, targets = dataset.batch([0, 39])
    assert inputs.shape == (2, 12) and int(inputs.max()) < 17
    torch.testing.assert_close(inputs[:, 1:], targets[:, :-1])
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("dtype", list(TokenDtype))
def test_open_dataset_tokens(tmp_path: Path, dtype: TokenDtype) -> None:
    tokens = _random_tokens(321, dtype, high=300)
    path = _write_tokens(tmp_path / "t.bin", tokens)
    spec = DataSpec(path=str(path), dtype=dtype, seq_len=10, seed=4)
    dataset = open_dataset(spec, vocab=300, cache_dir=tmp_path / "cache")
    assert isinstance(dataset, TokenFileDataset)
    assert (dataset.num_samples, dataset.seq_len, dataset.seed) == (32, 10, 4)
    np.testing.assert_array_equal(dataset.batch([31])[1][0].numpy(), tokens[311:321])
    with pytest.raises(DataError) as error:
        open_dataset(spec, vocab=int(tokens.max()), cache_dir=tmp_path / "cache")
    assert f"token {int(tokens.max())} " in _one_line_naming(error, "spec.data.path")
    with pytest.raises(DataError) as error:
        open_dataset(spec.model_copy(update={"path": str(tmp_path / "x.bin")}), 300, tmp_path)
    _one_line_naming(error, "spec.data.path")


def test_open_dataset_jsonl(tmp_path: Path) -> None:
    source = _write_jsonl(tmp_path / "docs.jsonl", DOCUMENTS)
    spec = DataSpec(
        format=DataFormat.JSONL, path=str(source), tokenizer=str(_tokenizer_dir(tmp_path)), seq_len=4, seed=2
    )
    cache = tmp_path / "cache"
    dataset = open_dataset(spec, vocab=len(WORDS), cache_dir=cache)
    assert isinstance(dataset, TokenFileDataset)
    assert dataset.path.parent == cache
    expected = _expected_ids(DOCUMENTS)
    assert dataset.num_samples == (len(expected) - 1) // 4
    inputs, targets = dataset.batch(list(range(dataset.num_samples)))
    assert inputs.flatten().tolist() == expected[: 4 * dataset.num_samples]
    assert targets.flatten().tolist() == expected[1 : 4 * dataset.num_samples + 1]
    # A model whose vocabulary is smaller than the tokenizer's is refused at start-up, naming the tokenizer
    # and the source (the user wrote those, not the cache file).
    with pytest.raises(DataError) as error:
        open_dataset(spec, vocab=5, cache_dir=cache)
    message = _one_line_naming(error, "spec.data.tokenizer")
    assert spec.tokenizer in message and str(source) in message and "(5)" in message
    # A corpus shorter than one sample names the source.
    with pytest.raises(DataError) as error:
        open_dataset(spec.model_copy(update={"seq_len": len(expected)}), vocab=len(WORDS), cache_dir=cache)
    message = _one_line_naming(error, "spec.data.path")
    assert f"{source} tokenizes to {len(expected)} tokens" in message
    assert (
        open_dataset(spec.model_copy(update={"seq_len": len(expected) - 1}), len(WORDS), cache).num_samples
        == 1
    )
    # A tokenizer directory without tokenizer.json is named.
    with pytest.raises(DataError) as error:
        open_dataset(spec.model_copy(update={"tokenizer": str(tmp_path)}), vocab=len(WORDS), cache_dir=cache)
    _one_line_naming(error, "spec.data.tokenizer")


def test_an_epochs_order_is_the_same_on_every_numpy() -> None:
    """Pinned: workers on different images (a replacement pulled later) must draw the same samples. The
    keys come from SeedSequence, whose output NumPy keeps fixed across releases; a Generator's draws, which
    the keys came from before, may change with one. A change here is a change of every job's order: raise
    `data.ORDER_VERSION` with it (and the version below), so that a world of old and new images refuses to
    train instead of drawing different samples in one micro-batch."""
    from resilientjob.agent.data import ORDER_VERSION, EpochShuffle

    assert ORDER_VERSION == 2

    positions = np.arange(12, dtype=np.uint64)
    assert EpochShuffle.of(12, 3, 0).ids(positions).tolist() == [7, 4, 11, 8, 2, 10, 5, 0, 1, 9, 6, 3]
    assert EpochShuffle.of(12, 3, 1).ids(positions).tolist() == [10, 0, 3, 2, 7, 6, 11, 4, 9, 8, 5, 1]
    assert EpochShuffle.of(12, 3, 0).keys[0] == 12467808127879573787
