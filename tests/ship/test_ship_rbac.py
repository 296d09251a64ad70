"""Least privilege, checked both ways: the chart's Role and ClusterRole grant exactly the (API group,
resource, verb) triples the operator uses, derived

- statically, from the operator's code: every `kube.<method>(<path>)` call in the modules the operator
  process imports (the verb from KubeApi's HTTP method, the resource from the path builder), plus what kopf
  needs for the handlers' decorators, `kopf.event` and peering; and
- dynamically, by recording every request the real operator process makes against the emulated API server
  while it creates a job (with a referenced profile and a Redis password Secret), survives a pod deletion
  and deletes the job.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs
import kmock
import pytest
from _chart import CHART, ROOT, objects, one

from resilientjob.operator import api

sys.path.insert(0, str(ROOT / "tests" / "operator"))
from _rjob_stack import eventually, job_manifest, rjob_path
from _support import redis_server

from resilientjob.localstack.emulator import LocalApiServer

Triple = tuple[str, str, str]  # (API group, resource[/subresource], verb)
OPERATOR_DIR = ROOT / "operator"
KOPF_WATCH = {"list", "watch"}
# Cluster-scoped resources and what kopf does with them, by operator mode.
CLUSTER_NAMESPACED_MODE = {
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    ("", "namespaces", "list"),
    ("", "namespaces", "watch"),
}
PEERING = {"kopf.dev": ("kopfpeerings", "clusterkopfpeerings")}


# ---- static derivation -------------------------------------------------------------------------------
def _module_file(name: str) -> Path | None:
    path = OPERATOR_DIR / f"{name}.py"
    return path if path.exists() else None


def operator_modules() -> list[Path]:
    """operator/ modules the operator process imports, starting from handlers.py (not the local kubelet
    or emulator, which only the local stack runs)."""
    seen: dict[Path, ast.Module] = {}
    queue = [OPERATOR_DIR / "handlers.py"]
    while queue:
        path = queue.pop()
        if path in seen:
            continue
        tree = seen[path] = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level == 1 and module:
                    names = [module.split(".")[0]]
                elif node.level == 1:
                    names = [alias.name for alias in node.names]
                elif module.startswith("resilientjob.operator."):
                    names = [module.split(".")[2]]
                else:
                    continue
                queue += [p for p in map(_module_file, names) if p is not None]
    return sorted(seen)


def kube_verbs() -> dict[str, str]:
    """KubeApi method -> RBAC verb, from the HTTP method each method sends (operator/kube.py)."""
    tree = ast.parse((OPERATOR_DIR / "kube.py").read_text())
    http_to_verb = {"POST": "create", "PATCH": "patch", "DELETE": "delete", "PUT": "update"}
    verbs: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "KubeApi":
            for method in node.body:
                if not isinstance(method, ast.AsyncFunctionDef) or method.name.startswith("_"):
                    continue
                for call in ast.walk(method):
                    if (
                        isinstance(call, ast.Call)
                        and isinstance(call.func, ast.Attribute)
                        and call.func.attr == "_request"
                        and isinstance(call.args[0], ast.Constant)
                    ):
                        http = call.args[0].value
                        verbs[method.name] = http_to_verb.get(http) or (
                            "list" if method.name == "list" else "get"
                        )
    assert {"create", "get", "list", "patch", "delete"} <= set(verbs), verbs
    return verbs


class _PathResolver:
    """Turns the path argument of a `kube.<method>(...)` call into (group, resource) by reading the code:
    core_path/custom_path calls, `+ "/status"`, local variables and small path helper methods, of this
    module or of another operator module (`self.workers.path(node)` is `_pods.WorkerPods.path`)."""

    def __init__(self, tree: ast.Module, others: Sequence[ast.Module] = ()) -> None:
        self.methods = {
            n.name: n
            for module in (*others, tree)  # this module's own helper wins a clash of names
            for n in ast.walk(module)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        }

    def resolve(self, node: ast.expr, scope: ast.AST, call_keywords: dict[str, ast.expr]) -> tuple[str, str]:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "core_path":
                plural = node.args[1]
                assert isinstance(plural, ast.Constant), ast.unparse(node)
                return "", str(plural.value)
            if node.func.id == "custom_path":
                group, plural = (self._constant(node.args[0]), self._constant(node.args[3]))
                return group, plural
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in self.methods
        ):
            helper = self.methods[node.func.attr]
            keywords = {k.arg: k.value for k in node.keywords if k.arg}
            returned = next(n.value for n in ast.walk(helper) if isinstance(n, ast.Return) and n.value)
            return self.resolve(returned, helper, keywords)
        if isinstance(node, ast.IfExp) and isinstance(node.test, ast.Name):
            chosen = call_keywords.get(node.test.id)
            taken = isinstance(chosen, ast.Constant) and bool(chosen.value)
            return self.resolve(node.body if taken else node.orelse, scope, call_keywords)
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Add)
            and isinstance(node.right, ast.Constant)
        ):
            group, resource = self.resolve(node.left, scope, call_keywords)
            return group, resource + str(node.right.value)
        if isinstance(node, ast.Name):
            assigned = [
                n.value
                for n in ast.walk(scope)
                if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == node.id for t in n.targets)
            ]
            assert assigned, f"cannot find what {node.id} is"
            return self.resolve(assigned[-1], scope, call_keywords)
        raise AssertionError(f"cannot resolve the API path {ast.unparse(node)!r}; keep paths analyzable")

    @staticmethod
    def _constant(node: ast.expr) -> str:
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "api":
            return str(getattr(api, node.attr))
        assert isinstance(node, ast.Constant), ast.unparse(node)
        return str(node.value)


def _functions(tree: ast.Module) -> Iterator[ast.AST]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def static_triples() -> set[Triple]:
    """What the operator's code uses in a watched namespace (namespaced mode, peering on)."""
    verbs = kube_verbs()
    used: set[Triple] = set()
    trees = {path: ast.parse(path.read_text()) for path in operator_modules()}
    for path, tree in trees.items():
        resolver = _PathResolver(tree, [other for other_path, other in trees.items() if other_path != path])
        for function in _functions(tree):
            for call in ast.walk(function):
                if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
                    continue
                target = call.func.value
                is_kube = (isinstance(target, ast.Attribute) and target.attr == "kube") or (
                    isinstance(target, ast.Name) and target.id == "kube"
                )
                if is_kube and call.func.attr in verbs:
                    group, resource = resolver.resolve(call.args[0], function, {})
                    used.add((group, resource, verbs[call.func.attr]))
                # kopf.event(...) posts a core v1 Event.
                if isinstance(target, ast.Name) and target.id == "kopf" and call.func.attr == "event":
                    used.add(("", "events", "create"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for decorator in node.decorator_list:
                    used |= _kopf_needs(decorator)
    used |= {("kopf.dev", "kopfpeerings", verb) for verb in ("list", "watch", "patch")}
    return used


def _kopf_needs(decorator: ast.expr) -> set[Triple]:
    """kopf watches every resource a handler is registered for; all but pure event handlers also patch the
    object (finalizers, progress and diff-base annotations)."""
    if not isinstance(decorator, ast.Call):
        return set()
    name = ast.unparse(decorator.func)
    if not (name.startswith("kopf.on.") or name in ("kopf.daemon", "kopf.timer")):
        return set()
    if name in ("kopf.on.login", "kopf.on.startup", "kopf.on.cleanup"):
        return set()
    args = [_PathResolver._constant(a) for a in decorator.args]
    group = "" if args[0] == "v1" else args[0]
    resource = args[-1]
    verbs = set(KOPF_WATCH) if name == "kopf.on.event" else KOPF_WATCH | {"patch"}
    return {(group, resource, verb) for verb in verbs}


# ---- the chart's rules -------------------------------------------------------------------------------
def granted(rules: list[dict[str, Any]]) -> set[Triple]:
    out: set[Triple] = set()
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
        out |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return out


def test_static_derivation_finds_the_known_calls() -> None:
    used = static_triples()
    # Spot checks that the analysis sees through helpers (_pod_path, _job_path(status=True), variables).
    assert ("", "pods", "delete") in used and ("", "pods", "patch") in used
    assert (api.GROUP, f"{api.PLURAL}/status", "patch") in used
    assert ("", "configmaps", "patch") in used and ("", "secrets", "get") in used
    assert not any(resource.startswith("nodes") for _, resource, _ in used)


def test_role_grants_exactly_what_the_code_uses() -> None:
    docs = objects()
    role = granted(one(docs, "Role")["rules"])
    used = static_triples()
    assert role - used == set(), f"the Role grants more than the operator uses: {sorted(role - used)}"
    assert used - role == set(), f"the Role misses what the operator uses: {sorted(used - role)}"
    cluster = granted(one(docs, "ClusterRole", "-kopf")["rules"])
    assert cluster == CLUSTER_NAMESPACED_MODE


def test_cluster_wide_mode_moves_the_same_rules_to_a_cluster_role() -> None:
    docs = objects([CHART / "ci" / "ha-values.yaml"])
    jobs = granted(one(docs, "ClusterRole", "-jobs")["rules"])
    kopf_rules = granted(one(docs, "ClusterRole", "-kopf")["rules"])
    used = static_triples()
    namespaced_only = {t for t in used if t[1] != "kopfpeerings"}
    assert jobs == namespaced_only
    assert kopf_rules == {
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
        ("kopf.dev", "clusterkopfpeerings", "list"),
        ("kopf.dev", "clusterkopfpeerings", "watch"),
        ("kopf.dev", "clusterkopfpeerings", "patch"),
    }


# ---- dynamic recording -------------------------------------------------------------------------------
_ACTION_VERBS = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create", "DELETE": "delete"}


@attrs.define(kw_only=True)
class RecordingApiServer(LocalApiServer):
    """The emulator, remembering each request that came from the operator process (kmock's own client,
    used by the test and by the emulator's garbage collection, identifies itself as kmock)."""

    # A class attribute: the emulator is an attrs class whose fields a subclass must not extend.
    seen: ClassVar[set[Triple]] = set()

    async def _handle(self, request: Any) -> Any:
        agent = request.headers.get("User-Agent", "")
        resource_info = request.resource
        # Discovery (/api/v1, /apis/<group>/<version>) has no plural: any authenticated client may read it.
        if (
            resource_info is not None
            and resource_info.plural
            and request.action is not None
            and not agent.startswith("kmock/")
        ):
            action = request.action.value
            verb = _ACTION_VERBS.get(action) or ("patch" if request.method.value == "PATCH" else "update")
            resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
            self.seen.add((request.resource.group, resource, verb))
        return await super()._handle(request)


async def _record(tmp_path: Path) -> set[Triple]:
    from resilientjob.planner.profile import uniform_profile

    RecordingApiServer.seen = set()
    password = "s3cret-for-rbac"
    with redis_server(password=password) as url:
        async with RecordingApiServer() as emulator, kmock.Server(emulator) as server:
            env = {
                **os.environ,
                "RJOB_API_URL": str(server.url).rstrip("/"),
                "RJOB_REDIS_URL": url,
                "RJOB_POLL_INTERVAL_S": "0.1",
            }
            env.pop("RJOB_STANDALONE", None)  # with peering, as the chart runs it
            with (tmp_path / "operator.log").open("wb") as log:
                process = subprocess.Popen(
                    [sys.executable, "-m", "resilientjob.cli", "operator"],
                    env=env,
                    cwd=ROOT,
                    stdout=log,
                    stderr=log,
                )
            try:
                profile = json.dumps(uniform_profile(8).model_dump(mode="json"))
                await emulator.post(
                    "/api/v1/namespaces/default/configmaps",
                    json={"metadata": {"name": "profile"}, "data": {"profile.json": profile}},
                )
                secret = base64.b64encode(password.encode()).decode()
                await emulator.post(
                    "/api/v1/namespaces/default/secrets",
                    json={"metadata": {"name": "redis"}, "data": {"password": secret}},
                )
                manifest = job_manifest(
                    "rbac",
                    profile={"configMapRef": {"name": "profile"}},
                    redis={"passwordSecretRef": {"name": "redis"}},
                )
                await emulator.post(rjob_path(), json=manifest)

                async def generation(g: int) -> bool:
                    body = await (await emulator.get(rjob_path("rbac"))).json()
                    return (body.get("status") or {}).get("planGeneration") == g

                await eventually(lambda: generation(0), 30, "generation 0")
                await emulator.delete("/api/v1/namespaces/default/pods/rbac-node-1")
                await eventually(lambda: generation(1), 10, "generation 1 after a pod deletion")
                await emulator.delete(rjob_path("rbac"))

                async def gone() -> bool:
                    return (await emulator.get(rjob_path("rbac"))).status == 404

                await eventually(gone, 10, "the job's deletion (finalizer removed)")
            finally:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        return set(RecordingApiServer.seen)


@pytest.mark.cluster
def test_recorded_requests_match_the_rules(tmp_path: Path) -> None:
    recorded = asyncio.run(_record(tmp_path))
    # The emulated operator runs cluster-wide (kmock cannot list namespaces), so its peering is the
    # cluster one; in the chart's namespaced mode the same calls go to kopfpeerings.
    cluster_scoped = {t for t in recorded if t[1] in ("customresourcedefinitions", "clusterkopfpeerings")}
    namespaced = recorded - cluster_scoped
    peering = {("kopf.dev", "kopfpeerings", v) for (_, r, v) in cluster_scoped if r == "clusterkopfpeerings"}
    used = static_triples()
    # Both derivations agree: nothing the operator did escaped the static analysis, nothing it found is dead.
    observed = namespaced | peering
    assert observed == used, (
        f"only recorded: {sorted(observed - used)}; only static: {sorted(used - observed)}"
    )
    role = granted(one(objects(), "Role")["rules"])
    assert observed <= role
    ha = objects([CHART / "ci" / "ha-values.yaml"])
    cluster_rules = granted(one(ha, "ClusterRole", "-jobs")["rules"]) | granted(
        one(ha, "ClusterRole", "-kopf")["rules"]
    )
    assert recorded <= cluster_rules
