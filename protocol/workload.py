"""What a job trains on: data set, optimizer and schedule, precision, where the trained model goes.

These are the `spec.data`, `spec.training` and `spec.output` sections of a ResilientJob (camelCase on the
wire, snake_case in Python; unknown keys are refused) and the `Workload` document the operator puts in every
worker pod (`RJOB_WORKLOAD`). Every type validates on construction; a bad value raises pydantic's
ValidationError, which the operator and the agent turn into one line naming the field.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

WORKLOAD_ENV = "RJOB_WORKLOAD"
"""The pod environment variable holding the `Workload` JSON."""

MAX_WORKLOAD_BYTES = 64 * 1024


class _Wire(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True, use_enum_values=False
    )


class DataFormat(StrEnum):
    TOKENS = "tokens"
    """A flat binary file of token ids (`numpy.ndarray.tofile`), memory-mapped."""
    JSONL = "jsonl"
    """JSON lines with a text field, tokenized once with the tokenizer directory `tokenizer`."""
    SYNTHETIC = "synthetic"
    """The built-in learnable Markov-chain tokens (tests, demos); `numSamples` sequences."""


class TokenDtype(StrEnum):
    UINT16 = "uint16"
    UINT32 = "uint32"


class DataSpec(_Wire):
    """The training data. Sample i is tokens [i*seqLen, (i+1)*seqLen + 1) of the token stream (inputs and
    next-token targets); the order is a pure function of (seed, global step)."""

    path: str = Field(default="", max_length=4096, description="File inside the pod (a mounted volume).")
    format: DataFormat = Field(
        default=DataFormat.TOKENS,
        description="tokens (a flat binary file of token ids), jsonl (JSON lines of text, tokenized once "
        "with `tokenizer`) or synthetic (learnable generated tokens, for tests and demos).",
    )
    dtype: TokenDtype = Field(default=TokenDtype.UINT16, description="Token id type of a `tokens` file.")
    seq_len: int = Field(default=1024, ge=1, le=1 << 20, description="Tokens per sample.")
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="Seeds the sample order.")
    tokenizer: str = Field(
        default="", max_length=4096, description="`jsonl`: a tokenizer directory (tokenizer.json)."
    )
    text_field: str = Field(default="text", min_length=1, max_length=256, description="`jsonl`: the key.")
    num_samples: int = Field(default=4096, ge=1, le=2**40, description="`synthetic`: how many sequences.")

    @model_validator(mode="after")
    def _paths(self) -> DataSpec:
        if self.format is not DataFormat.SYNTHETIC and not self.path:
            raise ValueError(f"path: required for format {self.format.value}")
        if self.format is DataFormat.JSONL and not self.tokenizer:
            raise ValueError("tokenizer: a jsonl data set needs a tokenizer directory")
        return self


class Schedule(StrEnum):
    CONSTANT = "constant"
    COSINE = "cosine"


class Precision(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    """Autocast to bfloat16 for compute; fp32 master weights, gradients and optimizer state."""


class TrainingSpec(_Wire):
    """Optimizer (AdamW), learning-rate schedule, clipping and precision; defaults as torchtitan's."""

    steps: int = Field(
        default=1000,
        ge=1,
        le=2**40,
        description="Global steps; then the job succeeds (a synthetic: model runs until it is deleted).",
    )
    lr: float = Field(default=3e-4, gt=0, le=10, description="Peak learning rate.")
    betas: list[float] = Field(
        default_factory=lambda: [0.9, 0.95],
        min_length=2,
        max_length=2,
        description="AdamW betas (default [0.9, 0.95]).",
    )
    weight_decay: float = Field(
        default=0.1, ge=0, le=10, description="AdamW weight decay of matrices (not of norms, biases)."
    )
    eps: float = Field(default=1e-8, gt=0, le=1, description="AdamW epsilon.")
    warmup_steps: int = Field(default=0, ge=0, le=2**40, description="Linear warm-up from 0 to `lr`.")
    schedule: Schedule = Field(default=Schedule.CONSTANT, description="After warm-up: constant or cosine.")
    min_lr: float = Field(default=0.0, ge=0, le=10, description="Where the cosine schedule ends.")
    grad_clip_norm: float = Field(
        default=1.0, ge=0, le=1e6, description="Clip the global gradient norm to this; 0 turns it off."
    )
    precision: Precision = Field(
        default=Precision.FP32,
        description="fp32, or bf16 autocast on a GPU or NPU that computes it (fp32 weights and AdamW state).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> TrainingSpec:
        for index, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise ValueError(f"betas: element {index} must be in [0, 1), got {beta}")
        if self.min_lr > self.lr:
            raise ValueError(f"minLr: {self.min_lr} is above lr {self.lr}")
        if self.warmup_steps >= self.steps and self.warmup_steps > 0:
            raise ValueError(f"warmupSteps: {self.warmup_steps} must be < steps ({self.steps})")
        return self


class OutputSpec(_Wire):
    path: str = Field(
        min_length=1,
        max_length=4096,
        description="Directory inside the pod where the trained model is written in Hugging Face layout "
        "(config.json + safetensors, files readable by all) when the job completes, with the model "
        "directory's tokenizer, else the data's (`data.tokenizer`).",
    )


class WorkloadCheckpoint(_Wire):
    """Where periodic checkpoints go and how often (a step is due when either interval has passed)."""

    path: str = Field(default="", max_length=4096, description="Empty: no periodic checkpoints.")
    interval_s: float = Field(default=1800, gt=0, le=604800)
    interval_steps: int = Field(default=0, ge=0, le=2**40, description="0: by time only.")


class Workload(_Wire):
    """Everything a worker trains with besides the plan: the operator's one document to every pod."""

    model: str = Field(min_length=1, max_length=4096)
    data: DataSpec = Field(default_factory=lambda: DataSpec(format=DataFormat.SYNTHETIC, seq_len=16))
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    output: OutputSpec | None = None
    checkpoint: WorkloadCheckpoint = Field(default_factory=WorkloadCheckpoint)
    device: str = Field(default="cpu", pattern=r"^(cpu|cuda|npu)$", description="The pod's accelerator type.")

    @model_validator(mode="after")
    def _device_precision(self) -> Workload:
        if self.training.precision is Precision.BF16 and self.device == "cpu":
            raise ValueError(
                "training.precision: bf16 needs an accelerator (deviceResource); this job runs on CPU"
            )
        return self


def load_workload(text: str) -> Workload:
    """Parse the `RJOB_WORKLOAD` document; ValueError naming the field (one line) when it is bad."""
    if len(text.encode()) > MAX_WORKLOAD_BYTES:
        raise ValueError(f"{WORKLOAD_ENV}: larger than {MAX_WORKLOAD_BYTES} bytes")
    try:
        return Workload.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or WORKLOAD_ENV
        raise ValueError(f"{where}: {str(first['msg']).removeprefix('Value error, ')}") from None
