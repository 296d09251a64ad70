"""A learnable synthetic dataset and the deterministic order of samples per global step.

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

from dataclasses import dataclass

import torch


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
        return torch.randperm(self.vocab, generator=generator)

    def sample(self, sample_id: int) -> torch.Tensor:
        """Tokens of one sample, shape (seq_len + 1,)."""
        if not 0 <= sample_id < self.num_samples:
            raise ValueError(f"sample_id: {sample_id} outside [0, {self.num_samples})")
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + sample_id + 1)
        successor = self._chain()
        tokens = torch.empty(self.seq_len + 1, dtype=torch.long)
        tokens[0] = torch.randint(self.vocab, (1,), generator=generator)
        noise = torch.rand(self.seq_len, generator=generator) < self.noise
        random_tokens = torch.randint(self.vocab, (self.seq_len,), generator=generator)
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
        generator = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def step_ids(self, step: int) -> list[int]:
        """The global batch of `step`, in order."""
        if step < 0:
            raise ValueError(f"step: must be >= 0, got {step}")
        start = step * self.global_batch
        ids: list[int] = []
        permutations: dict[int, torch.Tensor] = {}
        for position in range(start, start + self.global_batch):
            epoch, index = divmod(position, self.num_samples)
            if epoch not in permutations:
                permutations[epoch] = self._permutation(epoch)
            ids.append(int(permutations[epoch][index]))
        return ids

    def microbatch_ids(self, step: int, microbatch: int, microbatch_size: int) -> list[int]:
        """Ids of global micro-batch `microbatch` (0-based over the whole step) of `step`."""
        if microbatch_size < 1 or self.global_batch % microbatch_size:
            raise ValueError(
                f"microbatch_size: must divide global_batch={self.global_batch}, got {microbatch_size}"
            )
        ids = self.step_ids(step)
        return ids[microbatch * microbatch_size : (microbatch + 1) * microbatch_size]

    def epoch_of(self, step: int) -> int:
        return step * self.global_batch // self.num_samples
