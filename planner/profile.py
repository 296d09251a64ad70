"""Model profiles: per-layer compute time and memory, the input every estimate is built from.

A profile lists the model's layers in execution order (embedding ... blocks ... head). Times are per
micro-batch at the job's micro-batch size; bytes are per layer (activations per micro-batch). Profiles load
from JSON or YAML with exactly the field names below; unknown keys are ignored so that profilers can attach
their own metadata.

A profile that knows its micro-batch size (`microbatch_size`, set by the operator from the job's spec) can be
rescaled to another (`at_microbatch`): fail-slow mitigation S2 may split micro-batches finer than the spec's
to balance a slow replica, and every estimate of such a plan must price its smaller micro-batches.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import PlannerError, error_from_validation

FloatArray = npt.NDArray[np.float64]

_BUILTIN_DIR = Path(__file__).parent / "profiles"


class LayerProfile(BaseModel):
    """One layer's cost on one device, per micro-batch."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    name: str = ""
    forward_s: float = Field(ge=0, allow_inf_nan=False, description="Forward time per micro-batch.")
    backward_s: float = Field(ge=0, allow_inf_nan=False, description="Backward time per micro-batch.")
    param_bytes: int = Field(ge=0, description="Parameter bytes (gradients take as much again).")
    optimizer_bytes: int = Field(ge=0, description="Optimizer state bytes.")
    activation_bytes: int = Field(ge=0, description="Activations kept for backward, per micro-batch.")
    output_bytes: int = Field(
        default=0, ge=0, description="Bytes sent to the next stage per micro-batch (optional; 0 = free)."
    )

    @property
    def state_bytes(self) -> int:
        """What a node must receive to own this layer: parameters and optimizer state."""
        return self.param_bytes + self.optimizer_bytes


class ModelProfile(BaseModel):
    """An ordered list of layer profiles plus how a stage scales over several GPUs of one node."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    name: str = "model"
    layers: tuple[LayerProfile, ...] = Field(min_length=1)
    multi_gpu_efficiency: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="Speed-up of a stage on d GPUs of one node is 1 + (d - 1) * efficiency "
        "(tensor parallelism); memory is split d ways.",
    )
    multi_gpu_speedup: dict[int, float] = Field(
        default_factory=dict, description="Measured speed-up per GPU count; overrides the efficiency rule."
    )
    microbatch_size: int | None = Field(
        default=None,
        ge=1,
        description="Samples per micro-batch the per-micro-batch figures are for (None: unknown, so the "
        "profile cannot be rescaled to another size).",
    )

    @field_validator("layers")
    @classmethod
    def _some_work(cls, value: tuple[LayerProfile, ...]) -> tuple[LayerProfile, ...]:
        # Every time the planner balances is a share of this work: with none, nothing can be balanced (and
        # the templates' rate bounds divide by it).
        if not any(layer.forward_s + layer.backward_s > 0 for layer in value):
            raise ValueError("every layer takes 0 s (forward_s + backward_s): profile the model's real times")
        return value

    @field_validator("multi_gpu_speedup")
    @classmethod
    def _speedups_positive(cls, value: dict[int, float]) -> dict[int, float]:
        for gpus, speedup in value.items():
            if gpus < 1 or speedup <= 0:
                raise ValueError(f"speed-up for {gpus} GPUs must be positive, got {speedup}")
        return value

    # ---- loading -------------------------------------------------------------------------------------
    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "profile") -> ModelProfile:
        """Validate a decoded JSON/YAML document; raises PlannerError naming the bad field."""
        if not isinstance(data, Mapping):
            raise PlannerError(source, "must be a mapping with a 'layers' list")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise error_from_validation(exc, prefix=source) from None

    @classmethod
    def load(cls, path: str | Path) -> ModelProfile:
        """Load a profile file (.json, .yaml or .yml) or a built-in profile name."""
        candidate = Path(path)
        if not candidate.exists() and (_BUILTIN_DIR / f"{path}.json").exists():
            candidate = _BUILTIN_DIR / f"{path}.json"
        if not candidate.exists():
            raise PlannerError(
                "profile",
                f"{str(path)!r} is no file and no built-in profile ({', '.join(builtin_profiles())})",
            )
        try:
            text = candidate.read_text()
        except OSError as exc:
            raise PlannerError("profile", f"cannot read {str(path)!r}: {exc.strerror}") from None
        try:
            data = json.loads(text) if candidate.suffix == ".json" else yaml.safe_load(text)
        except json.JSONDecodeError as exc:
            raise PlannerError("profile", f"{str(path)!r} is not valid JSON: {exc}") from None
        except yaml.YAMLError as exc:  # one line: where, and what (PyYAML's own text quotes the source)
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise PlannerError("profile", f"{str(path)!r} is not valid YAML{where}: {problem}") from None
        return cls.from_mapping(data, source="profile")

    # ---- micro-batch size ----------------------------------------------------------------------------
    def measured_at(self, microbatch_size: int) -> ModelProfile:
        """This profile, declared to be per micro-batch of `microbatch_size` samples."""
        return self._rebuilt(self.layers, microbatch_size)

    def _rebuilt(self, layers: tuple[LayerProfile, ...], microbatch_size: int) -> ModelProfile:
        # A new model, not `model_copy`: that would carry this one's cached prefix sums to other layers.
        return ModelProfile(
            name=self.name,
            layers=layers,
            multi_gpu_efficiency=self.multi_gpu_efficiency,
            multi_gpu_speedup=self.multi_gpu_speedup,
            microbatch_size=microbatch_size,
        )

    def at_microbatch(self, size: int) -> ModelProfile:
        """This profile for micro-batches of `size` samples: per-micro-batch times and activation and output
        bytes scale with the samples, parameter and optimizer bytes do not. The time model is linear, which
        is optimistic for small micro-batches (their fixed costs, kernel launches and per-message latency,
        do not shrink); callers that choose a size ask a margin for it. Itself when the size is the same
        or its own is unknown."""
        if self.microbatch_size is None or size == self.microbatch_size:
            return self
        if size < 1:
            raise PlannerError("microbatch_size", f"must be >= 1, got {size}")
        ratio = size / self.microbatch_size
        layers = tuple(
            layer.model_copy(
                update={
                    "forward_s": layer.forward_s * ratio,
                    "backward_s": layer.backward_s * ratio,
                    "activation_bytes": round(layer.activation_bytes * ratio),
                    "output_bytes": round(layer.output_bytes * ratio),
                }
            )
            for layer in self.layers
        )
        return self._rebuilt(layers, size)

    # ---- derived quantities --------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @cached_property
    def _prefix(self) -> dict[str, FloatArray]:
        columns = {
            "forward": [layer.forward_s for layer in self.layers],
            "backward": [layer.backward_s for layer in self.layers],
            "param": [float(layer.param_bytes) for layer in self.layers],
            "optimizer": [float(layer.optimizer_bytes) for layer in self.layers],
            "activation": [float(layer.activation_bytes) for layer in self.layers],
        }
        return {key: np.concatenate(([0.0], np.cumsum(values))) for key, values in columns.items()}

    def prefix(self, column: str) -> FloatArray:
        """Prefix sums (length L + 1) of `forward`, `backward`, `param`, `optimizer` or `activation`."""
        return self._prefix[column]

    def speedup(self, gpus: int) -> float:
        """How much faster a stage runs on `gpus` GPUs of one node than on one."""
        if gpus in self.multi_gpu_speedup:
            return self.multi_gpu_speedup[gpus]
        return 1.0 + (gpus - 1) * self.multi_gpu_efficiency

    def stage_times(self, start: int, end: int, gpus: int = 1) -> tuple[float, float]:
        """Forward and backward time per micro-batch of layers [start, end) on `gpus` GPUs."""
        self._check_range(start, end)
        scale = 1.0 / self.speedup(gpus)
        forward = self._prefix["forward"]
        backward = self._prefix["backward"]
        return (
            float(forward[end] - forward[start]) * scale,
            float(backward[end] - backward[start]) * scale,
        )

    def state_bytes(self, start: int, end: int) -> int:
        """Parameter + optimizer bytes of layers [start, end): what moving them costs."""
        self._check_range(start, end)
        param = self._prefix["param"]
        optimizer = self._prefix["optimizer"]
        return int(param[end] - param[start] + optimizer[end] - optimizer[start])

    def _check_range(self, start: int, end: int) -> None:
        if not 0 <= start < end <= self.num_layers:
            raise PlannerError("layers", f"range [{start}, {end}) outside [0, {self.num_layers})")


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped with the planner (usable wherever a profile path is)."""
    return sorted(path.stem for path in _BUILTIN_DIR.glob("*.json"))


def uniform_profile(
    num_layers: int,
    forward_s: float = 0.01,
    backward_s: float = 0.02,
    param_bytes: int = 100 * 2**20,
    optimizer_bytes: int = 200 * 2**20,
    activation_bytes: int = 20 * 2**20,
    name: str = "uniform",
) -> ModelProfile:
    """A profile of identical layers: the shape the papers' worked examples use."""
    layer = LayerProfile(
        forward_s=forward_s,
        backward_s=backward_s,
        param_bytes=param_bytes,
        optimizer_bytes=optimizer_bytes,
        activation_bytes=activation_bytes,
    )
    return ModelProfile(
        name=name, layers=tuple(layer.model_copy(update={"name": f"layer{i}"}) for i in range(num_layers))
    )
