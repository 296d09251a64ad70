"""Cluster-wide defaults for worker pods, from the Helm chart's `workers` values.

The chart renders them into a ConfigMap mounted into the operator (`RJOB_WORKER_DEFAULTS` names the file):
scheduling constraints (node selector, tolerations, affinity, priority and runtime class), extra container
resources, shared memory, environment, the security contexts (the operator's own default is Pod Security
"restricted") and the Secret that carries the default Redis's password to the workers. A job's
`spec.deviceResource` x `spec.gpusPerNode` still decides the accelerator request; these only add around it.
A malformed file stops the operator at start with the field named, rather than creating pods that never
schedule."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from resilientjob.planner.errors import PlannerError, error_from_validation


class SecretKey(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=253)
    key: str = Field(default="password", min_length=1, max_length=253)


class DefaultRedis(BaseModel):
    """The operator's default Redis (for jobs without spec.redis), as worker pods must reach it."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    url: str = Field(min_length=1, pattern=r"^rediss?://", description="The address, without a password.")
    password_secret: SecretKey | None = Field(default=None, alias="passwordSecret")


def without_password(url: str) -> str:
    """`url` with any user and password taken out of its authority."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=host))


class WorkerDefaults(BaseModel):
    """What the chart's `workers` block renders (camelCase as in the JSON)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    accelerator: str = "none"
    resource_name: str = Field(default="", alias="resourceName")
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    accelerator_node_selector: dict[str, str] = Field(default_factory=dict, alias="acceleratorNodeSelector")
    """The part of `node_selector` that picks accelerator nodes (the chart's `workers.<accelerator>`)."""
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] = Field(default_factory=dict)
    resources: dict[str, dict[str, str | int]] = Field(default_factory=dict)
    priority_class_name: str = Field(default="", alias="priorityClassName")
    runtime_class_name: str = Field(default="", alias="runtimeClassName")
    shm_size: str = Field(default="", alias="shmSize")
    env: list[dict[str, Any]] = Field(default_factory=list)
    pod_security_context: dict[str, Any] | None = Field(default=None, alias="podSecurityContext")
    """Replaces the operator's restricted pod securityContext when given ({} for none)."""
    security_context: dict[str, Any] | None = Field(default=None, alias="securityContext")
    """Replaces the worker container's restricted securityContext when given ({} for none)."""
    redis: DefaultRedis | None = None

    @classmethod
    def load(cls, path: str | Path) -> WorkerDefaults:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise PlannerError("RJOB_WORKER_DEFAULTS", f"cannot read {str(path)!r}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise PlannerError("RJOB_WORKER_DEFAULTS", f"{str(path)!r} is not JSON: {exc}") from None
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise error_from_validation(exc, prefix="workers") from None

    def apply(self, pod: dict[str, Any], *, worker: bool = True) -> dict[str, Any]:
        """The pod with these defaults merged in; the job's own settings win where both speak.

        `worker` False: the job's store pod, which runs no device and no data loader. It takes what lets it
        run beside the workers (tolerations, priority, security contexts, env, the Redis password, the node
        selector but the accelerator's: an image built for arm64 still needs arm64 nodes) but not what
        places a pod on an accelerator node or sizes it for training (the accelerator's node selector,
        affinity, runtime class, requests, /dev/shm): it asked for 8 CPUs and 64Gi on a GPU node before."""
        spec = pod["spec"]
        container = spec["containers"][0]
        selector = (
            self.node_selector
            if worker
            else {k: v for k, v in self.node_selector.items() if k not in self.accelerator_node_selector}
        )
        if selector:
            spec["nodeSelector"] = {**selector, **spec.get("nodeSelector", {})}
        if self.tolerations:
            spec["tolerations"] = [*spec.get("tolerations", []), *self.tolerations]
        if self.affinity and worker:
            spec.setdefault("affinity", self.affinity)
        if self.priority_class_name:
            spec.setdefault("priorityClassName", self.priority_class_name)
        if self.runtime_class_name and worker:
            spec.setdefault("runtimeClassName", self.runtime_class_name)
        if self.resources and worker:
            merged = container.setdefault("resources", {})
            # A resource the job sizes (in its requests or its limits) is the job's in both: a default
            # limit of 64Gi under the job's request of 200Gi would make a pod the API server refuses.
            own = {name for amounts in merged.values() for name in amounts}
            for kind, amounts in self.resources.items():
                # The accelerator count comes from the job; the defaults add CPU, memory, RDMA, ...
                added = {k: str(v) for k, v in amounts.items() if k not in own}
                merged[kind] = {**added, **merged.get(kind, {})}
        if self.env:
            named = {item["name"] for item in container["env"]}
            container["env"] += [item for item in self.env if item.get("name") not in named]
        if self.pod_security_context is not None:
            spec["securityContext"] = dict(self.pod_security_context)
        if self.security_context is not None:
            container["securityContext"] = dict(self.security_context)
        if self.redis is not None:
            _password_from_secret(container, self.redis)
        if self.shm_size and worker:
            spec["volumes"].append(
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": self.shm_size}}
            )
            container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
        return pod


def _password_from_secret(container: dict[str, Any], redis: DefaultRedis) -> None:
    """A pod of a job on the default Redis gets a password-free URL and the password through a secretKeyRef,
    so that the password never shows in the pod's spec (`kubectl get pod -o yaml`)."""
    env = {item["name"]: item for item in container["env"]}
    url = env.get("RJOB_REDIS_URL", {}).get("value")
    if url is None or "RJOB_REDIS_PASSWORD" in env or without_password(url) != redis.url:
        return  # the job names its own Redis (and Secret): not ours to touch
    env["RJOB_REDIS_URL"]["value"] = redis.url
    if redis.password_secret is not None:
        ref = {"secretKeyRef": {"name": redis.password_secret.name, "key": redis.password_secret.key}}
        container["env"].append({"name": "RJOB_REDIS_PASSWORD", "valueFrom": ref})


@functools.lru_cache(maxsize=4)
def load_worker_defaults(path: str) -> WorkerDefaults:
    """The defaults file, read once per operator process (the chart mounts it read-only)."""
    return WorkerDefaults.load(path)
