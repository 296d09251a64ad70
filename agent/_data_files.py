"""Data sets on disk: a flat file of token ids, memory-mapped, and JSON lines tokenized once into one.

A `tokens` file is what `numpy.ndarray.tofile` writes (uint16 or uint32 ids, no header), as nanoGPT's and
Megatron's preprocessing scripts produce. Sample i is tokens [i*L, (i+1)*L + 1) for sequence length L: the
inputs and, shifted by one, the next-token targets, so consecutive samples share one boundary token and a
file of n tokens holds (n - 1) // L samples. The file is never read whole: `batch` reads the rows of one
micro-batch through a strided view of the memory map. The map is advised random access (no read-around:
with the kernel's default a fault on one 2 KB sample reads up to `read_ahead_kb`, 8 MB on some disks), and
`batch` asks for all its rows at once (MADV_WILLNEED) before touching them, so a cold micro-batch waits for
one round of parallel reads of exactly its pages instead of a chain of faults (`bench/bench_data.py`).

A `jsonl` file is tokenized with a local tokenizer directory (`tokenizer.json`, never a hub download),
documents joined by the tokenizer's end-of-sequence token, streamed into a tokens file in a cache directory
named by a hash of everything that determines its content (the source file's path, inode, size and
timestamps, the tokenizer's bytes, the text field and the dtype). Workers of one node that prepare the
same file at once take turns on a lock of the cache directory, so one tokenizes and the others find its
result; the file is written under a private temporary name and renamed into place, so nobody ever reads
half a file (also where the lock is not available).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import mmap
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from resilientjob.protocol.workload import TokenDtype

CHECK_CHUNKS = 64
CHECK_CHUNK_TOKENS = 16_384
"""The start-up vocabulary check reads this many evenly spaced chunks (1M tokens) of a large file."""

WRONG_DTYPE_SHARE = 0.25
"""A start-up check that finds more than this share of a chunk's tokens outside the vocabulary names
`spec.data.dtype`: a file of uint16 ids read as uint32 is nearly all large ids, a damaged file a few."""

_EOS_NAMES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "<|im_end|>")


class DataError(ValueError):
    """Bad data: names the spec field to change (`spec.data.path`, `spec.data.dtype`, ...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        """The line without its field (to restate it for another field)."""


def _numpy_dtype(dtype: TokenDtype) -> np.dtype[Any]:
    return np.dtype(np.uint16 if dtype is TokenDtype.UINT16 else np.uint32)


@dataclass(frozen=True, slots=True)
class TokenFileDataset:
    """Samples of `seq_len + 1` tokens from a memory-mapped token file (see the module doc)."""

    path: Path
    dtype: TokenDtype
    seq_len: int
    seed: int = 0
    vocab: int | None = None
    """Token ids must be below this (the model's vocabulary); checked per batch."""
    _tokens: np.memmap[Any, Any] = field(init=False, repr=False, compare=False)
    _rows: np.ndarray[Any, Any] = field(init=False, repr=False, compare=False)
    _map: mmap.mmap | None = field(init=False, repr=False, compare=False)
    """The map under `_tokens`, for access advice (None where the platform has no madvise)."""
    num_samples: int = field(init=False)

    def __post_init__(self) -> None:
        path = Path(self.path)
        if not path.is_file():
            raise DataError("spec.data.path", f"{path}: no such file")
        itemsize = _numpy_dtype(self.dtype).itemsize
        size = path.stat().st_size
        if size % itemsize:
            raise DataError(
                "spec.data.dtype",
                f"{path} has {size} bytes, not a whole number of {self.dtype.value} tokens",
            )
        count = size // itemsize
        if count < self.seq_len + 1:
            raise DataError(
                "spec.data.path",
                f"{path} has {count} tokens, fewer than one sample (seqLen {self.seq_len} + 1)",
            )
        tokens = np.memmap(path, dtype=_numpy_dtype(self.dtype), mode="r")
        samples = (count - 1) // self.seq_len
        # Row i starts at token i*L and is L+1 long: a view of the map, read only where indexed.
        rows = np.lib.stride_tricks.as_strided(
            tokens,
            shape=(samples, self.seq_len + 1),
            strides=(self.seq_len * itemsize, itemsize),
            writeable=False,
        )
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "_tokens", tokens)
        object.__setattr__(self, "_rows", rows)
        object.__setattr__(self, "_map", _advised_map(tokens))
        object.__setattr__(self, "num_samples", samples)

    def _will_need(self, start: int, stop: int) -> None:
        """Start reading tokens [start, stop) into the page cache without waiting (a hint; never fails)."""
        if self._map is None:
            return
        itemsize = self._tokens.itemsize
        first = start * itemsize
        aligned = first - first % mmap.PAGESIZE
        with contextlib.suppress(OSError):
            self._map.madvise(mmap.MADV_WILLNEED, aligned, min(stop, len(self._tokens)) * itemsize - aligned)

    @property
    def tokens(self) -> np.memmap[Any, Any]:
        """The whole file as a memory map (nothing read until indexed)."""
        return self._tokens

    def check_vocab(self, vocab: int) -> None:
        """Raise DataError if a token id >= `vocab` appears in evenly spaced chunks of the file (about a
        million tokens however large it is); `batch` catches the rest as it reads them."""
        tokens = self.tokens
        count = len(tokens)
        starts = np.linspace(0, max(0, count - CHECK_CHUNK_TOKENS), num=CHECK_CHUNKS, dtype=np.int64)
        unique = np.unique(starts).tolist()
        for start in unique:  # all chunks' reads in flight at once, then scanned in order
            self._will_need(start, start + CHECK_CHUNK_TOKENS)
        for start in unique:
            chunk = np.asarray(tokens[start : start + CHECK_CHUNK_TOKENS])
            if len(chunk) and int(chunk.max()) >= vocab:
                outside = chunk >= vocab
                offset = int(np.argmax(outside))  # the first bad token, named with its position
                line = (
                    f"{self.path}: token {int(chunk[offset])} at position {int(start) + offset} is outside "
                    f"the model's vocabulary ({vocab})"
                )
                share = float(outside.mean())
                if share > WRONG_DTYPE_SHARE:  # not a stray bad token: the file is read as the wrong type
                    raise DataError(
                        "spec.data.dtype",
                        f"{line}, as {share:.0%} of the tokens checked there are: is the file's token type "
                        f"{self.dtype.value}?",
                    )
                raise DataError("spec.data.path", line)

    def sample(self, sample_id: int) -> torch.Tensor:
        """Tokens of one sample, shape (seq_len + 1,), int64."""
        if not 0 <= sample_id < self.num_samples:
            raise ValueError(f"sample_id: {sample_id} outside [0, {self.num_samples})")
        self._will_need(sample_id * self.seq_len, (sample_id + 1) * self.seq_len + 1)
        return torch.from_numpy(self._rows[sample_id].astype(np.int64))

    def batch(self, sample_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each (len(sample_ids), seq_len), int64 on the CPU."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_samples):
            raise ValueError(f"sample_ids: outside [0, {self.num_samples})")
        for sample_id in ids.tolist():  # every row's pages requested before the first fault waits
            self._will_need(sample_id * self.seq_len, (sample_id + 1) * self.seq_len + 1)
        rows = self._rows[ids].astype(np.int64)  # one gather from the map
        if self.vocab is not None and rows.size and int(rows.max()) >= self.vocab:
            bad = int(np.argmax((rows >= self.vocab).any(axis=1)))
            raise DataError(
                "spec.data.path",
                f"{self.path}: sample {int(ids[bad])} holds token {int(rows[bad].max())}, outside the "
                f"model's vocabulary ({self.vocab})",
            )
        tensor = torch.from_numpy(rows)
        return tensor[:, :-1], tensor[:, 1:]


def _advised_map(tokens: np.memmap[Any, Any]) -> mmap.mmap | None:
    """The mmap under `tokens`, advised random access; None where that cannot be done (no madvise)."""
    mapping = getattr(tokens, "_mmap", None)
    if not isinstance(mapping, mmap.mmap) or not hasattr(mmap, "MADV_RANDOM"):
        return None
    try:
        mapping.madvise(mmap.MADV_RANDOM)
    except OSError:
        return None
    return mapping


def _eos_id(tokenizer: Any, directory: Path) -> int | None:
    """The token that ends each document: `tokenizer_config.json`'s `eos_token`, else a usual name."""
    config = directory / "tokenizer_config.json"
    names: list[str] = []
    if config.is_file():
        try:
            settings = json.loads(config.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataError("spec.data.tokenizer", f"{config}: not JSON ({exc})") from None
        if not isinstance(settings, dict):
            raise DataError("spec.data.tokenizer", f"{config}: not a JSON object")
        eos = settings.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            names.append(eos)
    for name in [*names, *_EOS_NAMES]:
        token = tokenizer.token_to_id(name)
        if token is not None:
            return int(token)
    return None


def _cache_name(path: Path, tokenizer_json: Path, text_field: str, dtype: TokenDtype) -> str:
    # The source by its identity and both timestamps, not by its bytes: every start looks the file up, and
    # hashing a corpus would cost each worker tens of seconds per 10 GB (sha256 of a file in the page cache:
    # 0.45 GB/s on the development machine). The change time is what makes this safe: a copy that keeps the
    # modification time (cp -p, rsync -t) or an edit whose mtime is put back still sets ctime to now (the
    # kernel does, on every write, rename and utime, and nothing lets a user set it back). The tokenizer is
    # small: its bytes.
    stat = path.stat()
    identity = (
        path.resolve(),
        stat.st_ino,
        stat.st_size,
        stat.st_mtime_ns,
        stat.st_ctime_ns,
        text_field,
        dtype,
    )
    digest = hashlib.sha256()
    for part in identity:
        digest.update(str(part).encode() + b"\0")
    digest.update(hashlib.sha256(tokenizer_json.read_bytes()).digest())
    # It names the token that ends each document (`_eos_id`): an edited config must not serve old tokens.
    config = tokenizer_json.parent / "tokenizer_config.json"
    digest.update(hashlib.sha256(config.read_bytes() if config.is_file() else b"").digest())
    return f"{path.stem}-{digest.hexdigest()[:20]}.{dtype.value}.bin"


def tokenizer_file(tokenizer: Path) -> Path:
    """The tokenizer.json that `spec.data.tokenizer` names: the directory `save_pretrained` writes, or that
    file itself."""
    return tokenizer if tokenizer.is_file() else tokenizer / "tokenizer.json"


def tokenize_jsonl(
    path: Path, tokenizer_dir: Path, text_field: str, dtype: TokenDtype, cache_dir: Path
) -> Path:
    """The tokens file of a JSON-lines data set (made once; later calls return the cached file)."""
    path, tokenizer_dir = Path(path), Path(tokenizer_dir)
    if not path.is_file():
        raise DataError("spec.data.path", f"{path}: no such file")
    tokenizer_json = tokenizer_file(tokenizer_dir)
    if not tokenizer_json.is_file() or tokenizer_json.name != "tokenizer.json":
        raise DataError(
            "spec.data.tokenizer",
            f"{tokenizer_dir}: no tokenizer.json (a tokenizer's directory, or that file)",
        )
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / _cache_name(path, tokenizer_json, text_field, dtype)
    if target.exists():
        return target
    with _locked(cache_dir):
        if target.exists():  # another worker made it while this one waited for the lock
            return target
        _tokenize_into(target, path, tokenizer_json, text_field, dtype)
    return target


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on `directory` (released when the process dies, unlike a lock file's
    existence). Where the file system refuses (some network file systems), go on unlocked: every worker then
    tokenizes for itself and the atomic rename still keeps the result whole."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # also releases the lock


def _tokenize_into(
    target: Path, path: Path, tokenizer_json: Path, text_field: str, dtype: TokenDtype
) -> None:
    from tokenizers import Tokenizer

    cache_dir = target.parent
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_json))
    except Exception as exc:  # the Rust library raises its own exception type, one per parse problem
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError("spec.data.tokenizer", f"{tokenizer_json}: not a tokenizer ({reason})") from None
    eos = _eos_id(tokenizer, tokenizer_json.parent)
    limit = int(np.iinfo(_numpy_dtype(dtype)).max)
    handle, temporary = tempfile.mkstemp(dir=cache_dir, prefix=f".{target.name}.")
    try:
        with os.fdopen(handle, "wb") as out, path.open("rb") as lines:
            texts: list[str] = []
            number = 0

            def flush() -> None:
                for encoding in tokenizer.encode_batch(texts):
                    ids = encoding.ids
                    # A post-processor may already end each document with EOS (T5-style): never twice.
                    if eos is not None and (not ids or ids[-1] != eos):
                        ids = [*ids, eos]
                    if ids and max(ids) > limit:
                        raise DataError("spec.data.dtype", f"token id {max(ids)} does not fit {dtype.value}")
                    np.asarray(ids, dtype=_numpy_dtype(dtype)).tofile(out)
                texts.clear()

            # Bytes, decoded per line: a bad byte is then an error naming its line, not a traceback.
            for number, raw in enumerate(lines, start=1):
                if not raw.strip():
                    continue
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DataError(
                        "spec.data.path", f"{path}: line {number}: not UTF-8 (byte {exc.start})"
                    ) from None
                try:
                    record = json.loads(line.rstrip("\r\n"))  # its columns counted on this line
                except json.JSONDecodeError as exc:
                    raise DataError(
                        "spec.data.path",
                        f"{path}: line {number}: not JSON ({exc.msg} at column {exc.colno})",
                    ) from None
                texts.append(_text_of(record, text_field, f"{path}: line {number}"))
                if len(texts) >= 1024:
                    flush()
            flush()
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _text_of(record: object, text_field: str, where: str) -> str:
    """The document of one JSON line; DataError naming the line when it has none."""
    if not isinstance(record, dict):
        raise DataError("spec.data.path", f"{where}: not a JSON object")
    if text_field not in record:
        keys = ", ".join(json.dumps(key) for key in list(record)[:8])
        raise DataError("spec.data.textField", f"{where}: no {json.dumps(text_field)} field (it has {keys})")
    text = record[text_field]
    if not isinstance(text, str):
        kind = "null" if text is None else type(text).__name__
        raise DataError("spec.data.path", f"{where}: {json.dumps(text_field)} is {kind}, not a string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # an escaped lone surrogate ("\ud800") is valid JSON, not text
        raise DataError(
            "spec.data.path", f"{where}: {json.dumps(text_field)} holds no text at character {exc.start}"
        ) from None
    return text
