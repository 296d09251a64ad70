"""What the runtime trains on: a data set of fixed-length token samples, and their order per global step.

`open_dataset` turns `spec.data` into a `TokenDataset`: a memory-mapped token file or a tokenized JSON-lines
file (`_data_files`), or the built-in synthetic data below.

Nothing is downloaded. Sample `i` is a token sequence drawn from a fixed random Markov chain (the chain comes
from the seed; each sample's start and noise from `(seed, i)`), so a model can learn it and every worker can
materialise any sample locally: the pipeline's first stage builds inputs and the last stage builds targets
without moving data.

The order is a pure function of the global step: step `s` covers positions [s*B, (s+1)*B) of an endless
stream in which epoch `e` is a seeded permutation of all sample ids. Any split of a step's batch over
pipelines and micro-batches, before or after any number of reconfigurations, covers the same ids, so each
sample is processed exactly once per epoch as long as the global batch B stays the same.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from resilientjob.protocol.workload import DataFormat, DataSpec

from ._data_files import DataError, TokenFileDataset, tokenize_jsonl

__all__ = [
    "DataError",
    "SampleOrder",
    "SyntheticDataset",
    "TokenDataset",
    "TokenFileDataset",
    "open_dataset",
    "tokenize_jsonl",
]


class TokenDataset(Protocol):
    """What the runtime reads: sample ids -> inputs and next-token targets, int64 (m, seq_len) on the CPU."""

    @property
    def num_samples(self) -> int: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def seed(self) -> int: ...
    def batch(self, sample_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]: ...


def open_dataset(spec: DataSpec, vocab: int, cache_dir: Path) -> TokenDataset:
    """The data set of `spec.data` for a model with `vocab` token ids; DataError naming the field if the data
    cannot feed that model (a token id beyond the vocabulary is checked on a sample now, per batch later)."""
    if spec.format is DataFormat.SYNTHETIC:
        return SyntheticDataset(spec.num_samples, seq_len=spec.seq_len, vocab=vocab, seed=spec.seed)
    if spec.format is DataFormat.TOKENS:
        dataset = TokenFileDataset(Path(spec.path), spec.dtype, spec.seq_len, seed=spec.seed, vocab=vocab)
        dataset.check_vocab(vocab)
        return dataset
    # JSON lines: the user wrote the source and the tokenizer, not the cache file, so errors name those.
    tokens = tokenize_jsonl(Path(spec.path), Path(spec.tokenizer), spec.text_field, spec.dtype, cache_dir)
    count = tokens.stat().st_size // np.dtype(spec.dtype.value).itemsize
    if count < spec.seq_len + 1:
        raise DataError(
            "spec.data.path",
            f"{spec.path} tokenizes to {count} tokens, fewer than one sample (seqLen {spec.seq_len} + 1)",
        )
    dataset = TokenFileDataset(tokens, spec.dtype, spec.seq_len, seed=spec.seed, vocab=vocab)
    try:
        dataset.check_vocab(vocab)
    except DataError as error:
        raise DataError(
            "spec.data.tokenizer",
            f"{spec.tokenizer} makes token ids the model cannot embed, from {spec.path} ({error.message})",
        ) from None
    return dataset


ORDER_VERSION = 2
"""The version of the sample order a seed gives (`SampleOrder`, `EpochShuffle`): raised with every change to
it (2: the Feistel order computed per position, 2026-11-28). Ranks compare it when a world forms, as they
compare the data (`_runtime_commit.agree_on_step`): images of two versions in one world (a mutable tag
pulled at different times) would feed a micro-batch's stages different samples without anything failing."""

FINGERPRINT_SAMPLES = 16
"""Samples, evenly spaced over a data set, that its fingerprint reads."""


def fingerprint(dataset: TokenDataset) -> int:
    """A 62-bit digest of what `dataset` feeds: its size, sequence length and seed, and the tokens of a few
    evenly spaced samples. Ranks compare it when a world forms (`_runtime_commit.agree_on_step`): two
    copies of a data set of the same size but other contents, on two nodes, would feed one micro-batch's
    stages different samples without anything failing."""
    count = dataset.num_samples
    ids = sorted(
        {round(i * (count - 1) / max(1, FINGERPRINT_SAMPLES - 1)) for i in range(FINGERPRINT_SAMPLES)}
    )
    inputs, targets = dataset.batch(ids)
    digest = hashlib.blake2b(digest_size=8)
    digest.update(np.array([count, dataset.seq_len, dataset.seed], dtype=np.int64).tobytes())
    digest.update(inputs.to(torch.int64).numpy().tobytes())
    digest.update(targets[:, -1:].to(torch.int64).numpy().tobytes())
    return int.from_bytes(digest.digest(), "little") >> 2  # -value still fits an int64


@dataclass(frozen=True, slots=True)
class SyntheticDataset:
    """`num_samples` sequences of `seq_len + 1` tokens (inputs and next-token targets)."""

    num_samples: int = 512
    seq_len: int = 16
    vocab: int = 32
    seed: int = 0
    noise: float = 0.1
    """Probability that a token ignores the chain and is drawn uniformly (keeps the loss floor above 0)."""

    def __post_init__(self) -> None:
        for name in ("num_samples", "seq_len", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.noise <= 1:
            raise ValueError(f"noise: must be in [0, 1], got {self.noise}")

    def _chain(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed)
        return torch.randperm(self.vocab, generator=generator, device="cpu")

    def sample(self, sample_id: int) -> torch.Tensor:
        """Tokens of one sample, shape (seq_len + 1,)."""
        if not 0 <= sample_id < self.num_samples:
            raise ValueError(f"sample_id: {sample_id} outside [0, {self.num_samples})")
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + sample_id + 1)
        successor = self._chain()
        # The CPU, explicitly: data is made on the host whatever the default device, and moved by the runtime.
        tokens = torch.empty(self.seq_len + 1, dtype=torch.long, device="cpu")
        tokens[0] = torch.randint(self.vocab, (1,), generator=generator, device="cpu")
        noise = torch.rand(self.seq_len, generator=generator, device="cpu") < self.noise
        random_tokens = torch.randint(self.vocab, (self.seq_len,), generator=generator, device="cpu")
        for position in range(self.seq_len):
            nxt = successor[tokens[position]]
            tokens[position + 1] = random_tokens[position] if noise[position] else nxt
        return tokens

    def batch(self, sample_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each (len(sample_ids), seq_len)."""
        tokens = torch.stack([self.sample(i) for i in sample_ids])
        return tokens[:, :-1], tokens[:, 1:]


@dataclass(frozen=True, slots=True)
class SampleOrder:
    """Which sample ids a global step processes, and how they split into micro-batches."""

    num_samples: int
    global_batch: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"num_samples: must be >= 1, got {self.num_samples}")
        if self.global_batch < 1:
            raise ValueError(f"global_batch: must be >= 1, got {self.global_batch}")

    def step_ids(self, step: int) -> list[int]:
        """The global batch of `step`, in order."""
        if step < 0:
            raise ValueError(f"step: must be >= 0, got {step}")
        ids: list[int] = _step_ids(self, step).tolist()
        return ids

    def microbatch_ids(self, step: int, microbatch: int, microbatch_size: int) -> list[int]:
        """Ids of global micro-batch `microbatch` (0-based over the whole step) of `step`."""
        if microbatch_size < 1 or self.global_batch % microbatch_size:
            raise ValueError(
                f"microbatch_size: must divide global_batch={self.global_batch}, got {microbatch_size}"
            )
        if step < 0:
            raise ValueError(f"step: must be >= 0, got {step}")
        if not 0 <= microbatch < self.global_batch // microbatch_size:
            raise ValueError(
                f"microbatch: {microbatch} outside the step's {self.global_batch // microbatch_size}"
            )
        # The whole step at once, kept for its other micro-batches: one vectorised pass per step, not one
        # per micro-batch (numpy's per-call cost would dominate a handful of ids).
        start = microbatch * microbatch_size
        ids: list[int] = _step_ids(self, step)[start : start + microbatch_size].tolist()
        return ids

    def epoch_of(self, step: int) -> int:
        return step * self.global_batch // self.num_samples


@functools.lru_cache(maxsize=8)
def _step_ids(order: SampleOrder, step: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The ids at positions [step*B, (step+1)*B) of the endless stream of epochs (read-only: cached)."""
    parts = []
    position, end = step * order.global_batch, (step + 1) * order.global_batch
    while position < end:
        epoch, index = divmod(position, order.num_samples)
        take = min(order.num_samples - index, end - position)
        positions = np.arange(index, index + take, dtype=np.uint64)
        parts.append(EpochShuffle.of(order.num_samples, order.seed, epoch).ids(positions))
        position += take
    ids = np.concatenate(parts)
    ids.flags.writeable = False
    return ids


_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


@dataclass(frozen=True, slots=True)
class EpochShuffle:
    """One epoch's order of `num_samples` ids as a bijection computed per position, in no memory: a
    four-round Feistel network over the smallest even power of two that holds them, walked until it lands
    inside [0, num_samples) (cycle walking: at most 4x the domain, about two rounds of walking on average).

    An epoch's order used to be a `randperm` of every id, cached per worker: 8 bytes a sample, 76 MB and
    0.44 s for 10M samples, drawn at each epoch's start by every worker, and a 2^40-sample data set the
    spec accepts failed to allocate at the first step. Any position of any epoch now costs the same few
    microseconds (bench/bench_data.py)."""

    num_samples: int
    half_bits: int
    keys: tuple[int, int, int, int]

    @classmethod
    def of(cls, num_samples: int, seed: int, epoch: int) -> EpochShuffle:
        return _shuffle(num_samples, seed, epoch)

    def ids(self, positions: np.ndarray[Any, np.dtype[np.uint64]]) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The sample ids at `positions` (each in [0, num_samples)) of this epoch's order."""
        out = self._rounds(positions)
        outside = out >= self.num_samples
        while outside.any():
            out[outside] = self._rounds(out[outside])
            outside = out >= self.num_samples
        return out.astype(np.int64)

    def _rounds(self, values: np.ndarray[Any, np.dtype[np.uint64]]) -> np.ndarray[Any, np.dtype[np.uint64]]:
        half = np.uint64(self.half_bits)
        mask = np.uint64((1 << self.half_bits) - 1)
        left, right = values >> half, values & mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ np.uint64(key)) & mask)
        return (left << half) | right


def _mix(x: np.ndarray[Any, np.dtype[np.uint64]]) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """SplitMix64's finaliser: every input bit moves every output bit (arrays wrap modulo 2^64 silently)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX_1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX_2
    return x ^ (x >> np.uint64(31))


@functools.lru_cache(maxsize=16)
def _shuffle(num_samples: int, seed: int, epoch: int) -> EpochShuffle:
    if num_samples < 1:
        raise ValueError(f"num_samples: must be >= 1, got {num_samples}")
    half_bits = max(1, ((num_samples - 1).bit_length() + 1) // 2)
    # SeedSequence's state is fixed by NumPy's policy across versions and platforms, where a Generator's
    # draws may change with a release: every worker must compute the same order, whatever image it runs.
    keys = np.random.SeedSequence([seed, epoch]).generate_state(4, dtype=np.uint64)
    return EpochShuffle(num_samples, half_bits, (int(keys[0]), int(keys[1]), int(keys[2]), int(keys[3])))
