"""`rjob operator`: run the ResilientJob operator (kopf) against a cluster or the local emulator."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ._common import CliError, guarded, kubeconfig_missing

if TYPE_CHECKING:
    from collections.abc import Mapping

    from resilientjob.operator.settings import OperatorSettings

FLAGS = ("api_url", "kubeconfig", "redis_url", "namespace", "metrics_port", "health_port")
"""The settings that flags of `rjob operator` set (the others come from `RJOB_*` variables only)."""
SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("operator", help="run the ResilientJob operator")
    parser.add_argument("--api-url", help="API server URL without credentials (the local emulator)")
    parser.add_argument("--kubeconfig", help="kubeconfig of a real cluster (default: in-cluster or ~/.kube)")
    parser.add_argument("--redis-url", help="Redis for jobs whose spec names none")
    parser.add_argument("--namespace", help="watch these namespaces, comma-separated (default: all)")
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    parser.add_argument(
        "--health-port", type=int, help="serve kopf's liveness endpoint /healthz on this port"
    )
    parser.add_argument("--standalone", action="store_true", help="no peering: this is the only operator")
    parser.add_argument("--verbose", action="store_true")
    parser.set_defaults(handler=guarded(_run))


def _run(args: argparse.Namespace) -> int:
    import kopf

    from resilientjob.operator.settings import OperatorSettings

    # Read once, here: the environment, then the flags over it. The handlers take the settings from kopf's
    # memo (`handlers.settings_of`); nothing reads them at import.
    flags = {
        name: getattr(args, name)
        for name in FLAGS
        if getattr(args, name) is not None and str(getattr(args, name))  # an empty flag: not given
    }
    if args.standalone:
        flags["standalone"] = True
    try:
        settings = dataclasses.replace(OperatorSettings.from_env(), **flags)
    except ValueError as exc:  # `metrics_port must be ...`: field first, as `guarded` names its flag
        field, _, rest = str(exc).partition(" ")
        raise CliError(f"{field}: {rest}" if rest.startswith("must") else str(exc)) from None
    missing = credentials_missing(settings, os.environ)
    if missing is not None:
        raise CliError(missing)

    import resilientjob.operator.handlers  # noqa: F401  (importing it registers the handlers with kopf)

    kopf.configure(verbose=args.verbose, log_prefix=True)
    namespace = settings.namespace
    asyncio.run(
        kopf.operator(
            clusterwide=namespace is None,
            namespaces=namespace.split(",") if namespace else [],
            standalone=settings.standalone,
            liveness_endpoint=settings.liveness_endpoint,
            # Replicas with equal kopf priorities all pause; distinct ones leave exactly one active.
            priority=int(os.environ.get("RJOB_PEERING_PRIORITY") or int.from_bytes(os.urandom(2))),
            memo=kopf.Memo(rjob=settings),
        )
    )
    return 0


def credentials_missing(settings: OperatorSettings, environ: Mapping[str, str]) -> str | None:
    """Why the operator could not log in at all, in one line, or None: checked before kopf starts (kopf
    logs a LoginError traceback and retries each minute, forever)."""
    if settings.api_url:
        return None
    if settings.kubeconfig:
        return kubeconfig_missing("kubeconfig", settings.kubeconfig)
    if environ.get("KUBERNETES_SERVICE_HOST") and SERVICE_ACCOUNT_TOKEN.is_file():
        return None  # in a pod: its service account
    if environ.get("KUBECONFIG"):
        return kubeconfig_missing("KUBECONFIG", environ["KUBECONFIG"])
    if (Path(environ.get("HOME") or Path.home()) / ".kube" / "config").is_file():
        return None
    return (
        "no cluster to log in to: no in-cluster service account, no --kubeconfig, no KUBECONFIG and no "
        "~/.kube/config (on this machine: rjob local up, then export the KUBECONFIG it prints)"
    )
