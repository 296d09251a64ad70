"""`labelSelector` and `fieldSelector` of list and watch requests, which kmock ignores: without them
`kubectl describe` shows every event of the namespace, `kubectl delete --wait` watches every object, and the
operator's `resilientjob.io/job=NAME` lists return other jobs' pods.

Label selectors as kube-apiserver parses them (`k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, `k`,
`!k`); field selectors as `path=value` / `path!=value` on any dotted path (`metadata.name`,
`involvedObject.uid`): the server supports a fixed set of paths per kind, every one of them of this form.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Predicate = Callable[[Mapping[str, Any]], bool]

_SET = re.compile(r"^\s*(!?)([^\s!=()]+)\s*(?:(notin|in)\s*\(([^)]*)\))?\s*$")


def _split(selector: str) -> list[str]:
    """Split on commas outside parentheses (`a in (x,y),b=c`)."""
    parts, depth, current = [], 0, ""
    for char in selector:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [part.strip() for part in parts if part.strip()]


def _equality(key: str, value: str, negate: bool) -> Callable[[Mapping[str, str]], bool]:
    return lambda labels: (labels.get(key) == value) != negate


def _label_term(term: str) -> Callable[[Mapping[str, str]], bool]:
    for operator, negate in (("!=", True), ("==", False), ("=", False)):
        if operator in term:
            key, value = (side.strip() for side in term.split(operator, 1))
            return _equality(key, value, negate)
    match = _SET.match(term)
    if match is None:
        raise ValueError(f"unable to parse requirement: {term!r}")
    bang, key, operator, values = match.groups()
    if operator:
        allowed = {value.strip() for value in values.split(",")}
        inside = operator == "in"
        return lambda labels: (labels.get(key) in allowed) == inside if key in labels else not inside
    return lambda labels: (key in labels) != bool(bang)


def labels(selector: str) -> Predicate:
    """A predicate on objects from a label selector (empty: everything)."""
    terms = [_label_term(term) for term in _split(selector)]
    return lambda obj: all(term((obj.get("metadata") or {}).get("labels") or {}) for term in terms)


def _field(obj: Mapping[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return "" if value is None else str(value)


def _field_term(path: str, value: str, negate: bool) -> Predicate:
    return lambda obj: (_field(obj, path) == value) != negate


def fields(selector: str) -> Predicate:
    """A predicate on objects from a field selector (empty: everything)."""
    terms: list[Predicate] = []
    for term in _split(selector):
        negate = "!=" in term
        path, value = (side.strip() for side in re.split(r"!=|==|=", term, maxsplit=1))
        terms.append(_field_term(path, value, negate))
    return lambda obj: all(term(obj) for term in terms)


def of_request(params: Mapping[str, str]) -> Predicate:
    """The selectors of a request's query parameters, combined."""
    by_labels, by_fields = labels(params.get("labelSelector", "")), fields(params.get("fieldSelector", ""))
    return lambda obj: by_labels(obj) and by_fields(obj)
