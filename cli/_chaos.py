"""`rjob chaos`: inject fail-slows and failures into a running job on a cluster.

    rjob chaos slow POD --factor F --for DURATION [--link PEER [--latency S] [--bandwidth BPS]]
                                                   slow compute, or the link to PEER
    rjob chaos clear POD                                          withdraw a slowdown or a hang early
    rjob chaos kill POD                                           delete the pod at once (a fail-stop)
    rjob chaos break POD [--switch]                               fail its next collective once (pod alive),
                                                                  or its next switch's
    rjob chaos hang POD [--for DURATION]                          block its worker (its agent beats on)

The pod is read through the Kubernetes API (`--server URL` for a plain-HTTP endpoint such as
`kubectl proxy`, else `--kubeconfig`/`RJOB_KUBECONFIG`/the default kubeconfig, else in-cluster): its labels
name the job and node, its environment the job's Redis (override with `--redis-url` when the in-cluster
address is not reachable, e.g. through `kubectl port-forward`). A slowdown, a break or a hang is a control
key the worker polls (`agent.chaos`); it is refused unless the pod's environment allows chaos
(`RJOB_ALLOW_CHAOS=1`), so a production job cannot be slowed by mistake. `kill` deletes the pod with no
grace period.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import time
from typing import Any

from resilientjob.protocol.chaos import ALLOW_ENV
from resilientjob.protocol.models import SYNTHETIC_PREFIX

from ._common import CliError, guarded, kubeconfig_missing

LABEL_JOB = "resilientjob.io/job"
LABEL_NODE = "resilientjob.io/node"

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def check_fault_applies(fault: str | None, model: str | None, job: str) -> None:
    """A break or a hang acts on the worker's collectives: the synthetic loop has none, and the order would
    be taken and never carried out. Refuse it, naming why, rather than print that it was ordered."""
    if fault in ("break", "hang") and (model or "").startswith(SYNTHETIC_PREFIX):
        raise CliError(
            f"pod: job {job!r} runs the synthetic loop (spec.model {model}), which has no collectives to "
            f"{fault}: use a job that trains a model, such as examples/demo.yaml (slow and kill work on both)"
        )


SWITCH_HELP = "fail the pod's next switch to a new generation instead (its rendezvous), whenever it comes"


def check_slow(factor: float, latency_s: float, bandwidth_bps: float) -> None:
    """A slow order's numbers, checked before anything is read or written (`rjob chaos` and `rjob local
    chaos` alike)."""
    if not 1.0 <= factor <= 100.0:
        raise CliError(f"factor: must be in [1, 100], got {factor}")
    if not 0.0 <= latency_s <= 10.0:
        raise CliError(f"latency: must be in [0, 10] seconds, got {latency_s}")
    if not bandwidth_bps > 0.0:
        raise CliError(f"bandwidth: must be > 0 bytes per second, got {bandwidth_bps}")


def break_window_s(switch: bool) -> float:
    """How long a break order waits to be carried out: the worker's next call comes within a step, its next
    switch whenever the job next reconfigures."""
    return 600.0 if switch else 60.0


def break_said(switch: bool) -> str:
    """What `break` tells the user it ordered."""
    return "its next switch to a new generation will fail" if switch else "its next collective will fail"


def parse_duration(text: str, field: str = "for") -> float:
    """`90`, `90s`, `2m` or `1h` in seconds (> 0); a clear error names the flag otherwise."""
    try:
        seconds = float(text[:-1]) * _UNITS[text[-1]] if text and text[-1] in _UNITS else float(text)
    except ValueError:
        raise CliError(f"{field}: expected a duration such as 60s or 2m, got {text!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise CliError(f"{field}: must be a positive duration, got {text!r}")
    return seconds


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("chaos", help="inject fail-slows and failures into a running job")
    commands = parser.add_subparsers(dest="chaos_command", required=True)
    slow = commands.add_parser("slow", help="slow a pod's compute, or its sends to one peer, for a while")
    slow.add_argument("pod")
    slow.add_argument("--factor", type=float, required=True, help="times slower, >= 1 (e.g. 1.5)")
    slow.add_argument("--for", dest="duration", required=True, help="duration such as 60s, 5m")
    slow.add_argument("--link", help="peer pod name or node number: slow the link to it instead")
    slow.add_argument("--latency", type=float, default=0.001, help="link: nominal seconds per message")
    slow.add_argument("--bandwidth", type=float, default=1e9, help="link: nominal bytes per second")
    clear = commands.add_parser("clear", help="withdraw a pod's slowdown or hang")
    clear.add_argument("pod")
    kill = commands.add_parser("kill", help="delete a pod at once (a fail-stop)")
    kill.add_argument("pod")
    broken = commands.add_parser(
        "break", help="fail a pod's next collective once, as a reset connection would (the pod stays alive)"
    )
    broken.add_argument("pod")
    broken.add_argument("--switch", action="store_true", help=SWITCH_HELP)
    hang = commands.add_parser(
        "hang", help="block a pod's worker in its next collective (its agent beats on)"
    )
    hang.add_argument("pod")
    hang.add_argument("--for", dest="duration", default="10m", help="duration such as 60s or 10m (default)")
    for sub in (slow, clear, broken, hang):
        sub.add_argument("--redis-url", help="the job's Redis as reachable from here (default: the pod's)")
    for sub in (slow, clear, kill, broken, hang):
        sub.add_argument("-n", "--namespace", default="default")
        sub.add_argument("--server", help="API server URL without authentication (e.g. kubectl proxy)")
        sub.add_argument("--kubeconfig", help="kubeconfig file (default: RJOB_KUBECONFIG or ~/.kube/config)")
    parser.set_defaults(handler=guarded(_run))


class _Cluster:
    """The few Kubernetes reads and the delete the command needs, as plain JSON."""

    def __init__(self, args: argparse.Namespace) -> None:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException

        if args.server:
            configuration = client.Configuration()
            configuration.host = args.server.rstrip("/")
            api_client = client.ApiClient(configuration)
        else:
            source, named = next(
                ((what, value) for what, value in (
                    ("kubeconfig", args.kubeconfig),
                    ("RJOB_KUBECONFIG", os.environ.get("RJOB_KUBECONFIG")),
                    ("KUBECONFIG", os.environ.get("KUBECONFIG")),
                ) if value),
                ("", ""),
            )  # fmt: skip
            missing = kubeconfig_missing(source, named)
            if missing is not None:
                raise CliError(missing)
            try:
                api_client = config.new_client_from_config(  # type: ignore[no-untyped-call]
                    config_file=args.kubeconfig or os.environ.get("RJOB_KUBECONFIG")
                )
            except (ConfigException, OSError):
                try:
                    config.load_incluster_config()  # type: ignore[no-untyped-call]
                except ConfigException:
                    raise CliError(
                        "kubeconfig: no cluster configuration found (use --server or --kubeconfig)"
                    ) from None
                api_client = client.ApiClient()
        self.core = client.CoreV1Api(api_client)
        self.namespace = args.namespace

    def _call(self, what: str, method: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            response = method(*args, self.namespace, _preload_content=False, **kwargs)
        except ApiException as exc:
            reason = "not found" if exc.status == 404 else f"HTTP {exc.status} {exc.reason}"
            raise CliError(f"{what}: {reason} in namespace {self.namespace!r}") from None
        except HTTPError as exc:
            raise CliError(f"server: cannot reach the Kubernetes API: {exc}") from None
        body: dict[str, Any] = json.loads(response.data or b"{}")
        return body

    def pod(self, name: str) -> dict[str, Any]:
        return self._call(f"pod {name!r}", self.core.read_namespaced_pod, name)

    def secret_value(self, name: str, key: str) -> str | None:
        data = self._call(f"secret {name!r}", self.core.read_namespaced_secret, name).get("data") or {}
        return base64.b64decode(data[key]).decode() if key in data else None

    def delete_pod(self, name: str) -> None:
        self._call(f"pod {name!r}", self.core.delete_namespaced_pod, name, grace_period_seconds=0)


def _worker(pod: dict[str, Any], name: str) -> tuple[str, int]:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if LABEL_JOB not in labels or LABEL_NODE not in labels:
        raise CliError(f"pod: {name!r} is not a ResilientJob worker (no {LABEL_JOB}/{LABEL_NODE} labels)")
    # The owner names the job: the label holds a hashed form of a name longer than a label value may be.
    owners = [
        r.get("name")
        for r in (pod.get("metadata") or {}).get("ownerReferences") or ()
        if r.get("kind") == "ResilientJob"
    ]
    try:
        return str(owners[0] if owners else labels[LABEL_JOB]), int(labels[LABEL_NODE])
    except ValueError:
        raise CliError(f"pod: {name!r} has a malformed {LABEL_NODE} label") from None


def _env(pod: dict[str, Any]) -> list[dict[str, Any]]:
    containers = (pod.get("spec") or {}).get("containers") or []
    return [entry for container in containers for entry in container.get("env") or []]


def _env_value(cluster: _Cluster, pod: dict[str, Any], name: str) -> str | None:
    for entry in _env(pod):
        if entry.get("name") != name:
            continue
        if "value" in entry:
            return str(entry["value"])
        ref = (entry.get("valueFrom") or {}).get("secretKeyRef") or {}
        if ref.get("name") and ref.get("key"):
            return cluster.secret_value(ref["name"], ref["key"])
    return None


def _redis(cluster: _Cluster, pod: dict[str, Any], name: str, url: str | None) -> Any:
    import redis

    # The flag, else the pod's own: a shell's RJOB_REDIS_URL (left by running `rjob operator`, say) may be
    # another Redis, where the order would be written, "slowed" printed, and nothing slowed.
    url = url or _env_value(cluster, pod, "RJOB_REDIS_URL") or os.environ.get("RJOB_REDIS_URL")
    if not url:
        raise CliError(f"redis-url: pod {name!r} names no Redis; pass --redis-url")
    # The shell's password first: who cannot read the job's Secret (RBAC) gives it so (README).
    password = os.environ.get("RJOB_REDIS_PASSWORD") or _env_value(cluster, pod, "RJOB_REDIS_PASSWORD")
    return redis.Redis.from_url(url, password=password or None, socket_connect_timeout=3)


def _peer_node(cluster: _Cluster, job: str, peer: str) -> int:
    if peer.isdigit():
        return int(peer)
    peer_job, node = _worker(cluster.pod(peer), peer)
    if peer_job != job:
        raise CliError(f"link: pod {peer!r} belongs to job {peer_job!r}, not {job!r}")
    return node


def _run(args: argparse.Namespace) -> int:
    if args.chaos_command == "slow":  # check the flags before touching the cluster
        check_slow(args.factor, args.latency, args.bandwidth)
        seconds = parse_duration(args.duration)
    elif args.chaos_command == "hang":
        seconds = parse_duration(args.duration)
    elif args.chaos_command == "break":
        seconds = break_window_s(args.switch)
    cluster = _Cluster(args)
    pod = cluster.pod(args.pod)
    job, node = _worker(pod, args.pod)
    if args.chaos_command == "kill":
        cluster.delete_pod(args.pod)
        print(f"pod/{args.pod} killed")
        return 0
    from redis.exceptions import RedisError

    from resilientjob.protocol.chaos import ChaosOrder, clear_order, write_order
    from resilientjob.protocol.keys import JobKeys

    keys = JobKeys(cluster.namespace, job)
    client = _redis(cluster, pod, args.pod, args.redis_url)
    try:
        if args.chaos_command == "clear":
            had = clear_order(client, keys, node)
            print(f"pod/{args.pod} {'cleared' if had else 'had no chaos order'}")
            return 0
        if _env_value(cluster, pod, ALLOW_ENV) != "1":
            raise CliError(
                f"pod: job {job!r} does not allow chaos: set spec.chaos.enabled: true ({ALLOW_ENV}=1 is not "
                f"in {args.pod}'s env)"
            )
        if args.chaos_command in ("break", "hang"):
            check_fault_applies(args.chaos_command, _env_value(cluster, pod, "RJOB_MODEL"), job)
            switch = True if args.chaos_command == "break" and args.switch else None
            fault = ChaosOrder(
                factor=1.0, until=time.time() + seconds, fault=args.chaos_command, switch=switch
            )
            write_order(client, keys, node, fault)
        else:
            link = _peer_node(cluster, job, args.link) if args.link else None
            if link == node:
                raise CliError(f"link: {args.link!r} is {args.pod}'s own node {node}: a link joins two nodes")
            order = ChaosOrder(
                factor=args.factor,
                until=time.time() + seconds,
                link=link,
                latency_s=args.latency,
                bandwidth_bps=args.bandwidth,
            )
            write_order(client, keys, node, order)
    except RedisError as exc:
        raise CliError(f"redis-url: {exc}") from None
    finally:
        client.close()
    if args.chaos_command == "break":
        print(f"pod/{args.pod}: {break_said(args.switch)}")
    elif args.chaos_command == "hang":
        print(f"pod/{args.pod}: its worker will hang in its next collective for {args.duration}")
    else:
        target = f"link to node {link}" if link is not None else "compute"
        print(f"pod/{args.pod} {target} slowed x{args.factor} for {args.duration}")
    return 0
