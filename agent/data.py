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
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

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

    def _permutation(self, epoch: int) -> torch.Tensor:
        return _epoch_permutation(self.num_samples, self.seed, epoch)

    def step_ids(self, step: int) -> list[int]:
        """The global batch of `step`, in order."""
        if step < 0:
            raise ValueError(f"step: must be >= 0, got {step}")
        return self._ids(step * self.global_batch, self.global_batch)

    def _ids(self, start: int, count: int) -> list[int]:
        """Ids at positions [start, start + count) of the endless stream of epochs."""
        ids: list[int] = []
        position = start
        while position < start + count:
            epoch, index = divmod(position, self.num_samples)
            take = min(self.num_samples - index, start + count - position)
            ids.extend(self._permutation(epoch)[index : index + take].tolist())
            position += take
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
        return self._ids(step * self.global_batch + microbatch * microbatch_size, microbatch_size)

    def epoch_of(self, step: int) -> int:
        return step * self.global_batch // self.num_samples


@functools.lru_cache(maxsize=4)
def _epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """Epoch `epoch`'s order (cached: every micro-batch of a step asks for the same one)."""
    generator = torch.Generator().manual_seed(seed * 7919 + epoch)
    return torch.randperm(num_samples, generator=generator, device="cpu")
