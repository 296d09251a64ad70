"""`rjob operator`: run the ResilientJob operator (kopf) against a cluster or the local emulator."""

from __future__ import annotations

import argparse
import asyncio
import os

from ._common import guarded


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
    # The handlers read their settings at import; flags override the environment.
    for flag, name in (
        ("api_url", "RJOB_API_URL"),
        ("kubeconfig", "RJOB_KUBECONFIG"),
        ("redis_url", "RJOB_REDIS_URL"),
        ("namespace", "RJOB_NAMESPACE"),
        ("metrics_port", "RJOB_METRICS_PORT"),
        ("health_port", "RJOB_HEALTH_PORT"),
    ):
        value = getattr(args, flag)
        if value is not None:
            os.environ[name] = str(value)
    if args.standalone:
        os.environ["RJOB_STANDALONE"] = "1"
    import kopf

    from resilientjob.operator import handlers

    kopf.configure(verbose=args.verbose, log_prefix=True)
    namespace = handlers.SETTINGS.namespace
    asyncio.run(
        kopf.operator(
            clusterwide=namespace is None,
            namespaces=namespace.split(",") if namespace else [],
            standalone=handlers.SETTINGS.standalone,
            liveness_endpoint=handlers.SETTINGS.liveness_endpoint,
            # Replicas with equal kopf priorities all pause; distinct ones leave exactly one active.
            priority=int(os.environ.get("RJOB_PEERING_PRIORITY") or int.from_bytes(os.urandom(2))),
        )
    )
    return 0
