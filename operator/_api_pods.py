"""`spec.podOverrides`: what one job adds to its pods, over the operator's cluster-wide defaults.

The chart's `workers` values (`_worker_defaults`) place every job's pods alike. A cluster runs jobs that
need different things: a node pool of their own (`nodeSelector`, `tolerations`, `affinity`), credentials
for a private registry (`imagePullSecrets`) or for object storage (`serviceAccountName`), environment for
NCCL or an experiment tracker (`env`, values or keys of Secrets and ConfigMaps), CPU and memory beside the
accelerators (`resources`), labels and annotations for the cluster's own tooling.

The types are part of the API (`api.ResilientJobSpec.pod_overrides`, re-exported there) and validate on
construction, so a bad value is refused with its field named before any pod exists. What the operator sets
itself stays the operator's: `RJOB_*` and the pod's identity variables, the `resilientjob.io/` labels and
annotations, and the accelerator request (`spec.deviceResource` x `spec.gpusPerNode`).

`apply_overrides` lays them on a pod manifest before the cluster's defaults are merged in, and those
defaults give way to the job wherever both speak (`WorkerDefaults.apply`). The store pod (no device, no
training code) takes what places and admits it (labels, annotations, node selector, tolerations, priority
class, service account, image pull secrets), not what sizes or configures a worker.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator
from pydantic.alias_generators import to_camel

from . import _quantity, names

# The affinity's types have a module of their own (the pod's affinity is a small API of its own).
from ._api_affinity import Affinity

OPERATOR_PREFIX = "resilientjob.io/"
"""Labels and annotations under this prefix are the operator's (job, node, role, generation, layout)."""

RESERVED_ENV_PREFIX = "RJOB_"
RESERVED_ENV = frozenset({"POD_NAME", "POD_IP"})
"""The pod's own identity, which the agent reads; every `RJOB_*` variable is the operator's too."""

ACCELERATOR_RESOURCES = frozenset({"nvidia.com/gpu", "huawei.com/Ascend910"})
"""Requested from `spec.deviceResource` x `spec.gpusPerNode` only: the planner counts on that many devices."""

ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"

LabelValue = Annotated[str, StringConstraints(max_length=63)]
AnnotationValue = Annotated[str, StringConstraints(max_length=65536)]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True)


def _check_label_keys(mapping: dict[str, str], what: str, values: bool) -> dict[str, str]:
    """Keys (and, for labels and node selectors, values) as the API server takes them; the operator's own
    prefix refused."""
    error = names.label_map_error(mapping, what, values)
    if error:
        raise ValueError(error)
    for key in mapping:
        if key.startswith(OPERATOR_PREFIX):
            raise ValueError(f"{key!r}: {OPERATOR_PREFIX} {what}s are the operator's")
    return mapping


class Toleration(_Model):
    """A taint the job's pods tolerate (as a pod's `tolerations` entry)."""

    key: str = Field(default="", max_length=316, description="The taint's key; empty with Exists: any taint.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str = Field(default="", max_length=63, description="The taint's value (Equal only).")
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = Field(
        default="", description="NoSchedule, PreferNoSchedule or NoExecute; empty: any effect."
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="How long a NoExecute taint is tolerated; empty: for ever."
    )

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if self.key and not names.is_qualified_name(self.key):
            raise ValueError(f"key: {self.key!r} is not a qualified name (as a label key)")
        if names.label_value_errors(self.value):
            raise ValueError(f"value: {self.value!r} is not a valid label value")
        if self.operator == "Exists" and self.value:
            raise ValueError("value: must be empty when operator is Exists")
        if not self.key and self.operator != "Exists":
            raise ValueError("operator: must be Exists when key is empty (it tolerates every taint)")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds: only for effect NoExecute")
        return self


class KeySelector(_Model):
    """A key of a Secret or ConfigMap in the job's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=names.SUBDOMAIN_PATTERN, description="Its name.")
    key: str = Field(
        min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="The key holding the value."
    )
    optional: bool = Field(
        default=False, description="Start the pod even when the Secret/ConfigMap or its key is missing."
    )


class EnvSource(_Model):
    """Where an environment variable's value comes from: one of a Secret's or a ConfigMap's keys."""

    secret_key_ref: KeySelector | None = Field(default=None, description="A key of a Secret.")
    config_map_key_ref: KeySelector | None = Field(default=None, description="A key of a ConfigMap.")

    @model_validator(mode="after")
    def _one(self) -> EnvSource:
        if (self.secret_key_ref is None) == (self.config_map_key_ref is None):
            raise ValueError("give exactly one of secretKeyRef and configMapKeyRef")
        return self


class EnvVar(_Model):
    """A variable: a value, or a key of a Secret or ConfigMap."""

    name: str = Field(min_length=1, max_length=253, pattern=ENV_NAME_PATTERN, description="Its name.")
    value: str | None = Field(default=None, max_length=32768, description="Its value.")
    value_from: EnvSource | None = Field(
        default=None, description="A Secret's or ConfigMap's key to read it from (instead of value)."
    )

    @model_validator(mode="after")
    def _one(self) -> EnvVar:
        if self.name.startswith(RESERVED_ENV_PREFIX) or self.name in RESERVED_ENV:
            raise ValueError(f"name: {self.name} is set by the operator")
        if (self.value is None) == (self.value_from is None):
            raise ValueError(f"{self.name}: give exactly one of value and valueFrom")
        return self

    def manifest(self) -> dict[str, Any]:
        """The container's `env` entry."""
        return self.model_dump(by_alias=True, exclude_none=True)


class ImagePullSecret(_Model):
    """A Secret of type kubernetes.io/dockerconfigjson in the job's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=names.SUBDOMAIN_PATTERN, description="Its name.")


class Resources(_Model):
    """CPU, memory and other resources of each worker container, beside its accelerators."""

    requests: dict[str, int | str] = Field(
        default_factory=dict,
        max_length=16,
        description="What the scheduler reserves, e.g. {cpu: 16, memory: 200Gi}.",
    )
    limits: dict[str, int | str] = Field(
        default_factory=dict, max_length=16, description="What the container may use."
    )

    @field_validator("requests", "limits")
    @classmethod
    def _amounts(cls, amounts: dict[str, int | str]) -> dict[str, int | str]:
        for name, amount in amounts.items():
            if name in ACCELERATOR_RESOURCES:
                raise ValueError(f"{name}: accelerators come from spec.deviceResource x spec.gpusPerNode")
            if isinstance(amount, bool) or (isinstance(amount, int) and amount < 0):
                raise ValueError(f"{name}: {amount!r} is not a quantity")
            try:
                _quantity.value(amount)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        return amounts

    @model_validator(mode="after")
    def _requests_within_limits(self) -> Resources:
        for name, request in self.requests.items():
            if name in self.limits and _quantity.value(request) > _quantity.value(self.limits[name]):
                raise ValueError(f"requests.{name}: {request} is more than its limit {self.limits[name]}")
        return self

    def manifest(self) -> dict[str, dict[str, str]]:
        return {
            kind: {name: str(amount) for name, amount in amounts.items()}
            for kind, amounts in (("requests", self.requests), ("limits", self.limits))
            if amounts
        }


class PodOverrides(_Model):
    """What the job's pods add to the operator's defaults (the chart's `workers` values): the job's own
    settings win where both speak. The store pod takes the labels, annotations, node selector,
    tolerations, priority class, service account and image pull secrets; env, affinity and resources are
    the workers' only."""

    # Bounded, so that the CRD's immutability rule has a bounded cost for a real API server's CEL budget.
    labels: dict[str, LabelValue] = Field(
        default_factory=dict, max_length=64, description="Added to every pod of the job."
    )
    annotations: dict[str, AnnotationValue] = Field(
        default_factory=dict, max_length=64, description="Added to every pod of the job."
    )
    node_selector: dict[str, LabelValue] = Field(
        default_factory=dict,
        max_length=32,
        description="Node labels the pods must run on (a node pool, a GPU type).",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=64, description="Taints the pods tolerate (e.g. a GPU pool's)."
    )
    affinity: Affinity | None = Field(
        default=None,
        description="The worker pods' affinity, as a pod's spec.affinity (nodeAffinity, podAffinity, "
        "podAntiAffinity); it replaces the chart's default.",
    )
    priority_class_name: str = Field(
        default="", max_length=253, description="The pods' PriorityClass (preemption order in the cluster)."
    )
    service_account_name: str = Field(
        default="",
        max_length=253,
        description="The pods' ServiceAccount (e.g. one bound to an object store's credentials); empty: the "
        "namespace's default.",
    )
    image_pull_secrets: list[ImagePullSecret] = Field(
        default_factory=list, max_length=16, description="Secrets to pull spec.image from a private registry."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=256,
        description="Variables added to the worker containers' environment (TMPDIR and the cache paths may "
        "be set: point them at a mounted volume, the root filesystem is read-only).",
    )
    resources: Resources = Field(
        default_factory=Resources,
        description="The worker containers' CPU, memory and other resources (quantities such as 8, 500m, "
        "64Gi); not accelerators, which are spec.gpusPerNode of spec.deviceResource.",
    )

    @field_validator("labels", "node_selector")
    @classmethod
    def _labels(cls, mapping: dict[str, str]) -> dict[str, str]:
        return _check_label_keys(mapping, "label", values=True)

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, mapping: dict[str, str]) -> dict[str, str]:
        return _check_label_keys(mapping, "annotation", values=False)

    @field_validator("priority_class_name", "service_account_name")
    @classmethod
    def _object_name(cls, name: str) -> str:
        if name and names.subdomain_errors(name):
            raise ValueError(f"{name!r} is not a valid object name (lower case, digits, '-' and '.')")
        return name

    @model_validator(mode="after")
    def _unique_env(self) -> PodOverrides:
        names = [item.name for item in self.env]
        for index, name in enumerate(names):
            if names.index(name) != index:
                raise ValueError(f"env.{index}.name: {name} is set twice")
        return self


def apply_overrides(pod: dict[str, Any], overrides: PodOverrides, *, worker: bool = True) -> dict[str, Any]:
    """`pod` (a manifest the operator built) with the job's overrides laid on it, in place; returned."""
    metadata, spec = pod["metadata"], pod["spec"]
    container = spec["containers"][0]
    # The operator's own keys cannot be overridden (refused on construction), so neither side loses one.
    metadata["labels"] = {**overrides.labels, **metadata.get("labels", {})}
    if overrides.annotations:
        metadata["annotations"] = {**overrides.annotations, **(metadata.get("annotations") or {})}
    if overrides.node_selector:
        spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **overrides.node_selector}
    if overrides.tolerations:
        spec["tolerations"] = [
            *spec.get("tolerations", []),
            *(
                t.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True)
                for t in overrides.tolerations
            ),
        ]
    if overrides.priority_class_name:
        spec["priorityClassName"] = overrides.priority_class_name
    if overrides.service_account_name:
        spec["serviceAccountName"] = overrides.service_account_name
    if overrides.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s.name} for s in overrides.image_pull_secrets]
    if not worker:
        return pod
    if overrides.affinity is not None:
        spec["affinity"] = overrides.affinity.manifest()
    if overrides.env:
        # The job's value replaces the operator's scratch defaults (TMPDIR, TORCH_HOME, ...) in place; the
        # variables the agent depends on cannot be named here at all.
        given = {item.name: item.manifest() for item in overrides.env}
        env = [given.pop(item["name"], item) for item in container["env"]]
        container["env"] = [*env, *given.values()]
    resources = overrides.resources.manifest()
    if resources:
        merged = container.setdefault("resources", {})
        for kind, amounts in resources.items():
            merged[kind] = {**amounts, **merged.get(kind, {})}  # the accelerator count stays the job's
    return pod
