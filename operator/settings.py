"""Operator settings (environment variables `RJOB_*`, or flags of `rjob operator`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    api_url: str | None = None
    """Kubernetes API server URL without credentials (the local emulator). None: in-cluster or kubeconfig."""

    api_token_file: str | None = None
    """With `api_url`: a file holding the bearer token to send, read again at every login (a service-account
    token the kubelet rotates is such a file); None: no credentials."""

    kubeconfig: str | None = None
    """Path of a kubeconfig to log in with (a real cluster, e.g. kind); None: kopf's default login."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis used by jobs whose spec gives no `redis.url`."""

    namespace: str | None = None
    """Watch one namespace; None: all namespaces."""

    poll_interval_s: float = 0.25
    """How often each job's loop checks heartbeats and telemetry (pod events wake it at once)."""

    status_interval_s: float = 1.0
    """How often measured throughput and worker counts are written to the status at most."""

    metrics_port: int = 0
    """Port of the Prometheus endpoint; 0 disables it."""

    health_port: int = 0
    """Port of kopf's liveness endpoint (`/healthz`, what the chart's probes ask); 0 disables it."""

    worker_defaults: str | None = None
    """JSON file of defaults for worker pods (the Helm chart's `workers` values); None: none."""

    replace_backoff_s: float = 10.0
    """Crash-loop backoff of replacement workers: the wait after the second quick failure in a row, doubling
    with each further one (the first failed pod is replaced at once; `_capacity`)."""

    replace_backoff_max_s: float = 300.0
    """Upper bound of that wait."""

    join_settle_s: float = 10.0
    """Longest a ready replacement waits before a generation takes it in: for the other replacements still
    starting (they join together, one rendezvous instead of one each) and for the current generation's first
    committed step (`_decide.held_joins`); 0 takes every join at once."""

    leftover_grace_s: float = 60.0
    """A job applied again under a deleted one's name waits for that earlier job's pods to go; one still
    terminating this long after its grace period ended (its node is gone, and no kubelet will ever confirm
    it) is force-deleted (`_lifecycle.earlier_job_gone`)."""

    pods_refused_retry_s: float = 30.0
    """After the API server refused a pod of a job (a ServiceAccount that does not exist yet, a quota), the
    job's daemon tries again this much later; a Warning Event `PodsRefused` carries the server's words."""

    standalone: bool = False
    """Skip kopf peering (one operator only). With peering, a second operator waits as a standby."""

    def __post_init__(self) -> None:
        for name in ("poll_interval_s", "status_interval_s", "replace_backoff_s", "replace_backoff_max_s",
                     "join_settle_s", "leftover_grace_s", "pods_refused_retry_s"):  # fmt: skip
            # NaN compares false with everything: it would pass every bound below and break every wait.
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number of seconds, got {getattr(self, name)}")
        if self.poll_interval_s <= 0 or self.status_interval_s <= 0:
            raise ValueError("poll_interval_s and status_interval_s must be > 0")
        for name, port in (("metrics_port", self.metrics_port), ("health_port", self.health_port)):
            if not 0 <= port < 65536:
                raise ValueError(f"{name} must be 0..65535, got {port}")
        if self.join_settle_s < 0:
            raise ValueError(f"join_settle_s must be >= 0, got {self.join_settle_s}")
        if self.pods_refused_retry_s <= 0:
            raise ValueError(f"pods_refused_retry_s must be > 0, got {self.pods_refused_retry_s}")
        if self.leftover_grace_s < 0:
            raise ValueError(f"leftover_grace_s must be >= 0, got {self.leftover_grace_s}")
        if not 0 <= self.replace_backoff_s <= self.replace_backoff_max_s:
            raise ValueError("need 0 <= replace_backoff_s <= replace_backoff_max_s")
        if self.health_port and self.health_port == self.metrics_port:
            raise ValueError(f"health_port and metrics_port must differ, both are {self.health_port}")

    @classmethod
    def from_env(cls) -> OperatorSettings:
        env = os.environ
        given: dict[str, object] = {}
        for name, variable, kind in (
            ("api_url", "RJOB_API_URL", str),
            ("api_token_file", "RJOB_API_TOKEN_FILE", str),
            ("kubeconfig", "RJOB_KUBECONFIG", str),
            ("redis_url", "RJOB_REDIS_URL", str),
            ("namespace", "RJOB_NAMESPACE", str),
            ("poll_interval_s", "RJOB_POLL_INTERVAL_S", float),
            ("status_interval_s", "RJOB_STATUS_INTERVAL_S", float),
            ("metrics_port", "RJOB_METRICS_PORT", int),
            ("health_port", "RJOB_HEALTH_PORT", int),
            ("worker_defaults", "RJOB_WORKER_DEFAULTS", str),
            ("replace_backoff_s", "RJOB_REPLACE_BACKOFF_S", float),
            ("replace_backoff_max_s", "RJOB_REPLACE_BACKOFF_MAX_S", float),
            ("join_settle_s", "RJOB_JOIN_SETTLE_S", float),
            ("leftover_grace_s", "RJOB_LEFTOVER_GRACE_S", float),
            ("pods_refused_retry_s", "RJOB_PODS_REFUSED_RETRY_S", float),
        ):
            if env.get(variable):
                try:
                    given[name] = kind(env[variable])
                except ValueError:
                    raise ValueError(
                        f"{variable}: expected {'an integer' if kind is int else 'a number'}, "
                        f"got {env[variable]!r}"
                    ) from None
        given["standalone"] = env.get("RJOB_STANDALONE", "") in ("1", "true", "yes")
        return cls(**given)  # type: ignore[arg-type]

    @property
    def liveness_endpoint(self) -> str | None:
        """kopf's `liveness_endpoint` for these settings (all interfaces: the kubelet probes the pod IP)."""
        return f"http://0.0.0.0:{self.health_port}/healthz" if self.health_port else None

    def to_env(self) -> dict[str, str]:
        """The environment that makes `from_env` return these settings (for child processes)."""
        env = {
            "RJOB_REDIS_URL": self.redis_url,
            "RJOB_POLL_INTERVAL_S": str(self.poll_interval_s),
            "RJOB_METRICS_PORT": str(self.metrics_port),
            "RJOB_HEALTH_PORT": str(self.health_port),
            "RJOB_STANDALONE": "1" if self.standalone else "",
            "RJOB_REPLACE_BACKOFF_S": str(self.replace_backoff_s),
            "RJOB_REPLACE_BACKOFF_MAX_S": str(self.replace_backoff_max_s),
            "RJOB_JOIN_SETTLE_S": str(self.join_settle_s),
            "RJOB_LEFTOVER_GRACE_S": str(self.leftover_grace_s),
            "RJOB_PODS_REFUSED_RETRY_S": str(self.pods_refused_retry_s),
        }
        for key, value in (
            ("RJOB_API_URL", self.api_url),
            ("RJOB_API_TOKEN_FILE", self.api_token_file),
            ("RJOB_KUBECONFIG", self.kubeconfig),
            ("RJOB_NAMESPACE", self.namespace),
            ("RJOB_WORKER_DEFAULTS", self.worker_defaults),
        ):
            if value:
                env[key] = value
        return env
