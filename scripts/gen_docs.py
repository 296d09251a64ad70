#!/usr/bin/env python3
"""Write docs/crd-reference.md from the API models (operator/api.py): one table per object with each field's
wire name, type, default, bounds, immutability and description, plus the CRD's cross-field rules, printer
columns and the named reasons of conditions and Events.

Run after changing the API: `.venv/bin/python scripts/gen_docs.py`; `--check` exits 1 when the committed file
differs (what tests/ship/test_docs.py asserts).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from resilientjob.operator import api
from resilientjob.operator.crd import crd_manifest

ROOT = Path(__file__).resolve().parent.parent
TARGET = "docs/crd-reference.md"
_BOUNDS = (
    ("minimum", ">="),
    ("maximum", "<="),
    ("minLength", "length >="),
    ("maxLength", "length <="),
    ("minItems", "items >="),
    ("maxItems", "items <="),
)


def _anchor(name: str) -> str:
    return name.lower()


def _type(node: dict[str, Any]) -> str:
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{_anchor(name)})"
    if "anyOf" in node:
        return " or ".join(_type(v) for v in node["anyOf"] if v.get("type") != "null")
    if node.get("type") == "array":
        return f"list of {_type(node.get('items', {}))}"
    if "enum" in node:
        return "string"
    return str(node.get("type", "object"))


def _constraints(node: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for variant in [node, *node.get("anyOf", [])]:
        if "enum" in variant:
            out.append("one of " + ", ".join(f"`{v}`" for v in variant["enum"]))
        for key, text in _BOUNDS:
            if key in variant:
                out.append(f"{text} {variant[key]}")
        if "exclusiveMinimum" in variant:
            out.append(f"> {variant['exclusiveMinimum']}")
        if "exclusiveMaximum" in variant:
            out.append(f"< {variant['exclusiveMaximum']}")
        if "pattern" in variant:
            out.append(f"pattern `{variant['pattern']}`")
    for rule in node.get("x-kubernetes-validations", []):
        out.append("immutable" if rule["rule"] == "self == oldSelf" else f"rule `{rule['rule']}`")
    return out


def _default(node: dict[str, Any]) -> str:
    if "default" not in node or node["default"] is None:
        return ""
    value = node["default"]
    if isinstance(value, (dict, list)):
        return "" if not value else f"`{json.dumps(value, separators=(',', ':'))}`"
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(schema: dict[str, Any]) -> list[str]:
    required = set(schema.get("required", []))
    lines = [
        "| field | type | required | default | constraints | description |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, node in schema.get("properties", {}).items():
        lines.append(
            "| "
            + " | ".join(
                [
                    f"`{name}`",
                    _type(node),
                    "yes" if name in required else "",
                    _cell(_default(node)),
                    _cell("; ".join(_constraints(node))),
                    _cell(node.get("description", "")),
                ]
            )
            + " |"
        )
    return lines


def _section(name: str, schema: dict[str, Any], doc: str | None) -> list[str]:
    lines = [f"### {name}", ""]
    description = (doc or schema.get("description") or "").strip()
    if description:
        lines += [" ".join(description.split()), ""]
    lines += _table(schema)
    rules = [r for r in schema.get("x-kubernetes-validations", []) if r["rule"] != "self == oldSelf"]
    if rules:
        lines += ["", "Cross-field rules (checked by the API server, and again by the operator):", ""]
        lines += [f"- `{r['rule']}`: {r['message']}" for r in rules]
    return [*lines, ""]


def _models(root: type[BaseModel]) -> dict[str, type[BaseModel]]:
    """Every model reachable from `root`, by class name (pydantic's $defs names)."""
    found: dict[str, type[BaseModel]] = {}
    queue: list[type[BaseModel]] = [root]
    while queue:
        model = queue.pop()
        if model.__name__ in found:
            continue
        found[model.__name__] = model
        for field in model.model_fields.values():
            for candidate in _inner_types(field.annotation):
                if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                    queue.append(candidate)
    return found


def _inner_types(annotation: Any) -> list[Any]:
    args = getattr(annotation, "__args__", None)
    if not args:
        return [annotation]
    return [inner for arg in args for inner in _inner_types(arg)]


def _inline_enums(schema: dict[str, Any]) -> dict[str, Any]:
    """Replace references to enums (DeviceResource, Policy, ...) by the enum itself: its values belong in the
    field's row, not in a section of their own."""
    defs = schema.get("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            target = defs[node["$ref"].rsplit("/", 1)[-1]]
            if "enum" in target:
                merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
                return {k: v for k, v in merged.items() if k not in ("title", "description")} | (
                    {"description": node["description"]} if "description" in node else {}
                )
        return {key: walk(value) for key, value in node.items()}

    out: dict[str, Any] = walk(schema)
    return out


def render() -> str:
    version = crd_manifest()["spec"]["versions"][0]
    lines = [
        "# ResilientJob API reference",
        "",
        "<!-- Generated by scripts/gen_docs.py from operator/api.py. Do not edit by hand. -->",
        "",
        f"`apiVersion: {api.API_VERSION}`, `kind: {api.KIND}` (plural `{api.PLURAL}`, short name "
        f"`{api.SHORT_NAME}`), namespaced, with a status subresource. Every object rejects unknown fields, "
        "so a misspelt field is an error that names it. Examples: `examples/`.",
        "",
        "`kubectl get rjob` shows (and `-o wide` adds the columns marked wide):",
        "",
        "| column | from | what |",
        "| --- | --- | --- |",
        *[
            f"| {c['name']}{' (wide)' if c.get('priority') else ''} | `{c['jsonPath']}` | "
            f"{c.get('description', '')} |"
            for c in version["additionalPrinterColumns"]
        ],
        "",
    ]
    for title, root in (("Spec", api.ResilientJobSpec), ("Status", api.ResilientJobStatus)):
        lines += [f"## {title}", ""]
        schema = _inline_enums(root.model_json_schema(by_alias=True, mode="validation"))
        definitions = {root.__name__: schema, **schema.get("$defs", {})}
        models = _models(root)
        for name in [root.__name__, *sorted(n for n in definitions if n != root.__name__)]:
            model = models.get(name)
            if model is None or not definitions[name].get("properties"):
                continue
            lines += _section(
                name, definitions[name], model.__doc__ if model.__doc__ != BaseModel.__doc__ else None
            )
    lines += ["## Condition types and reasons", "", "Conditions (`status.conditions[].type`):", ""]
    lines += [f"- `{c.value}`" for c in api.ConditionType]
    lines += ["", "Reasons (conditions and Events; tools match on these, never on messages):", ""]
    lines += [f"- `{r.value}`" for r in api.Reason]
    lines += ["", "Phases (`status.phase`):", ""]
    lines += [f"- `{p.value}`" for p in api.Phase]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    text = render()
    target = ROOT / TARGET
    if "--check" in argv:
        if not target.exists() or target.read_text() != text:
            print(f"{TARGET} is stale: run scripts/gen_docs.py", file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
