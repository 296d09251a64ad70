"""A plain `pip install resilientjob` (no extras) gives everything the shipped code imports.

The test reads every import in the shipped packages (top-level and inside functions), maps each third-party
module to the distribution that provides it in this environment, and checks that the distribution is a
runtime dependency in pyproject.toml, not only a development extra (`rjob local up` once failed in a plain
install because kmock came only with `[dev]`)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("planner", "agent", "operator", "cli", "protocol")
OPTIONAL = {"torch_npu": "ascend"}
"""Modules imported only where an extra is installed, with the extra that brings them."""


def _imported_modules() -> dict[str, str]:
    found: dict[str, str] = {}
    for folder in SHIPPED:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def _normal(name: str) -> str:
    """PEP 503: case and runs of -_. do not matter in distribution names."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_normal(Requirement(text).name) for text in project["dependencies"]}
    extras = {
        extra: {_normal(Requirement(text).name) for text in requirements}
        for extra, requirements in project["optional-dependencies"].items()
    }
    return runtime, extras


def test_every_third_party_import_is_a_runtime_dependency() -> None:
    runtime, extras = _declared()
    providers = packages_distributions()
    missing = []
    for module, where in sorted(_imported_modules().items()):
        if module in sys.stdlib_module_names or module in ("resilientjob", "__future__"):
            continue
        if module in OPTIONAL:
            assert module.replace("_", "-") in extras[OPTIONAL[module]], module
            continue
        distributions = {_normal(name) for name in providers.get(module, [])}
        assert distributions, f"{module} (imported in {where}) is not installed"
        if not distributions & runtime:
            missing.append(f"{module} ({where}) from {sorted(distributions)}")
    assert missing == [], "imported by shipped code but only in extras or undeclared: " + "; ".join(missing)


def test_every_runtime_dependency_is_imported() -> None:
    """The other way round: a declared runtime dependency that no shipped module imports is weight in every
    install (the `kubernetes` client once was: kopf and the operator talk to the API over aiohttp)."""
    runtime, _ = _declared()
    providers = packages_distributions()
    imported = {_normal(name) for module in _imported_modules() for name in providers.get(module, [])}
    assert sorted(runtime - imported) == []
