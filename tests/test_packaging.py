"""A plain `pip install resilientjob` (no extras) gives everything the shipped code imports.

The test reads every import in the shipped packages (top-level and inside functions), maps each third-party
module to the distribution that provides it in this environment, and checks that the distribution is a
runtime dependency in pyproject.toml, not only a development extra (`rjob local up` once failed in a plain
install because kmock came only with `[dev]`)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement

from resilientjob.cli._demo import DEFAULT_MANIFEST

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("planner", "agent", "operator", "cli", "protocol", "localstack")
OPTIONAL = {"torch_npu": "ascend", "kmock": "local", "celpy": "local", "attrs": "local"}
"""Modules imported only where an extra is installed, with the extra that brings them."""
EXTRA_FOLDERS = {"ascend": {"agent"}, "local": {"localstack"}}
"""The only shipped folders that may import an extra's modules (the rest must work without the extra)."""


def _imports(folders: tuple[str, ...]) -> Iterator[tuple[str, Path]]:
    """(module, importing file) for every absolute import in `folders`, in functions too."""
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    yield name, path.relative_to(ROOT)


def _imported_modules() -> dict[str, str]:
    found: dict[str, str] = {}
    for module, path in _imports(SHIPPED):
        found.setdefault(module.split(".")[0], str(path))
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
            # The distribution that provides it here, or its own name where it is not installed (torch_npu).
            names = {_normal(name) for name in providers.get(module, [])} or {_normal(module)}
            assert names & extras[OPTIONAL[module]], module
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


def test_an_extra_is_imported_only_where_it_is_needed() -> None:
    """The core install works without the `local` extra: only the local stack imports kmock and cel-python
    (and `rjob local up` checks for them before it starts the stack in the background)."""
    offenders = [
        f"{path}: {module}"
        for module, path in _imports(SHIPPED)
        if (top := module.split(".")[0]) in OPTIONAL and path.parts[0] not in EXTRA_FOLDERS[OPTIONAL[top]]
    ]
    assert offenders == []


def test_rjob_local_without_its_extra_says_what_to_install(tmp_path: Path) -> None:
    # kmock made unimportable, as in a plain `pip install resilientjob`.
    code = "import sys; sys.modules['kmock'] = None; from resilientjob.cli import main; sys.exit(main())"
    result = subprocess.run(
        [sys.executable, "-c", code, "local", "up"],
        capture_output=True,
        text=True,
        env={**os.environ, "RJOB_LOCAL_DIR": str(tmp_path / "stack")},
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "rjob: error: rjob local needs: pip install 'resilientjob[local]'"
    ]
    assert not (tmp_path / "stack").exists()  # nothing was started


def test_the_test_harness_is_not_shipped() -> None:
    """`resilientjob.testing` is a distribution of its own (testing/pyproject.toml), installed for development
    only: the product's package list does not name it and no shipped module imports it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert not [name for name in project["packages"] if name.startswith("resilientjob.testing")]
    assert "testing" not in project["package-dir"].values()
    harness = tomllib.loads((ROOT / "testing" / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert harness["packages"] == ["resilientjob.testing"]
    imported = [
        f"{path}: {module}" for module, path in _imports(SHIPPED) if module.startswith("resilientjob.testing")
    ]
    assert imported == []


def test_the_wheel_ships_every_shipped_file_and_builds_quietly(tmp_path: Path) -> None:
    """The wheel a plain `pip install .` builds holds every module and data file of the shipped folders
    (model profiles, the simulator's spot trace), and setuptools finds no folder it would leave out: it warned
    at length, in every `make demo` set-up, that the data folders were importable but not listed."""
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path), str(ROOT)]
    if importlib.util.find_spec("setuptools") is not None:
        build.append("--no-build-isolation")  # seconds, not a fresh build environment from the index
    result = subprocess.run(
        build,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "would be ignored" not in result.stdout + result.stderr
    (wheel,) = tmp_path.glob("resilientjob-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    missing = [
        f"{folder}/{path.relative_to(ROOT / folder)}"
        for package, folder in package_dirs.items()
        for path in sorted((ROOT / folder).rglob("*"))
        if path.is_file()
        and path.suffix in {".py", ".json", ".csv", ".typed", ".yaml"}
        and "__pycache__" not in path.parts
        and f"{package.replace('.', '/')}/{path.relative_to(ROOT / folder)}" not in shipped
    ]
    assert missing == []
    # `rjob demo`'s default manifest, where an installed `rjob` looks for it (a plain install once had none).
    assert f"resilientjob/{DEFAULT_MANIFEST.relative_to(ROOT)}" in shipped
