"""Generate the ResilientJob CustomResourceDefinition from the pydantic models in `api.py`.

pydantic emits JSON Schema 2020-12; Kubernetes wants a *structural* OpenAPI v3.0 schema: no `$ref`, no
`anyOf` for optional fields (use `nullable`), boolean `exclusiveMinimum`, no `title`, and a `type` on every
node but an int-or-string (a quantity, the one union kept). `openapi_schema` performs exactly those
rewrites; `crd_manifest` wraps the result with the printer columns, short name and status subresource.
`scripts/gen_crds.py` writes it to `crds/`, and a test fails when the committed file drifts from this output.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from . import api

CRD_FILE = f"crds/{api.GROUP}_{api.PLURAL}.yaml"

_DROP = {"title", "discriminator"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Inline every `$ref` and rewrite JSON Schema constructs into their OpenAPI v3.0 forms."""
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP or key == "$defs":
            continue
        out[key] = _resolve(value, defs)
    if "anyOf" in out:
        variants = [v for v in out.pop("anyOf") if v.get("type") != "null"]
        if out.get("default", ...) is None:
            out.pop("default")
        if sorted(v.get("type") for v in variants) == ["integer", "string"]:
            # A quantity (`80Gi` or a number): the one union a structural schema allows, as Kubernetes
            # writes its own (the string's pattern sits beside the anyOf).
            return {
                **out,
                "x-kubernetes-int-or-string": True,
                "anyOf": [{"type": "integer"}, {"type": "string"}],
            }
        if len(variants) != 1:
            raise ValueError(f"only Optional[X] unions are allowed in the CRD, got {variants}")
        # A null default on an optional field means "absent" in Kubernetes (dropped above): no nullable.
        out = {**variants[0], **out}
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in out and not isinstance(out[bound], bool):
            out[plain] = out[bound]
            out[bound] = True
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if out.get("type") == "object" and out.get("additionalProperties") is True:
        raise ValueError("an open object (dict[str, Any]) has no structural schema: type it")
    if out.get("type") == "object" and "properties" in out:
        out.setdefault("additionalProperties", None)
        if out["additionalProperties"] in (None, False):
            out.pop("additionalProperties")
    if "default" in out and isinstance(out["default"], dict) and not out["default"]:
        # `{}` defaults let the API server fill nested defaults in; keep them explicit.
        out["default"] = {}
    return out


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural OpenAPI v3.0 schema of one API model (camelCase names, defaults, bounds)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    resolved: dict[str, Any] = _resolve(raw, raw.get("$defs", {}))
    return resolved


def crd_manifest() -> dict[str, Any]:
    """The complete CustomResourceDefinition object."""
    spec_schema = openapi_schema(api.ResilientJobSpec)
    status_schema = openapi_schema(api.ResilientJobStatus)
    status_schema.pop("required", None)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": [api.SHORT_NAME],
                "categories": ["all"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {
                            "name": "Phase",
                            "type": "string",
                            "jsonPath": ".status.phase",
                            "description": "Pending, Running, Reconfiguring, Succeeded or Failed.",
                        },
                        {
                            "name": "Workers",
                            "type": "string",
                            "jsonPath": ".status.workers",
                            "description": "Workers of the current plan at work / in it.",
                        },
                        {
                            "name": "Reason",
                            "type": "string",
                            "jsonPath": '.status.conditions[?(@.type=="WorkersReady")].reason',
                            "description": "Whether every worker pod runs (AllWorkersRunning) or why not: "
                            "PodsStarting, PodNotStarting, PodUnschedulable, PodsRefused, NodeFailed; "
                            "TrainingComplete at the end, and a Failed job's reason. The WorkersReady "
                            "condition's message says more.",
                        },
                        {
                            "name": "Layout",
                            "type": "string",
                            "jsonPath": ".status.layout",
                            "description": "The current plan's DP x PP layout.",
                        },
                        {
                            "name": "Throughput",
                            "type": "number",
                            "jsonPath": ".status.throughput",
                            "description": "Measured samples per second.",
                        },
                        {
                            "name": "Step",
                            "type": "integer",
                            "jsonPath": ".status.step",
                            "description": "Committed global steps.",
                        },
                        {
                            "name": "Loss",
                            "type": "number",
                            "jsonPath": ".status.loss",
                            "description": "Training loss of the last committed step.",
                        },
                        {
                            "name": "Gen",
                            "type": "integer",
                            "jsonPath": ".status.planGeneration",
                            "description": "Plan generation: one more at every recovery, mitigation or "
                            "re-formation of the workers.",
                        },
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                        {
                            "name": "Last-Change",
                            "type": "string",
                            "jsonPath": ".status.lastDecision.trigger",
                            "description": "What published the current generation (NodeFailed, NodeSlow, "
                            "CollectiveFailed, ...).",
                            "priority": 1,
                        },
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A distributed training job that survives fail-stops and "
                            "fail-slows by re-planning its DP/PP layout in place.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                }
            ],
        },
    }


def crd_yaml() -> str:
    import yaml

    header = "# Generated by scripts/gen_crds.py from operator/api.py. Do not edit by hand.\n"
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=110)
