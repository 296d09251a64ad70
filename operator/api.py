"""The ResilientJob API (`resilientjob.io/v1alpha1`): pydantic models that are the source of truth for the
CRD (`scripts/gen_crds.py` generates `crds/` from them), for the operator's validation of every object it
reads, and for the status it writes.

Field names are camelCase on the wire (Kubernetes convention) and snake_case in Python. Every model forbids
unknown fields, so a typo in a manifest is an error naming the field rather than a silently ignored key.

Past 600 lines on purpose: one place holds the whole API, and every field carries the description that
`kubectl explain` and docs/crd-reference.md print (tests/operator/test_operator_crd.py keeps them all).
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Mapping
from decimal import ROUND_CEILING
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from resilientjob.planner.errors import PlannerError, error_from_validation
from resilientjob.planner.plan import Policy
from resilientjob.planner.profile import LayerProfile, ModelProfile, builtin_profiles
from resilientjob.protocol.models import ModelSource, model_source
from resilientjob.protocol.workload import DataSpec, OutputSpec, Precision, TrainingSpec

from . import _quantity

# The pods' part of the spec has a module of its own: it also lays itself on a pod manifest.
from ._api_pods import PodOverrides

GROUP = "resilientjob.io"
VERSION = "v1alpha1"
KIND = "ResilientJob"
PLURAL = "resilientjobs"
SINGULAR = "resilientjob"
SHORT_NAME = "rjob"
API_VERSION = f"{GROUP}/{VERSION}"

# What a model string may look like (`protocol.models` says what each names): a name, `synthetic:<profile>`,
# `hf:<directory or configuration>` or `package.module:function`.
MODEL_PATTERN = (
    r"^(synthetic:[a-z0-9][a-z0-9.-]*|hf:[^\s]+|[a-z0-9][a-z0-9.-]*"
    r"|[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*)$"
)


# A Kubernetes resource quantity without sign or exponent: `80Gi`, `64G`, `1.5Ti`, `85899345920`.
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
DEFAULT_DEVICE_MEMORY_BYTES = 80 * 2**30
"""The planner's memory per accelerator when `spec.deviceMemory` is not given (an 80 GB A100/H100)."""


def quantity_bytes(value: int | str) -> int:
    """Bytes of a Kubernetes quantity (an integer, or a string as `QUANTITY_PATTERN`), rounded up."""
    if isinstance(value, int):
        return value
    if re.fullmatch(QUANTITY_PATTERN, value) is None:
        raise ValueError(f"{value!r} is not a quantity such as 80Gi, 64G or 85899345920")
    return int(_quantity.value(value).to_integral_value(rounding=ROUND_CEILING))


def _immutable(what: str) -> dict[str, Any]:
    """A CEL transition rule: the field cannot change once the job exists (enforced by the API server)."""
    message = f"{what} is immutable: delete the job and apply it again to change it"
    return {"x-kubernetes-validations": [{"rule": "self == oldSelf", "message": message}]}


class _Api(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True, use_enum_values=False
    )


class DeviceResource(StrEnum):
    """The extended resource each worker pod requests (`none` runs on CPU)."""

    NVIDIA_GPU = "nvidia.com/gpu"
    ASCEND_NPU = "huawei.com/Ascend910"
    NONE = "none"

    @property
    def device_kind(self) -> str:
        """The workers' torch device type: cuda, npu (torch_npu) or cpu."""
        return {"nvidia.com/gpu": "cuda", "huawei.com/Ascend910": "npu"}.get(self.value, "cpu")


class Phase(StrEnum):
    """Where a job is in its life."""

    PENDING = "Pending"  # accepted, pods being created
    RUNNING = "Running"  # every planned worker is training
    RECONFIGURING = "Reconfiguring"  # a new generation was published and is being applied
    SUCCEEDED = "Succeeded"  # every planned worker finished training
    FAILED = "Failed"  # the spec is invalid or no plan can run the job


class ConditionType(StrEnum):
    VALID = "Valid"
    PLANNED = "Planned"
    DEGRADED = "Degraded"
    COMPLETE = "Complete"
    TELEMETRY_CURRENT = "TelemetryCurrent"
    """False while Redis is away: the throughput, step and loss shown are as of its last answer. Set from
    the first outage on (a job that never lost Redis has no such condition)."""
    WORKERS_READY = "WorkersReady"
    """True while every worker pod the job asked for runs; False with why not (`_workers_ready`). From the
    first plan on."""


class Reason(StrEnum):
    """Named reasons for conditions and Events; tools match on these, never on message text."""

    SPEC_VALID = "SpecValid"
    INVALID_SPEC = "InvalidSpec"
    PLANNED = "Planned"
    PLAN_INFEASIBLE = "PlanInfeasible"
    NODE_FAILED = "NodeFailed"
    HEARTBEAT_EXPIRED = "HeartbeatExpired"
    NODE_SLOW = "NodeSlow"
    NODE_RECOVERED = "NodeRecovered"
    NODE_JOINED = "NodeJoined"
    SLOW_LINK_FOUND = "SlowLinkFound"
    SLOW_DEVICE_FOUND = "SlowDeviceFound"
    SLOW_REPORT_DISMISSED = "SlowReportDismissed"
    VALIDATION_REQUESTED = "ValidationRequested"
    VALIDATION_TIMED_OUT = "ValidationTimedOut"
    REPLANNED = "Replanned"
    ALL_HEALTHY = "AllHealthy"
    TRAINING_COMPLETE = "TrainingComplete"
    WAITING_FOR_PROFILE = "WaitingForProfile"
    PROFILE_REPORTED = "ProfileReported"
    PROFILE_FAILED = "ProfileFailed"
    CHECKING_WORKLOAD = "CheckingWorkload"
    INVALID_WORKLOAD = "InvalidWorkload"
    NODE_REPLACED = "NodeReplaced"
    REPLACEMENT_BACKOFF = "ReplacementBackoff"
    REDIS_UNAVAILABLE = "RedisUnavailable"
    REDIS_AVAILABLE = "RedisAvailable"
    CHECKPOINT_NODE_LOCAL = "CheckpointNodeLocal"
    WAITING_FOR_EARLIER_JOB = "WaitingForEarlierJob"
    WAITING_FOR_REPLACEMENTS = "WaitingForReplacements"
    RESTART_LIMIT_EXCEEDED = "RestartLimitExceeded"
    LOST_AFTER_TRAINING = "LostAfterTraining"
    COLLECTIVE_FAILED = "CollectiveFailed"
    PODS_REFUSED = "PodsRefused"
    POD_NOT_STARTING = "PodNotStarting"
    NODE_HUNG = "NodeHung"
    POD_UNSCHEDULABLE = "PodUnschedulable"
    PODS_STARTING = "PodsStarting"
    ALL_WORKERS_RUNNING = "AllWorkersRunning"


class LayerSpec(_Api):
    """One layer of an inline profile (per micro-batch, on one device)."""

    name: str = Field(default="", max_length=253, description="The layer's name (default layer<index>).")
    forward_s: float = Field(ge=0, le=3600, description="Forward time per micro-batch, seconds.")
    backward_s: float = Field(ge=0, le=3600, description="Backward time per micro-batch, seconds.")
    param_bytes: int = Field(ge=0, description="Parameter bytes.")
    optimizer_bytes: int = Field(ge=0, description="Optimizer state bytes.")
    activation_bytes: int = Field(ge=0, description="Activations kept for backward per micro-batch.")
    output_bytes: int = Field(default=0, ge=0, description="Bytes sent to the next stage per micro-batch.")


class ConfigMapKeyRef(_Api):
    name: str = Field(min_length=1, max_length=253, description="ConfigMap in the job's namespace.")
    key: str = Field(
        default="profile.json", min_length=1, max_length=253, description="Key holding JSON/YAML."
    )


class ProfileSource(_Api):
    """Where the per-layer profile comes from: exactly one of inline, configMapRef or measure."""

    inline: list[LayerSpec] | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="The layers in order, per micro-batch of microBatchSize on one device (`rjob profile "
        "--inline` writes them).",
    )
    config_map_ref: ConfigMapKeyRef | None = Field(
        default=None, description="A ConfigMap key holding the profile as JSON or YAML (`rjob profile`)."
    )
    measure: bool = Field(
        default=False,
        description="Node 0's agent times the layers on its device before the first plan (the result is "
        "kept in the ConfigMap <job>-profile).",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> ProfileSource:
        given = sum([self.inline is not None, self.config_map_ref is not None, self.measure])
        if given != 1:
            raise ValueError("set exactly one of inline, configMapRef or measure")
        return self


class StrategyOverheads(_Api):
    """Fixed costs (seconds) of each fail-slow mitigation level, the ski-rental 'buy' prices. Two of them
    are also the planner's transition costs at every failure (eq. 8): `topologyS` a new layout's, `restartS`
    a checkpoint restart's (before the copies and the steps redone)."""

    microbatch_s: float = Field(default=1.0, ge=0, le=86400, description="Rebalance micro-batches (S2).")
    topology_s: float = Field(
        default=20.0,
        ge=0,
        le=86400,
        description="Move stages off a slow node (S3); also the planner's fixed cost of any layout change.",
    )
    restart_s: float = Field(
        default=120.0,
        ge=0,
        le=86400,
        description="Checkpoint and restart (S4); also the planner's fixed cost of a checkpoint restart.",
    )


class FailSlowSpec(_Api):
    """Fail-slow detection and mitigation (Falcon): what counts as slow, and what each mitigation costs."""

    enabled: bool = Field(
        default=True, description="Detect slow workers and links and mitigate them; false: fail-stop only."
    )
    slowdown_threshold: float = Field(
        default=1.1,
        gt=1,
        le=100,
        description="A worker is slow when its compute time exceeds the median of the workers planned "
        "the same work x this (of all the other workers, each scaled by its planned share of the work, "
        "where fewer than two others do the same work), for at least minDurationS.",
    )
    min_duration_s: float = Field(
        default=5.0,
        ge=0,
        le=86400,
        description="Ignore slowdowns shorter than this (seconds), timed from the onset the worker's "
        "change-point detector found.",
    )
    validation_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="How long to wait for a validation pass's result before the episode goes on without it.",
    )
    drained_recheck_s: float = Field(
        default=60.0,
        ge=1,
        le=86400,
        description="A slow device that S2 drained of its micro-batches returns on its agent's recovery "
        "report; when none has come this long after the drain (the node recovered right as it was drained, "
        "or Redis lost the report), a validation pass times the device again, then at doubling intervals up "
        "to 16x this, and brings it back once it times within half the threshold's excess of the median of "
        "the other healthy devices.",
    )
    parked_recheck_s: float = Field(
        default=60.0,
        ge=1,
        le=86400,
        description="A slow device that S4 parked returns on its agent's recovery report, from the probe "
        "product it times while parked; when none has come this long after the park (the node recovered "
        "before its probe had a level of the slowdown), its probe is judged against the training nodes' "
        "own timings of the same product, and it is taken back once three windows of its probes in a row "
        "read within half the threshold's excess of their median. A node taken back this way that is "
        "parked again waits twice as long (up to 16x this): a slowdown that only load shows, which an idle "
        "device's probe cannot see.",
    )
    micro_batch_split: int = Field(
        default=1,
        ge=1,
        le=8,
        description="Mitigation S2 may cut micro-batches into up to this many smaller ones when whole "
        "ones are too coarse to balance a slow worker (1: never). Worth it where a micro-batch's fixed "
        "costs are small against its compute (large models, long sequences); on tiny ones the extra "
        "micro-batches cost more than they win.",
    )
    overheads: StrategyOverheads = Field(default_factory=StrategyOverheads)


class ChaosSpec(_Api):
    """Fault injection for drills and demos (`rjob chaos slow|break|hang`): off unless a job opts in. (`rjob
    chaos kill` deletes a pod, which anyone allowed to delete pods can do: it needs no opt-in.)"""

    enabled: bool = Field(
        default=False,
        description="Let workers obey chaos orders (a slowdown of their compute or a link, a broken or hung "
        "collective); never on for production.",
    )


class CheckpointSpec(_Api):
    volume: str | None = Field(
        default=None,
        max_length=253,
        description="PersistentVolumeClaim name; a restart from a checkpoint needs every worker to read it "
        "(ReadWriteMany). Unset: the path is an emptyDir of each pod, node-local, so a restart finds no "
        "complete checkpoint and starts over from the initial weights (and is priced so).",
    )
    path: str = Field(
        default="/checkpoints",
        min_length=1,
        max_length=4096,
        description="Directory of the checkpoints in every worker pod, on `volume` when set; a path holds "
        "one job's checkpoints.",
    )
    interval_s: int = Field(default=1800, ge=10, le=604800, description="Seconds between checkpoints.")
    interval_steps: int = Field(
        default=0,
        ge=0,
        le=2**40,
        description="Also checkpoint every this many steps (0: by time only). The last step is always saved.",
    )
    restart_limit: int = Field(
        default=3,
        ge=0,
        le=1000,
        description="Restarts from the checkpoint after every node of the plan failed, in a row with no step "
        "committed past the failure before, that the job makes; one more such failure ends it (a crash that "
        "every worker meets at the same step). 0: the first ends it.",
    )


class VolumeSpec(_Api):
    """A PersistentVolumeClaim mounted into every worker pod (model directories, data sets, outputs)."""

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="The volume's name in the pod.",
    )
    claim_name: str = Field(
        min_length=1, max_length=253, description="PersistentVolumeClaim in the job's namespace."
    )
    mount_path: str = Field(
        min_length=2, max_length=4096, pattern=r"^/", description="Where it is mounted in the worker."
    )
    read_only: bool = Field(default=False, description="Mount it read-only (model directories, data sets).")


class SecretKeyRef(_Api):
    """A key of a Secret in the job's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Secret in the job's namespace.")
    key: str = Field(default="password", min_length=1, max_length=253, description="Key holding the value.")


class RedisSpec(_Api):
    """The job's Redis, when not the operator's default one."""

    url: str | None = Field(
        default=None,
        max_length=2048,
        pattern=r"^rediss?://",
        description="redis:// or rediss:// URL; empty = the operator's default.",
    )
    password_secret_ref: SecretKeyRef | None = Field(
        default=None, description="The Redis password; empty: the operator's default (or none)."
    )


def _spec_rules(schema: dict[str, Any]) -> None:
    """The spec's CEL rules. A field's own `self == oldSelf` is not checked when the field is absent on
    either side, so adding or removing an optional section (`failSlow: {enabled: false}` on a running job)
    passed as no change: each optional field also keeps its presence."""
    rules: list[dict[str, str]] = [
        # fieldPath: the API server's refusal names the field (`spec.faultTolerance: ...`).
        {
            "rule": "self.faultTolerance < self.nodes",
            "message": "faultTolerance must be < nodes",
            "fieldPath": ".faultTolerance",
        },
        {
            "rule": "self.globalBatchSize % self.microBatchSize == 0",
            "message": "globalBatchSize must be a multiple of microBatchSize",
            "fieldPath": ".globalBatchSize",
        },
    ]
    required = set(schema.get("required") or ())
    for name in schema.get("properties") or {}:
        if name not in required:
            rules.append(
                {
                    "rule": f"has(self.{name}) == has(oldSelf.{name})",
                    "message": f"{name} is immutable: it cannot be added or removed once applied (delete the "
                    "job and apply it again)",
                    "fieldPath": f".{name}",
                }
            )
    schema["x-kubernetes-validations"] = rules


class ResilientJobSpec(_Api):
    """What the user asks for. No field can change while the job exists: delete the job and apply it again."""

    model_config = ConfigDict(json_schema_extra=_spec_rules)

    # Immutable, as everything the operator reads when it takes the job on: a running operator does not
    # re-read the spec, so an accepted edit was silently ignored until the operator restarted (then applied
    # half-way: new pods with the new image beside the old ones).
    image: str = Field(
        min_length=1,
        max_length=1024,
        description="Worker container image.",
        json_schema_extra=_immutable("image"),
    )
    command: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="Worker command; empty = the ResilientJob agent.",
        json_schema_extra=_immutable("command"),
    )
    model: str = Field(
        min_length=1,
        max_length=512,
        pattern=MODEL_PATTERN,
        description="hf:<dir> (a Hugging Face save_pretrained directory in the pod), hf:<family>?k=v, "
        "llama2-7b | gpt3-2.7b | gpt3-6.7b (trained with random initialisation), gpt | llama | sleep (toy "
        "models), module:function, or synthetic:<profile> (a simulation of the control plane, no training).",
        json_schema_extra=_immutable("model"),
    )
    profile: ProfileSource | None = Field(default=None, json_schema_extra=_immutable("profile"))
    nodes: int = Field(
        ge=1,
        le=4096,
        description="Worker pods (one per node) at start.",
        json_schema_extra=_immutable("nodes"),
    )
    gpus_per_node: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Accelerators per worker pod: a pipeline stage spans them (tensor parallel).",
        json_schema_extra=_immutable("gpusPerNode"),
    )
    device_resource: DeviceResource = Field(
        default=DeviceResource.NONE, json_schema_extra=_immutable("deviceResource")
    )
    device_memory: int | str | None = Field(
        default=None,
        description="Memory of one accelerator as a quantity (80Gi, 64G, or bytes): the planner keeps "
        "every stage's peak within it and splits the model into pipeline stages where a whole replica does "
        "not fit. Empty: 80Gi.",
        json_schema_extra={**_immutable("deviceMemory"), "pattern": QUANTITY_PATTERN},
    )
    global_batch_size: int = Field(
        ge=1,
        le=2**24,
        description="Samples per optimizer step, kept through every failure and mitigation.",
        json_schema_extra=_immutable("globalBatchSize"),
    )
    micro_batch_size: int = Field(
        ge=1,
        le=2**20,
        description="Samples per micro-batch; globalBatchSize is a multiple of it.",
        json_schema_extra=_immutable("microBatchSize"),
    )
    fault_tolerance: int = Field(
        default=1,
        ge=0,
        le=4095,
        description="f: simultaneous failures to survive.",
        json_schema_extra=_immutable("faultTolerance"),
    )
    replace_failed_nodes: bool = Field(
        default=True,
        description="Ask for a new pod (a new node id) in a fenced node's place, which joins the job when it "
        "runs; false keeps the job on the nodes it has left.",
        json_schema_extra=_immutable("replaceFailedNodes"),
    )
    policy: Policy = Field(default=Policy.AUTO, json_schema_extra=_immutable("policy"))
    fail_slow: FailSlowSpec = Field(
        default_factory=FailSlowSpec,
        description="Fail-slow detection and mitigation (Falcon).",
        json_schema_extra=_immutable("failSlow"),
    )
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec,
        description="Where and how often the workers save the job's state (a restart's starting point).",
        json_schema_extra=_immutable("checkpoint"),
    )
    chaos: ChaosSpec = Field(default_factory=ChaosSpec, json_schema_extra=_immutable("chaos"))
    redis: RedisSpec = Field(
        default_factory=RedisSpec,
        description="The job's Redis (heartbeats, telemetry, plans); empty: the operator's.",
        json_schema_extra=_immutable("redis"),
    )
    data: DataSpec | None = Field(
        default=None,
        description="The training data; empty: synthetic tokens (numSamples 4096, seqLen 16).",
        json_schema_extra=_immutable("data"),
    )
    training: TrainingSpec = Field(default_factory=TrainingSpec, json_schema_extra=_immutable("training"))
    # Immutable like the model: the pods carry these from creation, so a later edit would never reach them.
    output: OutputSpec | None = Field(
        default=None,
        description="Where the trained model is written when the job completes.",
        json_schema_extra=_immutable("output"),
    )
    volumes: list[VolumeSpec] = Field(
        default_factory=list,
        max_length=32,
        description="Claims mounted into every worker pod (model directories, data, outputs).",
        json_schema_extra=_immutable("volumes"),
    )
    pod_overrides: PodOverrides = Field(
        default_factory=PodOverrides,
        description="What the job's pods add to the operator's defaults (the job wins): node selector, "
        "tolerations, affinity, priority class, environment, CPU and memory, image pull secrets, service "
        "account, labels and annotations. The store pod takes only what places and admits it.",
        json_schema_extra=_immutable("podOverrides"),
    )

    @field_validator("device_memory", mode="before")
    @classmethod
    def _device_memory_quantity(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError(f"{value!r}: a number of bytes or a quantity such as 80Gi")
        if quantity_bytes(value) < 1:
            raise ValueError(f"{value!r}: an accelerator has at least one byte")
        return value

    @property
    def device_memory_bytes(self) -> int:
        """Bytes of one accelerator's memory, as the planner takes it."""
        return (
            DEFAULT_DEVICE_MEMORY_BYTES if self.device_memory is None else quantity_bytes(self.device_memory)
        )

    @model_validator(mode="after")
    def _cross_field(self) -> ResilientJobSpec:
        # The same rules as the CRD's CEL validations: a real API server rejects these objects, the
        # emulator does not, so the operator checks again and reports the field in a condition.
        if self.fault_tolerance >= self.nodes:
            raise PlannerError("faultTolerance", f"{self.fault_tolerance} must be < nodes ({self.nodes})")
        if self.global_batch_size % self.micro_batch_size:
            raise PlannerError(
                "globalBatchSize",
                f"{self.global_batch_size} is not a multiple of microBatchSize {self.micro_batch_size}",
            )
        try:
            source = model_source(self.model)
        except ValueError as exc:
            raise PlannerError("model", str(exc).removeprefix("model: ")) from None
        synthetic = self.model.removeprefix("synthetic:")
        if source is ModelSource.SYNTHETIC and self.profile is None and synthetic not in builtin_profiles():
            raise PlannerError(
                "model",
                f"{synthetic!r} is not a built-in profile ({', '.join(builtin_profiles())}): give "
                "spec.profile",
            )
        if source is ModelSource.SYNTHETIC and self.profile is not None and self.profile.measure:
            raise PlannerError("profile.measure", "a synthetic model has no layers to measure")
        if self.training.precision is Precision.BF16 and self.device_resource is DeviceResource.NONE:
            raise PlannerError(
                "training.precision", "bf16 needs an accelerator (deviceResource); this job runs on CPU"
            )
        if self.output is not None and source in (
            ModelSource.SYNTHETIC,
            ModelSource.TOY,
            ModelSource.FUNCTION,
        ):
            raise PlannerError("output", f"model {self.model} has no Hugging Face layout to export")
        if self.output is not None and source is ModelSource.HF_DIRECTORY:
            model_dir = posixpath.normpath(self.model.removeprefix("hf:"))
            if posixpath.normpath(self.output.path) == model_dir:
                raise PlannerError(
                    "output.path",
                    f"{self.output.path} is the model's own directory: the trained model would replace the "
                    "one the job starts from (and a restart from the initial weights would read it)",
                )
        self._check_volumes()
        return self

    def _check_volumes(self) -> None:
        names = [volume.name for volume in self.volumes]
        paths = [volume.mount_path.rstrip("/") for volume in self.volumes]
        for index, volume in enumerate(self.volumes):
            if names.index(volume.name) != index:
                raise PlannerError(f"volumes.{index}.name", f"{volume.name!r} is used twice")
            if paths.index(paths[index]) != index:
                raise PlannerError(f"volumes.{index}.mountPath", f"{volume.mount_path} is mounted twice")
            # The pod's own mounts: the scratch /tmp, the checkpoint directory, the Downward API files.
            if paths[index] in ("/tmp", self.checkpoint.path.rstrip("/"), "/etc/podinfo"):
                raise PlannerError(
                    f"volumes.{index}.mountPath", f"{volume.mount_path} is one of the pod's own mounts"
                )


class Condition(_Api):
    """One aspect of the job's state, as Kubernetes conditions are (Valid, Planned, Degraded, ...)."""

    type: ConditionType = Field(
        description="Valid, Planned, Degraded, WorkersReady, Complete or TelemetryCurrent."
    )
    status: str = Field(pattern=r"^(True|False|Unknown)$", description="True, False or Unknown.")
    reason: Reason
    message: str = Field(default="", max_length=32768, description="Why, in one line naming any field.")
    last_transition_time: str = Field(default="", description="RFC 3339.")


class CandidateStatus(_Api):
    """One plan the planner considered, with the numbers that decided it."""

    policy: str = Field(description="reroute, dynamic, templates or checkpoint.")
    layout: str = Field(description="DP x PP layout, e.g. DP2 PP[3,2].")
    step_time_s: float = Field(description="Estimated seconds per optimizer step.")
    transition_s: float = Field(
        description="Estimated seconds to switch to it (copies, restart, lost steps)."
    )
    score: float = Field(
        description="Effective samples/s: throughput over the time between failures less the transition "
        "(Odyssey eq. 8); the highest wins under policy auto."
    )
    feasible: bool = Field(default=True, description="Whether it can run the job at all.")
    reason: str = Field(default="", description="What it does, or why it cannot run.")


class Decision(_Api):
    """The last plan the operator published, and the candidates it weighed."""

    generation: int = Field(ge=0, description="The plan generation it published.")
    trigger: Reason
    nodes: list[int] = Field(default_factory=list, description="Nodes that failed, slowed or joined.")
    policy: str = Field(description="The policy of the plan chosen.")
    layout: str = Field(description="Its DP x PP layout.")
    strategy: str = Field(
        default="",
        description="Fail-slow mitigation applied (microbatch, topology, replace, restore); empty otherwise.",
    )
    reason: str = Field(default="", description="Why, in words.")
    planning_s: float = Field(default=0.0, ge=0, description="Seconds the planner took.")
    candidates: list[CandidateStatus] = Field(
        default_factory=list, max_length=64, description="Every plan the planner weighed."
    )
    decided_at: str = Field(default="", description="RFC 3339.")


class Recovery(_Api):
    """One recovery (a failure, a slowdown, a join) and its measured times."""

    generation: int = Field(ge=0, description="The generation that recovered.")
    trigger: Reason
    nodes: list[int] = Field(default_factory=list, description="Nodes that failed, slowed or joined.")
    policy: str = Field(description="The policy of the plan published.")
    layout: str = Field(description="Its DP x PP layout.")
    strategy: str = Field(default="", description="Fail-slow mitigation applied, if any.")
    detect_s: float = Field(
        default=0.0, ge=0, description="Measured: last sign of life (or fail-slow onset) to detection."
    )
    onset_step: int | None = Field(
        default=None, ge=0, description="Fail-slow: the step the slowdown dates from."
    )
    detected_step: int | None = Field(
        default=None, ge=0, description="Fail-slow: the step at which the operator opened the episode."
    )
    plan_s: float = Field(default=0.0, ge=0, description="Seconds the planner took.")
    rendezvous_s: float | None = Field(
        default=None,
        ge=0,
        description="Measured by the workers: the slowest one's rendezvous into the generation.",
    )
    copy_s: float | None = Field(
        default=None,
        ge=0,
        description="Measured by the workers: the slowest one's peer-to-peer layer copies.",
    )
    copied_bytes: int | None = Field(
        default=None, ge=0, description="Bytes the workers received in those copies."
    )
    at: str = Field(default="", description="RFC 3339: when it was published.")


class WaitingReplacement(_Api):
    """A failed worker whose replacement pod waits out its crash-loop backoff."""

    strikes: int = Field(ge=0, description="Quick failures in a row of the pods this one replaces.")
    not_before: str = Field(default="", description="RFC 3339: no replacement pod before this time.")


class WholeJobLoss(_Api):
    """Every node of a generation failed at once: the job restarts from its checkpoint on replacements."""

    generation: int = Field(ge=0, description="The generation whose every node failed.")
    step: int = Field(ge=0, description="Steps committed when it failed (the most of this run of losses).")
    in_a_row: int = Field(
        ge=1, description="Such failures in a row with no step committed past the one before."
    )


class CapacityStatus(_Api):
    """Replacement of failed workers: the operator keeps `spec.nodes` worker pods asked for."""

    next_node_id: int = Field(
        default=0, ge=0, description="Node id the next replacement pod gets; ids are never reused."
    )
    replaced: int = Field(default=0, ge=0, description="Replacement pods created so far.")
    waiting: list[WaitingReplacement] = Field(
        default_factory=list, max_length=10_000, description="Replacements held back by their backoff."
    )
    whole_job_loss: WholeJobLoss | None = Field(
        default=None,
        description="The last time every node of the plan failed at once (`checkpoint.restartLimit`).",
    )


class ResilientJobStatus(_Api):
    """What the operator observed and decided: the job's durable record (Redis can be rebuilt from it)."""

    phase: Phase = Phase.PENDING
    conditions: list[Condition] = Field(default_factory=list, description="The job's conditions.")
    plan_generation: int = Field(default=-1, ge=-1, description="-1 until the first plan is published.")
    layout: str = Field(default="", description="The current plan's DP x PP layout.")
    policy: str = Field(default="", description="The current plan's policy.")
    workers: str = Field(default="", description="alive/total, for the printer column.")
    workers_alive: int = Field(default=0, ge=0, description="Workers of the current plan at work.")
    workers_total: int = Field(default=0, ge=0, description="Workers of the current plan.")
    failed_nodes: list[int] = Field(default_factory=list, description="Every node that failed so far.")
    fenced_nodes: list[int] = Field(
        default_factory=list,
        description="Nodes fenced (their pods deleted) and not taken back by a later generation; recorded "
        "before the pods are deleted, so a restarted operator plans around them even with Redis lost.",
    )
    slow_nodes: list[int] = Field(default_factory=list, description="Nodes of the current fail-slow episode.")
    slow_links: list[str] = Field(
        default_factory=list,
        max_length=10_000,
        description="Slow links that validation named in the current fail-slow episode, as 'src->dst'.",
    )
    parked_nodes: list[int] = Field(
        default_factory=list, description="Slow nodes taken out of the layout by mitigation S4."
    )
    last_decision: Decision | None = Field(default=None, description="The last plan decision.")
    throughput: float = Field(default=0.0, ge=0, description="Measured samples per second.")
    step: int = Field(default=0, ge=0, description="Committed global steps so far.")
    loss: float | None = Field(default=None, description="Training loss of the last committed step.")
    estimated_throughput: float = Field(default=0.0, ge=0, description="The plan's estimate, samples/s.")
    recoveries: list[Recovery] = Field(
        default_factory=list, max_length=50, description="The last 50 recoveries, oldest first."
    )
    capacity: CapacityStatus = Field(default_factory=CapacityStatus)


RECOVERY_HISTORY = 50


def parse_spec(raw: Mapping[str, Any] | None, *, as_served: bool = False) -> ResilientJobSpec:
    """Validate a manifest's spec; raises PlannerError naming the field as `spec.<camelCaseField>`.

    `as_served`: as strictly as the API server's schema takes a manifest (`rjob plan -f` on a file no server
    has seen): JSON's types exactly (`nodes: "8"` is no integer) and the camelCase names only (the Python
    names, which this model also takes, are unknown fields there)."""
    if not isinstance(raw, Mapping):
        raise PlannerError("spec", "missing or not a mapping")
    try:
        if as_served:
            text = json.dumps(dict(raw), default=str)  # YAML's dates and the like: strings, as JSON has
            return ResilientJobSpec.model_validate_json(text, strict=True, by_alias=True, by_name=False)
        return ResilientJobSpec.model_validate(dict(raw))
    except ValidationError as exc:
        first = exc.errors()[0]
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, PlannerError):
            raise PlannerError(f"spec.{cause.field}", cause.message) from None
        raise error_from_validation(exc, prefix="spec") from None


def parse_status(raw: Mapping[str, Any] | None) -> ResilientJobStatus:
    """The status as last written; an unreadable status (hand-edited) starts over rather than crash."""
    try:
        return ResilientJobStatus.model_validate(dict(raw or {}))
    except ValidationError:
        return ResilientJobStatus()


def inline_profile(layers: list[LayerSpec], name: str) -> ModelProfile:
    """The planner's profile for an inline layer list."""
    return ModelProfile(
        name=name,
        layers=tuple(
            LayerProfile(
                name=layer.name or f"layer{index}",
                forward_s=layer.forward_s,
                backward_s=layer.backward_s,
                param_bytes=layer.param_bytes,
                optimizer_bytes=layer.optimizer_bytes,
                activation_bytes=layer.activation_bytes,
                output_bytes=layer.output_bytes,
            )
            for index, layer in enumerate(layers)
        ),
    )


def status_patch(status: ResilientJobStatus) -> dict[str, Any]:
    """The JSON form written to the API (camelCase, enums as strings)."""
    return status.model_dump(mode="json", by_alias=True)
