"""Architecture rules that keep the planner pure and the layout importable."""

from __future__ import annotations

import ast
import operator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {"kopf", "kubernetes", "redis", "torch", "httpx", "aiohttp", "prometheus_client"}


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
