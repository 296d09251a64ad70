"""Architecture rules: the planner stays pure, the packages depend in one direction, nobody reaches into
another package's private modules, and no modules import each other in a circle.

The intended shape is operator -> protocol -> planner <- agent (and operator -> planner, agent -> protocol):
`resilientjob.protocol` is the wire contract (messages, Redis and TCPStore keys) that neither the operator
nor the agent owns. The messages carry the planner's `Plan` and `ModelProfile`, so the protocol sits above
the planner and the planner, at the bottom, imports no other resilientjob package.

Beside them: `resilientjob.localstack` (a Kubernetes control plane on one machine for `rjob local`) stands
where a cluster would, so it imports the operator only through the few public modules a cluster side needs
(`LOCALSTACK_MAY_IMPORT`) and never the agent; nothing in the product imports it (the CLI starts it as a
process). `resilientjob.testing`, the test harness, is not shipped: tests and benchmarks import it, the
product never does.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"kopf", "kubernetes", "redis", "torch", "httpx", "aiohttp", "prometheus_client"}
PACKAGES = ("planner", "agent", "operator", "cli", "protocol", "localstack")
"""The folders of the shipped `resilientjob.*` packages (mapped in pyproject.toml)."""
HARNESS = "testing"
"""The folder of `resilientjob.testing`, the test harness (its own distribution: testing/pyproject.toml)."""
FOLDERS = (*PACKAGES, HARNESS)

LOCALSTACK_MAY_IMPORT = {
    "resilientjob.operator.crd",  # the API server serves the ResilientJob CRD the operator defines
    "resilientjob.operator.kube",  # the process kubelet calls the API server with the operator's client
    "resilientjob.operator.names",  # the API server checks names and label values as kube-apiserver does
}
"""The operator modules `resilientjob.localstack` may import (and nothing else of the operator)."""

PROTOCOL_MAY_IMPORT = {
    # The messages carry a plan (`PlanAnnouncement.plan`) and a model profile (`ModelProfileReport.profile`):
    # the planner's public types, which the planner itself validates and computes with.
    "resilientjob.planner.plan",
    "resilientjob.planner.profile",
}
PROTOCOL_THIRD_PARTY = {"pydantic"}
"""What `resilientjob.protocol` may import besides the standard library and `PROTOCOL_MAY_IMPORT`."""

PROTOCOL_LAZY_THIRD_PARTY = {"prometheus_client"}
"""What `resilientjob.protocol` may import inside a function only, for its users that export metrics
(`messages.export_drop_counts`): importing the protocol never loads it."""

ALLOWED_PRIVATE_IMPORTS: set[tuple[str, str]] = {
    # Benchmarks that time one internal piece by itself, side by side with a baseline: the piece has no
    # public entry point of its own (its package uses it inside a larger call), and making it public only for
    # its benchmark would widen the package's API. Product code (planner, agent, operator, cli, protocol,
    # scripts) has no exception.
    ("bench/bench_control_plane.py", "resilientjob.operator._redis_state"),  # the operator's heartbeat scan
    ("bench/bench_emulator.py", "resilientjob.localstack._local_api_discovery"),  # the emulator's verbs
    ("bench/bench_straggler_gate.py", "resilientjob.operator._failslow"),  # FailSlowTracker alone
    ("bench/bench_failslow_replay.py", "resilientjob.operator._failslow"),  # FailSlowTracker on recorded runs
    ("bench/bench_failslow_noise.py", "resilientjob.operator._failslow"),  # FailSlowTracker fed by noise
    # The validation gate on recorded runs, with the steps the operator keeps per node.
    ("bench/bench_comm_gate_replay.py", "resilientjob.operator._failslow_validation"),
    ("bench/bench_comm_gate_replay.py", "resilientjob.operator._failslow_clock"),
    ("bench/bench_comm_gate_replay.py", "resilientjob.operator._failslow_job"),
    ("bench/bench_data.py", "resilientjob.agent._data_files"),  # the data loader's file index
    ("bench/bench_overhead.py", "resilientjob.agent._runtime_commit"),  # the commit vote's cost per step
    ("bench/bench_overhead.py", "resilientjob.agent._runtime_grads"),  # gradient bucketing's cost per step
    ("bench/bench_runtime_estimator.py", "resilientjob.agent._runtime_commit"),
    ("bench/bench_templates.py", "resilientjob.planner._stage_mapping"),  # StageMapper against the paper's DP
    ("bench/bench_warm_exit.py", "resilientjob.localstack._warm_start"),  # the warm interpreter's preload
    # The runtime's own device sync and wait on a collective, timed on an accelerator.
    ("bench/bench_gpu_failslow.py", "resilientjob.agent._device_sync"),
    ("bench/bench_gpu_failslow.py", "resilientjob.agent._runtime_wait"),
    # The parked probe as a worker and as a parked node's agent time it (the operator reads one against
    # the other).
    ("bench/bench_gpu_failslow.py", "resilientjob.agent._parked"),
    ("bench/bench_gpu_failslow.py", "resilientjob.agent._device_work"),
    # The harness stands in for the pod agents and the store pod, which know when a plan is fully applied.
    ("testing/launcher.py", "resilientjob.agent._runtime_schedule"),
}
"""(importing file, imported module) pairs exempt from the private-module rule, each with its reason."""


@dataclass(frozen=True, slots=True)
class Import:
    path: str
    """The importing file, relative to the repository."""
    module: str
    """The imported module, absolute (relative imports resolved); for `from m import n`, `m.n` when that
    names a module of ours, else `m`."""
    line: int
    top_level: bool
    """Executed when the importing module is imported (not inside a function nor `if TYPE_CHECKING:`)."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["resilientjob", *parts]) if parts[0] in FOLDERS else ".".join(parts)


def sources(*folders: str) -> Iterator[Path]:
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


OURS = {module_name(path) for path in sources(*FOLDERS)}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path) -> list[Import]:
    """Every import in `path`, with whether it runs at import time."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []
    relative = path.relative_to(ROOT).as_posix()

    def visit(node: ast.AST, top_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(relative, alias.name, child.lineno, top_level) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.rsplit(".", child.level - 1)[0] if child.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    target = sub if sub in OURS or (alias.name.startswith("_") and base in OURS) else base
                    found.append(Import(relative, target, child.lineno, top_level))
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                for statement in child.body:
                    visit(ast.Module(body=[statement], type_ignores=[]), False)
                for statement in child.orelse:
                    visit(ast.Module(body=[statement], type_ignores=[]), top_level)
            else:
                visit(child, top_level)

    visit(ast.parse(path.read_text()), True)
    return found


def package_of(module: str) -> str | None:
    """`planner` for `resilientjob.planner.sim.engine`; None for anything not ours."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "resilientjob" and parts[1] in FOLDERS else None


def private_part(module: str) -> str | None:
    """The first private (underscore, not dunder) component of a module path, if any."""
    for part in module.split(".")[2:]:
        if part.startswith("_") and not part.endswith("__"):
            return part
    return None


def test_planner_imports_only_pure_libraries() -> None:
    offenders = []
    for path in (ROOT / "planner").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert offenders == []


def test_operator_folder_does_not_shadow_the_standard_library() -> None:
    assert not (ROOT / "operator" / "__init__.py").exists()
    assert hasattr(operator, "itemgetter")


def test_protocol_imports_pydantic_the_standard_library_and_the_planners_types_only() -> None:
    import sys

    offenders = []
    for path in sources("protocol"):
        for imp in imports(path):
            top = imp.module.split(".")[0]
            if top == "resilientjob":
                ok = package_of(imp.module) == "protocol" or imp.module in PROTOCOL_MAY_IMPORT
            else:
                ok = top in sys.stdlib_module_names or top in PROTOCOL_THIRD_PARTY or top == "__future__"
                ok = ok or (top in PROTOCOL_LAZY_THIRD_PARTY and not imp.top_level)
            if not ok:
                offenders.append(f"{imp.path}:{imp.line}: {imp.module}")
    assert offenders == []


def test_packages_depend_in_one_direction() -> None:
    may_not = {
        "planner": {
            "agent",
            "operator",
            "cli",
            "localstack",
        },  # and not the protocol either: see the cycle test
        "protocol": {"agent", "operator", "cli", "localstack"},
        "operator": {"agent", "localstack"},
        "agent": {"operator", "cli", "localstack"},
        "localstack": {"agent", "cli"},
        "cli": {"localstack"},  # `rjob local up` starts it as a process (`python -m resilientjob.localstack`)
    }
    offenders = []
    for folder in PACKAGES:  # and no shipped package imports the test harness
        forbidden = may_not[folder] | {HARNESS}
        for path in sources(folder):
            for imp in imports(path):
                if package_of(imp.module) in forbidden:
                    offenders.append(f"{imp.path}:{imp.line}: {imp.module}")
    assert offenders == []


def test_the_local_stack_imports_only_the_operators_public_cluster_side() -> None:
    offenders = [
        f"{imp.path}:{imp.line}: {imp.module}"
        for path in sources("localstack")
        for imp in imports(path)
        if package_of(imp.module) == "operator" and imp.module not in LOCALSTACK_MAY_IMPORT
    ]
    assert offenders == []


def test_nobody_imports_another_packages_private_modules() -> None:
    offenders = []
    used: set[tuple[str, str]] = set()
    for path in sources(*FOLDERS, "bench", "scripts"):
        own = package_of(module_name(path))
        for imp in imports(path):
            target = package_of(imp.module)
            if target is None or target == own or private_part(imp.module) is None:
                continue
            if (imp.path, imp.module) in ALLOWED_PRIVATE_IMPORTS:
                used.add((imp.path, imp.module))
            else:
                offenders.append(f"{imp.path}:{imp.line}: {imp.module}")
    assert offenders == []
    assert ALLOWED_PRIVATE_IMPORTS - used == set(), "an exception no longer needed: remove it"


def import_cycles(module_level_only: bool = True) -> list[list[str]]:
    """Circles of imports among our modules (strongly connected components of two or more): module-level
    imports only, or every import (in functions and under `if TYPE_CHECKING:` too)."""
    graph: dict[str, set[str]] = {}
    for path in sources(*FOLDERS):
        graph[module_name(path)] = {
            imp.module
            for imp in imports(path)
            if (imp.top_level or not module_level_only) and imp.module in OURS
        } - {module_name(path)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm (the graph is small; recursion is fine)
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(components)


def test_no_import_cycles() -> None:
    assert import_cycles() == []


def test_no_circles_through_deferred_or_type_only_imports_either() -> None:
    # A circle hidden in a function or under TYPE_CHECKING still ties two modules into one: the helper
    # takes a narrow view (a Protocol) of what it needs instead.
    assert import_cycles(module_level_only=False) == []


def test_the_rules_can_fail() -> None:
    # The checks see what they must: a relative import resolved, a private module named in a `from` list,
    # an import under TYPE_CHECKING or in a function not counted as module-level.
    found = {(imp.module, imp.top_level) for imp in imports(ROOT / "operator" / "reconciler.py")}
    assert ("resilientjob.operator.metrics", True) in found
    assert any(private_part(module) for module, _ in found)
    assert private_part("resilientjob.planner._errors") == "_errors"
    assert private_part("resilientjob.agent.__main__") is None
    assert package_of("resilientjob.planner.sim.engine") == "planner"
