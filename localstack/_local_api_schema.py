"""What kube-apiserver does to a custom resource before it stores it, from the CRD's structural schema:
drop nulls of non-nullable fields, apply `default`s, prune (or, with `?fieldValidation=Strict`, refuse)
fields the schema does not declare, validate types, enums, bounds, lengths and patterns, then run the
`x-kubernetes-validations` CEL rules (with `oldSelf` on updates: transition rules such as `self == oldSelf`
run only when there is an old value) on a real CEL implementation (cel-python).

Errors are worded as the API server words them (`spec.nodes: Required value`, `spec.policy: Unsupported
value: "teleport": supported values: "auto", ...`, `spec: Invalid value: "object": <rule's message>`) so that
a client's message names the field. An `x-kubernetes-int-or-string` value (a quantity) must be an integer or
a string; kinds and formats the CRD does not use (`format`, `oneOf`) are not checked.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import celpy
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}
_GO_TYPE = {dict: "object", list: "array", str: "string", int: "integer", float: "number", bool: "boolean"}


@dataclass(frozen=True, slots=True)
class Outcome:
    """The object as it would be stored, the fields pruned, and why it is invalid (empty: valid)."""

    obj: dict[str, Any]
    unknown: list[str]
    errors: list[str]


def _describe(value: Any) -> str:
    """How the API server prints an invalid value: scalars as JSON, objects and lists by type."""
    if isinstance(value, dict | list):
        return f'"{_GO_TYPE[type(value)]}"'
    return json.dumps(value)


def _type_ok(value: Any, expected: str) -> bool:
    if expected in ("integer", "number") and isinstance(value, bool):
        return False
    if expected == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _TYPES.get(expected, (object,)))


@functools.lru_cache(maxsize=512)
def _program(rule: str) -> celpy.Runner:
    environment = celpy.Environment()
    return environment.program(environment.compile(rule))


def _uses_old_self(rule: str) -> bool:
    return re.search(r"\boldSelf\b", rule) is not None


class _Walk:
    def __init__(self) -> None:
        self.rules = False
        self.unknown: list[str] = []
        self.errors: list[str] = []

    def fix(self, value: Any, schema: Mapping[str, Any], path: str) -> Any:
        """Defaults and pruning, depth first (the stored form, before validation)."""
        if isinstance(value, dict) and schema.get("type") == "object":
            properties = schema.get("properties") or {}
            extra = schema.get("additionalProperties")
            for key in list(value):
                if value[key] is None and not (properties.get(key) or extra or {}).get("nullable"):
                    del value[key]  # nulls of non-nullable fields are pruned before defaulting
            for key, sub in properties.items():
                if key not in value and "default" in sub:
                    value[key] = copy.deepcopy(sub["default"])
            for key in list(value):
                child = f"{path}.{key}" if path else key
                if path == "" and key == "metadata":
                    continue  # metadata is the API server's, never pruned by a CRD's schema
                if key in properties:
                    value[key] = self.fix(value[key], properties[key], child)
                elif isinstance(extra, dict):
                    value[key] = self.fix(value[key], extra, child)
                elif not schema.get("x-kubernetes-preserve-unknown-fields") and not (
                    path == "" and key in ("apiVersion", "kind", "metadata")
                ):
                    self.unknown.append(child)
                    del value[key]
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            return [self.fix(item, schema["items"], f"{path}[{i}]") for i, item in enumerate(value)]
        return value

    def check(self, value: Any, schema: Mapping[str, Any], path: str, old: Any, has_old: bool) -> None:
        if value is None:
            if not schema.get("nullable"):
                self.errors.append(
                    f'{path}: Invalid value: "null": {path} in body must be of type '
                    f'{schema.get("type", "object")}: "null"'
                )
            return
        expected = schema.get("type")
        if schema.get("x-kubernetes-int-or-string") and not (
            _type_ok(value, "integer") or isinstance(value, str)
        ):
            actual = _GO_TYPE.get(type(value), type(value).__name__)
            self.errors.append(
                f"{path}: Invalid value: {_describe(value)}: {path} in body must be of type "
                f'integer,string: "{actual}"'
            )
            return
        if expected and not _type_ok(value, expected):
            actual = _GO_TYPE.get(type(value), type(value).__name__)
            self.errors.append(
                f"{path}: Invalid value: {_describe(value)}: {path} in body must be of type {expected}: "
                f'"{actual}"'
            )
            return
        self._bounds(value, schema, path)
        if isinstance(value, dict):
            for key in schema.get("required") or []:
                if key not in value:
                    self.errors.append(f"{path + '.' if path else ''}{key}: Required value")
            properties = schema.get("properties") or {}
            extra = schema.get("additionalProperties")
            for key, item in value.items():
                sub = properties.get(key) or (extra if isinstance(extra, dict) else None)
                if sub is not None and not (path == "" and key == "metadata"):
                    old_item = old.get(key) if has_old and isinstance(old, dict) else None
                    has = has_old and isinstance(old, dict) and key in old
                    self.check(item, sub, f"{path}.{key}" if path else key, old_item, has)
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for index, item in enumerate(value):
                self.check(item, schema["items"], f"{path}[{index}]", None, False)
        if self.rules:
            self._rules(value, schema, path, old, has_old)

    def _bounds(self, value: Any, schema: Mapping[str, Any], path: str) -> None:
        shown = _describe(value)
        if "enum" in schema and value not in schema["enum"]:
            supported = ", ".join(json.dumps(v) for v in schema["enum"])
            self.errors.append(f"{path}: Unsupported value: {shown}: supported values: {supported}")
        if isinstance(value, int | float) and not isinstance(value, bool):
            for key, exclusive, word in (
                ("minimum", "exclusiveMinimum", "greater"),
                ("maximum", "exclusiveMaximum", "less"),
            ):
                if key not in schema:
                    continue
                bound, strict = schema[key], bool(schema.get(exclusive))
                wrong = (
                    (value <= bound if strict else value < bound)
                    if word == "greater"
                    else (value >= bound if strict else value > bound)
                )
                if wrong:
                    relation = f"{word} than" + ("" if strict else " or equal to")
                    self.errors.append(
                        f"{path}: Invalid value: {shown}: {path} in body should be {relation} {bound}"
                    )
        if isinstance(value, str):
            if "maxLength" in schema and len(value) > schema["maxLength"]:
                self.errors.append(f"{path}: Too long: may not be more than {schema['maxLength']} bytes")
            if "minLength" in schema and len(value) < schema["minLength"]:
                self.errors.append(
                    f"{path}: Invalid value: {shown}: {path} in body should be at least "
                    f"{schema['minLength']} chars long"
                )
            if "pattern" in schema and not re.search(schema["pattern"], value):
                self.errors.append(
                    f"{path}: Invalid value: {shown}: {path} in body should match '{schema['pattern']}'"
                )
        if isinstance(value, list):
            if "maxItems" in schema and len(value) > schema["maxItems"]:
                self.errors.append(
                    f"{path}: Too many: {len(value)}: must have at most {schema['maxItems']} items"
                )
            if "minItems" in schema and len(value) < schema["minItems"]:
                self.errors.append(
                    f"{path}: Invalid value: {len(value)}: {path} in body should have at least "
                    f"{schema['minItems']} items"
                )

    def _rules(self, value: Any, schema: Mapping[str, Any], path: str, old: Any, has_old: bool) -> None:
        for rule in schema.get("x-kubernetes-validations") or []:
            expression = rule["rule"]
            transition = _uses_old_self(expression)
            if transition and not has_old:
                continue  # a transition rule runs on updates only
            bindings = {"self": json_to_cel(value)}
            if transition:
                bindings["oldSelf"] = json_to_cel(old)
            try:
                passed = bool(_program(expression).evaluate(bindings))
                failure = rule.get("message") or f"failed rule: {expression}"
            except CELEvalError as exc:
                passed, failure = False, f"failed rule: {expression}: {exc.args[0] if exc.args else exc}"
            if not passed:
                where = path or "<nil>"
                field = rule.get("fieldPath")
                if field:
                    where = f"{path}{field}" if path else field.lstrip(".")
                # As the server words a rule's failure: the field's type, not its value.
                kind = _GO_TYPE.get(type(value), "object")
                self.errors.append(f'{where}: Invalid value: "{kind}": {failure}')


def admit(obj: Mapping[str, Any], schema: Mapping[str, Any], old: Mapping[str, Any] | None) -> Outcome:
    """Default, prune and validate `obj` (an update when `old` is given) against a CRD's schema."""
    walk = _Walk()
    stored = walk.fix(copy.deepcopy(dict(obj)), schema, "")
    walk.check(stored, schema, "", old, old is not None)
    if not walk.errors:
        # The CEL rules see a well-typed object only (their errors on a mistyped one would say nothing).
        walk.rules = True
        walk.check(stored, schema, "", old, old is not None)
    return Outcome(stored, walk.unknown, walk.errors)


def decoding_error(kind: str, obj: Mapping[str, Any]) -> str | None:
    """What kube-apiserver's decoder says of a ConfigMap or Secret whose data have the wrong types (it
    decodes built-in kinds into Go structs: a ConfigMap's data are strings, a Secret's data base64)."""
    prefix = f'{kind} in version "v1" cannot be handled as a {kind}: '
    fields = {"ConfigMap": ("data",), "Secret": ("data", "stringData")}.get(kind, ())
    for field in fields:
        values = obj.get(field)
        if values is None:
            continue
        if not isinstance(values, dict):
            found = _GO_TYPE.get(type(values), "value")
            return f"{prefix}json: cannot unmarshal {found} into Go struct field {kind}.{field} of type map"
        for key, value in values.items():
            if not isinstance(value, str):
                found = _GO_TYPE.get(type(value), "value")
                where = f"{kind}.{field}.{key}"
                return f"{prefix}json: cannot unmarshal {found} into Go struct field {where} of type string"
            if kind == "Secret" and field == "data":
                try:
                    base64.b64decode(value, validate=True)
                except ValueError:
                    return f"{prefix}illegal base64 data in {field}.{key}"
    return None
