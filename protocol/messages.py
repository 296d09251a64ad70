"""The messages agents and the operator exchange through Redis, and the one way to decode them.

Everything read from Redis is untrusted: a worker may be buggy, a key may be overwritten by hand, a hostile
process may share the server. `decode` therefore bounds the size, validates with pydantic and returns None
for anything bad, counting it by source and reason (`dropped`; the agents and the operator export the counts
as `rjob_telemetry_dropped_total{source,reason}`); it never raises.

Part of `resilientjob.protocol`: pydantic and the standard library only, plus the planner's public types that
the messages carry (a `Plan`, a `ModelProfile`).
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections import Counter
from collections.abc import Iterator
from enum import StrEnum
from typing import ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from resilientjob.planner.plan import Plan
from resilientjob.planner.profile import ModelProfile

MAX_MESSAGE_BYTES = 16 * 1024
"""Heartbeats, iterations and reports are tiny; anything larger is dropped unread."""

MAX_PLAN_BYTES = 16 * 2**20
"""A plan for thousands of nodes is a few MiB at most."""

MAX_PROFILE_BYTES = 8 * 2**20
"""A model profile of thousands of layers (a few hundred bytes each) with its report."""

MAX_ABORT_ERROR_CHARS = 300
"""A `WorkerAbort` carries at most this much of its error (`abort_line`)."""

PROFILE_NODE = 0
"""The node whose agent answers a `ModelProfileRequest`."""


class DropReason(StrEnum):
    OVERSIZED = "oversized"
    MALFORMED = "malformed"  # not UTF-8 JSON
    INVALID = "invalid"  # JSON, but not a valid message


DROPPED_HELP = "Messages read from Redis and dropped because they were oversized, malformed or invalid."
"""Help of `rjob_telemetry_dropped_total`: the metric the agents and the operator export `drop_counts` as."""

_DROPPED: Counter[tuple[str, DropReason]] = Counter()
_DROPPED_LOCK = threading.Lock()  # decode runs on the agents' threads as well as on event loops


def count_drop(source: str, reason: DropReason) -> None:
    """Count one message from `source` dropped for `reason` (also for drops decided past `decode`)."""
    with _DROPPED_LOCK:
        _DROPPED[source, reason] += 1


def drop_counts() -> dict[tuple[str, DropReason], int]:
    """Every (source, reason) pair seen in this process with its count (what the metric exports)."""
    with _DROPPED_LOCK:
        return dict(_DROPPED)


def export_drop_counts() -> None:
    """Export `drop_counts` as `rjob_telemetry_dropped_total{source,reason}` in prometheus_client's default
    registry, once per process: the agents' metrics and the operator's may share one (the local stack,
    tests), and both call this. prometheus_client is imported by that call, so that the protocol itself needs
    pydantic only."""
    from prometheus_client import REGISTRY
    from prometheus_client.core import CounterMetricFamily

    class DroppedMessages:
        def collect(self) -> Iterator[CounterMetricFamily]:
            family = CounterMetricFamily("rjob_telemetry_dropped", DROPPED_HELP, labels=["source", "reason"])
            for (source, reason), count in sorted(drop_counts().items()):
                family.add_metric([source, reason], count)
            yield family

    with contextlib.suppress(ValueError):  # registered already in this process
        REGISTRY.register(DroppedMessages())


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    sparse: ClassVar[bool] = False
    """Encoded without its unset (None) fields: a message that gained optional fields still reaches a
    reader of the older schema (which forbids fields it does not know) when they are not set."""


class Heartbeat(_Message):
    node: int = Field(ge=0, le=1_000_000)
    pod: str = Field(max_length=253)
    generation: int = Field(ge=-1)
    step: int = Field(ge=0)
    sent_at: float = Field(ge=0, allow_inf_nan=False, description="Unix time on the agent.")


class IterationRecord(_Message):
    # An agent may run a newer image than the operator (worker pods run `spec.image`): the record of every
    # step must not carry a field that is only set on a generation's first step.
    sparse = True

    node: int = Field(ge=0, le=1_000_000)
    generation: int = Field(ge=0)
    step: int = Field(ge=0)
    seconds: float = Field(gt=0, le=86400, allow_inf_nan=False, description="Wall time of this step.")
    samples: int = Field(ge=0, le=2**31, description="Samples this worker processed in the step.")
    sent_at: float = Field(ge=0, allow_inf_nan=False)
    compute_s: float | None = Field(
        default=None, ge=0, le=86400, allow_inf_nan=False, description="Of `seconds`, outside traced calls."
    )
    communication_s: float | None = Field(
        default=None, ge=0, le=86400, allow_inf_nan=False, description="Of `seconds`, inside traced calls."
    )
    loss: float | None = Field(
        default=None, ge=-1e9, le=1e9, allow_inf_nan=False, description="The job's loss of this step."
    )
    chaos_s: float | None = Field(
        default=None,
        ge=0,
        le=86400,
        allow_inf_nan=False,
        description="Of `compute_s`, the delay a chaos order (`rjob chaos slow`) added in this step: when a "
        "slowdown ordered on purpose took effect. Measurement only; detection never reads it.",
    )
    rendezvous_s: float | None = Field(
        default=None,
        ge=0,
        le=86400,
        allow_inf_nan=False,
        description="On a node's first step of a generation: how long its switch's rendezvous took.",
    )
    copy_s: float | None = Field(
        default=None,
        ge=0,
        le=86400,
        allow_inf_nan=False,
        description="On a node's first step of a generation: how long the layer copies it received took.",
    )
    copied_bytes: int | None = Field(
        default=None, ge=0, le=2**53, description="On a node's first step of a generation: bytes it received."
    )
    probe_s: float | None = Field(
        default=None,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="Now and then, after a step of a node that trains: its device's time for the probe "
        "product a parked node times (`agent._parked.measure`), its compute chaos order's stretch included. "
        "The operator judges a parked node's probe against these (`operator._failslow_parked`).",
    )


class SlowKind(StrEnum):
    COMPUTE = "compute"
    COMMUNICATION = "communication"


class SlowReport(_Message):
    """A worker's change-point detector saw its iteration time shift up (or back down: `recovered`)."""

    node: int = Field(ge=0, le=1_000_000)
    generation: int = Field(ge=0)
    step: int = Field(ge=0, description="The step whose arrival revealed the change.")
    onset_step: int = Field(default=0, ge=0, description="First step at the new level.")
    slowdown: float = Field(gt=0, le=1000, allow_inf_nan=False, description="New level / baseline level.")
    baseline_s: float = Field(gt=0, allow_inf_nan=False, description="Step time before the change.")
    level_s: float = Field(default=0.0, ge=0, allow_inf_nan=False, description="Step time after it.")
    kind: SlowKind = SlowKind.COMPUTE
    recovered: bool = False
    detected_at: float = Field(ge=0, allow_inf_nan=False)
    slowed_s: float = Field(
        default=0.0,
        ge=0,
        le=86400 * 365,
        allow_inf_nan=False,
        description="Seconds the worker's steps took from `onset_step` through `step`: how long the change "
        "had lasted when it was reported (0: not measured).",
    )


class WorkerAbort(_Message):
    """A node's workers abandoned step `step` of `generation` on a communication error (a collective or a
    receive failed, or timed out behind a peer), or in the switch to `generation` before it (`switching`),
    and wait, alive, for the next generation. Sent once per abandoned step by the node's agent
    (`agent.telemetry.Telemetry.record_abort`)."""

    # An agent may run a newer image than the operator: `switching` goes out only when it is set.
    sparse = True

    node: int = Field(ge=0, le=1_000_000)
    generation: int = Field(ge=0)
    step: int = Field(
        ge=1, description="The step abandoned, numbered as its `IterationRecord` will be once committed."
    )
    error: str = Field(max_length=MAX_ABORT_ERROR_CHARS, description="The error's first line, shortened.")
    collective_timeout_s: float = Field(
        gt=0,
        le=86400,
        allow_inf_nan=False,
        description="The worker's wait bound in the generation it abandoned (its collective timeout, or "
        "three of the plan's estimated steps when longer): how long a peer blocked behind a hung one waits "
        "before it aborts too.",
    )
    plan_timeout_s: float = Field(
        gt=0,
        le=86400,
        allow_inf_nan=False,
        description="How long the worker waits for the next generation before it exits.",
    )
    at: float = Field(ge=0, allow_inf_nan=False, description="Unix time on the agent.")
    switching: Literal[True] | None = Field(
        default=None,
        description="Set when the node failed while applying the generation's plan, before its first step: "
        "the plan's layer copies may be unfinished, and a re-formation must carry them again.",
    )


class PlanAnnouncement(_Message):
    """What the operator publishes for each generation (Redis key, pub/sub and the plan ConfigMap)."""

    generation: int = Field(ge=0)
    layout: str = Field(max_length=4096)
    policy: str = Field(max_length=64)
    plan: Plan
    published_at: float = Field(ge=0, allow_inf_nan=False)
    trigger: str = Field(default="", max_length=64, description="What caused this generation (a Reason).")
    nodes: list[int] = Field(default_factory=list, max_length=100_000, description="Nodes that changed.")
    reason: str = Field(default="", max_length=4096)
    strategy: str = Field(default="", max_length=32, description="Fail-slow mitigation, if any.")
    detect_s: float = Field(default=0.0, ge=0, allow_inf_nan=False, description="Measured detection time.")
    onset_step: int | None = Field(
        default=None, ge=0, description="Fail-slow: the step the slowdown dates from."
    )
    detected_step: int | None = Field(
        default=None, ge=0, description="Fail-slow: the step at which the operator opened the episode."
    )
    parked: list[int] = Field(
        default_factory=list, max_length=100_000, description="Slow nodes out of the layout (S4)."
    )
    restore: Plan | None = Field(
        default=None, description="The healthy plan to return to when the fail-slow episode ends."
    )


class ProfileRecord(_Message):
    """One worker's profile over its last few iterations (Falcon 4.3, "Profiling"), from its call trace:
    iteration time by ACF, split into compute and communication, and time per communication group."""

    node: int = Field(ge=0, le=1_000_000)
    generation: int = Field(ge=0)
    step: int = Field(ge=0, description="The last step the profile covers.")
    iterations: int = Field(ge=1, le=100_000)
    iteration_s: float = Field(gt=0, le=86400, allow_inf_nan=False)
    compute_s: float = Field(ge=0, le=86400, allow_inf_nan=False)
    communication_s: float = Field(ge=0, le=86400, allow_inf_nan=False)
    groups: dict[str, float] = Field(
        default_factory=dict,
        max_length=256,
        description="Seconds per iteration inside each group's calls, by group label (node ids: '0,1,2' "
        "for a collective, '0,1@1' for point-to-point with peer 1).",
    )
    sent_at: float = Field(ge=0, allow_inf_nan=False)


class ValidationTopology(StrEnum):
    RING = "ring"
    TREE = "tree"


class ValidationRequest(_Message):
    """The operator asks the workers of `generation` to hold training at an iteration boundary and run the
    validation pass (GEMM per device, link tests in the O(1) schedules). Ids only grow; a worker runs each id
    at most once."""

    id: int = Field(ge=1)
    generation: int = Field(ge=0)
    topology: ValidationTopology = ValidationTopology.RING
    suspects: list[int] = Field(default_factory=list, max_length=100_000, description="Suspected nodes.")
    reason: str = Field(default="", max_length=1024)
    requested_at: float = Field(ge=0, allow_inf_nan=False)


class LinkTiming(_Message):
    src: int = Field(ge=0, le=1_000_000, description="Sending node.")
    dst: int = Field(ge=0, le=1_000_000, description="Receiving node.")
    seconds: float = Field(ge=0, le=3600, allow_inf_nan=False)


class ValidationResult(_Message):
    """What a validation pass found, in node ids (one message per pass, written by the world's rank 0)."""

    id: int = Field(ge=1, description="The request's id.")
    generation: int = Field(ge=0)
    step: int = Field(ge=0, description="The iteration boundary at which training was held.")
    gemm_s: dict[int, float] = Field(default_factory=dict, max_length=100_000)
    links: list[LinkTiming] = Field(default_factory=list, max_length=100_000)
    slow_nodes: list[int] = Field(default_factory=list, max_length=100_000)
    slow_links: list[tuple[int, int]] = Field(default_factory=list, max_length=100_000)
    held_s: float = Field(ge=0, le=3600, allow_inf_nan=False, description="How long training was held.")
    finished_at: float = Field(ge=0, allow_inf_nan=False)


class ModelProfileRequest(_Message):
    """What node 0's agent must do before the first plan, while it waits for it: check that the model and the
    data can train (the model's checkpoint and the data live on volumes of the pods, which the operator
    cannot read), and make the model's per-layer profile when only a pod can (an `hf:<dir>` model without a
    given profile, or `spec.profile.measure`). Node 0 answers with a `ModelProfileReport`."""

    model: str = Field(min_length=1, max_length=4096)
    seq_len: int = Field(ge=1, le=1 << 20, description="Tokens per sample (`spec.data.seqLen`).")
    microbatch_size: int = Field(ge=1, le=2**20)
    measure: bool = Field(default=False, description="Time the layers on the device, not from the config.")
    profile: bool = Field(
        default=True, description="Whether the operator needs the profile (else: check only)."
    )
    devices_per_stage: int = Field(
        default=1, ge=1, le=64, description="Devices a stage is split over (`spec.gpusPerNode`)."
    )
    global_batch: int = Field(
        default=0, ge=0, le=2**31, description="Samples per step (`spec.globalBatchSize`; 0: not checked)."
    )


class ModelProfileReport(_Message):
    """Node 0's answer: the model and data checked (and the profile of the model as the runtime builds it,
    when asked), or why not."""

    request: ModelProfileRequest = Field(description="The request answered (a stale answer is ignored).")
    node: int = Field(ge=0, le=1_000_000)
    num_layers: int = Field(default=0, ge=0, le=100_000, description="Layers of the model the runtime built.")
    measured: bool = False
    profile: ModelProfile | None = None
    error: str = Field(default="", max_length=4096, description="One line naming the field, when failed.")
    error_field: str = Field(
        default="", max_length=128, pattern=r"^(spec(\.[A-Za-z]+)+)?$", description="The spec field to fix."
    )
    sent_at: float = Field(ge=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _profile_or_error(self) -> ModelProfileReport:
        if self.error:
            if self.profile is not None or not self.error_field:
                raise ValueError("a failed report names the field and holds no profile")
        elif self.error_field:
            raise ValueError("only a failed report names a field")
        elif (self.profile is not None) != self.request.profile:
            raise ValueError("a report holds a profile exactly when one was asked for")
        return self


M = TypeVar("M", bound=BaseModel)


def decode(model: type[M], raw: bytes | str | None, source: str, limit: int = MAX_MESSAGE_BYTES) -> M | None:
    """Validate one message; None (and a counted drop) for anything oversized, malformed or invalid."""
    if raw is None:
        return None
    data = raw.encode() if isinstance(raw, str) else raw
    if len(data) > limit:
        count_drop(source, DropReason.OVERSIZED)
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        count_drop(source, DropReason.MALFORMED)
        return None
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        json_broken = any(error["type"] == "json_invalid" for error in exc.errors())
        count_drop(source, DropReason.MALFORMED if json_broken else DropReason.INVALID)
        return None
    except (ValueError, RecursionError):
        count_drop(source, DropReason.MALFORMED)
        return None


def dropped(source: str, reason: DropReason) -> float:
    """How many messages from `source` were dropped for `reason` in this process (for tests and status)."""
    with _DROPPED_LOCK:
        return float(_DROPPED[source, reason])


def encode(message: BaseModel) -> bytes:
    return message.model_dump_json(exclude_none=isinstance(message, _Message) and message.sparse).encode()


WORKLOAD_TERMINATION_PREFIX = "workload: "
"""Starts a worker container's termination message that names the spec field which stopped it (the agent
writes it, `agent._termination`; the operator fails the job on it instead of replacing the node)."""


def workload_termination(message: str) -> tuple[str, str] | None:
    """(field, line) of a termination message the agent wrote for a workload error, else None. Read from
    the pod's status, so checked: one line, a `spec.` field, bounded."""
    if not message.startswith(WORKLOAD_TERMINATION_PREFIX):
        return None
    line = " ".join(message[len(WORKLOAD_TERMINATION_PREFIX) :].split())[:4096]
    field, _, rest = line.partition(": ")
    if not rest or not re.fullmatch(r"spec(\.[A-Za-z]+)+", field):
        return None
    return field, line


def abort_line(error: BaseException | str) -> str:
    """The first non-empty line of an error, shortened to fit a `WorkerAbort` (gloo's and NCCL's errors run
    to a stack of C++ frames)."""
    line = next((part.strip() for part in str(error).splitlines() if part.strip()), "")
    if not isinstance(error, str):
        line = f"{type(error).__name__}: {line}" if line else type(error).__name__
    return line if len(line) <= MAX_ABORT_ERROR_CHARS else line[: MAX_ABORT_ERROR_CHARS - 3] + "..."
