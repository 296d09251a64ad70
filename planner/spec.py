"""What the user asks for: the cluster (`ClusterSpec`), the job (`JobSpec`) and transition costs."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

GiB = 2**30


class ClusterSpec(BaseModel):
    """The machines a job runs on. Node ids are 0..nodes-1 of the initial cluster."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nodes: int = Field(ge=1, description="Nodes at job start.")
    gpus_per_node: int = Field(default=1, ge=1, description="Accelerators per node.")
    device_memory_bytes: int = Field(default=80 * GiB, gt=0, description="Memory of one accelerator.")
    inter_node_bandwidth: float = Field(
        default=25e9, gt=0, allow_inf_nan=False, description="Bytes/s between two nodes (one direction)."
    )
    intra_node_bandwidth: float = Field(
        default=200e9, gt=0, allow_inf_nan=False, description="Bytes/s between GPUs of one node."
    )
    message_latency_s: float = Field(
        default=0.0,
        ge=0,
        allow_inf_nan=False,
        description="Seconds one message costs besides its bytes (a pipeline hop, one step of a ring "
        "all-reduce): wake-ups, framing, scheduling. Measured by the agent's profiler; 0 = bandwidth only.",
    )


class JobSpec(BaseModel):
    """The training job's batch and fault-tolerance settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    global_batch: int = Field(ge=1, description="Samples per optimizer step; kept through every recovery.")
    microbatch_size: int = Field(ge=1, description="Samples per micro-batch.")
    fault_tolerance: int = Field(default=1, ge=0, description="f: simultaneous failures to survive.")
    dp_range: tuple[int, int] | None = Field(
        default=None, description="Inclusive bounds on data-parallel degree searched; None = all."
    )
    pp_range: tuple[int, int] | None = Field(
        default=None, description="Inclusive bounds on pipeline depth searched; None = all."
    )

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        if self.global_batch % self.microbatch_size:
            raise ValueError(
                f"global_batch {self.global_batch} is not a multiple of "
                f"microbatch_size {self.microbatch_size}"
            )
        for name in ("dp_range", "pp_range"):
            bounds = getattr(self, name)
            if bounds is not None and not 1 <= bounds[0] <= bounds[1]:
                raise ValueError(f"{name} must be 1 <= low <= high, got {bounds}")
        return self

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // self.microbatch_size


class TransitionCosts(BaseModel):
    """Fixed costs of changing state; the planner adds measured planning and transfer time to these."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    restart_s: float = Field(
        default=15.0,
        ge=0,
        description="Rebuilding process groups and resuming after a new layout (no reload).",
    )
    checkpoint_load_s: float = Field(
        default=120.0, ge=0, description="Full restart: launch, load the last checkpoint, warm up."
    )
    checkpoint_save_s: float = Field(default=30.0, ge=0, description="Writing one checkpoint.")
    checkpoint_interval_s: float = Field(default=1800.0, gt=0, description="Time between checkpoints.")
    detection_s: float = Field(default=2.0, ge=0, description="From a failure to the operator knowing it.")
    search_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="The planner's own search time in each candidate's transition. None measures it; a "
        "figure makes the choice among candidates reproducible (measured, two candidates with the same "
        "layout are told apart by a millisecond of search, whichever the host ran faster).",
    )


class CheckpointState(BaseModel):
    """What the job has saved, which decides what a checkpoint restart costs: the work since the last
    checkpoint actually written, all of it when none was, and no restart at all when the job writes none."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    configured: bool = Field(description="The job writes checkpoints somewhere a restart can read them.")
    step: int = Field(default=0, ge=0, description="Global steps committed so far.")
    last_step: int | None = Field(
        default=None, ge=0, description="Step of the last checkpoint written; None = none written yet."
    )

    @model_validator(mode="after")
    def _check(self) -> CheckpointState:
        if self.last_step is not None and self.last_step > self.step:
            raise ValueError(f"last_step {self.last_step} is after the current step {self.step}")
        return self

    def lost_steps(self) -> int | None:
        """Steps a restart redoes; None when there is nothing to restart from and nothing will be written."""
        if self.last_step is not None:
            return self.step - self.last_step
        return self.step if self.configured else None
