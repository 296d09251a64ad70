"""One worker's configuration, whoever starts it: the workload the operator hands to every pod (`spec.model`,
`spec.data`, `spec.training`, `spec.output`, checkpoints, device; `protocol.workload`) and the runtime's own
limits, which a pod takes from its command line (`spec.command`: `JobConfig.from_argv`).

Light on purpose: the pod agent parses its flags before it imports torch; the model, data and checkpoint
modules load only when a worker asks for them."""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from resilientjob.protocol.workload import DataFormat, DataSpec, TrainingSpec, Workload, WorkloadCheckpoint

if TYPE_CHECKING:
    from .checkpoint import Checkpointer
    from .data import TokenDataset
    from .models import ModelSpec

COLLECTIVE_TIMEOUT_S = 5.0
"""The default `collective_timeout_s` (`--collective-timeout`)."""

POD_PLAN_TIMEOUT_S = 120.0
"""A pod's default `--plan-timeout`: longer than a test's, since a cluster's replacement pod may take a while
to be scheduled and pulled."""


@dataclass(frozen=True, slots=True)
class JobConfig:
    """What every worker of a job needs besides the plan: the workload the operator hands to every pod
    (`spec.model`, `spec.data`, `spec.training`, `spec.output`, checkpoints, device) and the runtime's own
    limits."""

    workload: Workload = field(default_factory=lambda: Workload(model="gpt"))
    model_options: dict[str, object] = field(default_factory=dict)
    """Shape overrides of a built-in toy model (`gpt`, `llama`, `sleep`), e.g. hidden=32."""
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    """A collective or receive blocked on a dead peer fails after this long."""
    plan_timeout_s: float = 60.0
    """How long a worker waits for the next plan after a failure before giving up."""
    async_checkpoint: bool = True
    return_state: bool = False
    """Return each worker's final layer parameters (tests compare them with the reference run)."""
    cache_dir: str | None = None
    """Where a tokenized text data set is cached (None: the temporary directory)."""
    p2p_in_order: bool = False
    """Match pipeline messages by their order alone also on gloo, as NCCL and HCCL always do (tests)."""

    def __post_init__(self) -> None:
        for name in ("collective_timeout_s", "plan_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        seq_len = self.model_options.get("seq_len")
        if seq_len is not None and seq_len != self.workload.data.seq_len:
            raise ValueError(
                f"model_options: seq_len {seq_len} differs from data.seqLen {self.workload.data.seq_len}"
            )

    @classmethod
    def plain(
        cls,
        model: str = "gpt",
        *,
        steps: int = 10,
        lr: float = 3e-3,
        num_samples: int = 256,
        seed: int = 0,
        checkpoint_dir: str | None = None,
        checkpoint_interval: int = 5,
        model_options: dict[str, object] | None = None,
        **runtime: object,
    ) -> JobConfig:
        """A job on the built-in synthetic data with plain AdamW at a constant `lr` (no weight decay, no
        clipping), checkpointing every `checkpoint_interval` steps into `checkpoint_dir` if given: what
        the runtime's tests and benchmarks compare against a single-process reference."""
        options = dict(model_options or {})
        seq_len = int(options.get("seq_len", 16))  # type: ignore[call-overload]
        workload = Workload(
            model=model,
            data=DataSpec(format=DataFormat.SYNTHETIC, num_samples=num_samples, seed=seed, seq_len=seq_len),
            training=TrainingSpec(steps=steps, lr=lr, betas=(0.9, 0.999), weight_decay=0.0, grad_clip_norm=0),
            checkpoint=WorkloadCheckpoint(
                path=checkpoint_dir or "", interval_steps=checkpoint_interval, interval_s=604800
            ),
        )
        return cls(workload=workload, model_options=options, **runtime)  # type: ignore[arg-type]

    @classmethod
    def from_argv(cls, argv: list[str], workload: Workload) -> JobConfig:
        """A pod's configuration: `workload` and the runtime's limits from the pod's flags; raises ValueError
        naming the flag (and, for a flag that moved into the spec, where it went)."""
        parser = argparse.ArgumentParser(prog="resilientjob.agent", exit_on_error=False, add_help=False)
        parser.add_argument("--collective-timeout", type=float, default=COLLECTIVE_TIMEOUT_S)
        parser.add_argument("--plan-timeout", type=float, default=POD_PLAN_TIMEOUT_S)
        parser.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE")
        try:
            args, unknown = parser.parse_known_args(argv)
        except argparse.ArgumentError as exc:
            raise ValueError(f"{exc.argument_name}: {exc.message}") from None
        if unknown:
            moved = {"--steps": "spec.training.steps", "--lr": "spec.training.lr", "--seed": "spec.data.seed"}
            moved["--num-samples"] = "spec.data.numSamples"
            where = next((moved[flag] for flag in unknown if flag in moved), None)
            hint = f" (now {where})" if where else ""
            raise ValueError(f"arguments: unknown {' '.join(unknown)}{hint}")
        return cls(
            workload=workload,
            model_options=_model_options(args.model_option),
            collective_timeout_s=args.collective_timeout,
            plan_timeout_s=args.plan_timeout,
        )

    @property
    def steps(self) -> int:
        return self.workload.training.steps

    @property
    def checkpoint_dir(self) -> str | None:
        return self.workload.checkpoint.path or None

    def load_model(self) -> ModelSpec:
        """The job's model, its sequence length the data's."""
        from .models import load_model

        options = {"seq_len": self.workload.data.seq_len, **self.model_options}
        return load_model(self.workload.model, **options)

    def open_dataset(self, model: ModelSpec) -> TokenDataset:
        from .data import open_dataset

        cache = Path(self.cache_dir) if self.cache_dir else Path(tempfile.gettempdir()) / "rjob-data"
        return open_dataset(self.workload.data, vocab=model.vocab, cache_dir=cache)

    def checkpointer(self, shard: int, shards: int) -> Checkpointer | None:
        from .checkpoint import Checkpointer

        if not self.workload.checkpoint.path:
            return None
        return Checkpointer(
            Path(self.workload.checkpoint.path),
            self.workload.checkpoint.interval_steps,
            self.async_checkpoint,
            shard=shard,
            shards=shards,
        )


def _model_options(items: list[str]) -> dict[str, object]:
    options: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--model-option: expected KEY=VALUE, got {item!r}")
        try:
            options[key] = int(value)
        except ValueError:
            try:
                options[key] = float(value)
            except ValueError:
                raise ValueError(f"--model-option {key}: expected a number, got {value!r}") from None
    return options
