"""Kubernetes object names and label values: the API server's checks (k8s.io/apimachinery's
`IsDNS1123Subdomain`, `IsDNS1123Label`, `IsDNS1035Label`, `IsValidLabelValue`, with its messages) and the
names the operator derives from a job's name, kept valid for any valid job name.

A job may be named with up to 253 characters (a DNS-1123 subdomain, as every custom resource), but a pod's
hostname and a Service's name are DNS labels (at most 63) and so is a label value; a derived name that would
not fit keeps a prefix of the job's name and a short hash of the whole of it, the way controllers do (the
ReplicaSet's pod-template hash, the StatefulSet's pod names), so two long job names never collide.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

SUBDOMAIN_MAX = 253
LABEL_MAX = 63
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
SUBDOMAIN_PATTERN = rf"^{_LABEL}(\.{_LABEL})*$"
"""A DNS-1123 subdomain (most object names), as a JSON-schema pattern."""
_SUBDOMAIN_RE = re.compile(SUBDOMAIN_PATTERN)
_LABEL_RE = re.compile(rf"^{_LABEL}$")
_DNS1035_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

_SUBDOMAIN_MESSAGE = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
_LABEL_MESSAGE = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start "
    "and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
_DNS1035_MESSAGE = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
    "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
    "validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
)


def subdomain_errors(value: str) -> list[str]:
    """Why `value` is not a DNS-1123 subdomain (the rule for most object names); empty when it is."""
    errors = []
    if len(value) > SUBDOMAIN_MAX:
        errors.append(f"must be no more than {SUBDOMAIN_MAX} characters")
    if not _SUBDOMAIN_RE.match(value):
        errors.append(_SUBDOMAIN_MESSAGE)
    return errors


def label_errors(value: str) -> list[str]:
    """Why `value` is not a DNS-1123 label (namespaces, a pod's hostname); empty when it is."""
    errors = []
    if len(value) > LABEL_MAX:
        errors.append(f"must be no more than {LABEL_MAX} characters")
    if not _LABEL_RE.match(value):
        errors.append(_LABEL_MESSAGE)
    return errors


def dns1035_errors(value: str) -> list[str]:
    """Why `value` is not a DNS-1035 label (the rule for Service names); empty when it is."""
    errors = []
    if len(value) > LABEL_MAX:
        errors.append(f"must be no more than {LABEL_MAX} characters")
    if not _DNS1035_RE.match(value):
        errors.append(_DNS1035_MESSAGE)
    return errors


def label_value_errors(value: str) -> list[str]:
    """Why `value` is not a valid label value; empty when it is."""
    errors = []
    if len(value) > LABEL_MAX:
        errors.append(f"must be no more than {LABEL_MAX} characters")
    if not _LABEL_VALUE_RE.match(value):
        errors.append(
            "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
            "and must start and end with an alphanumeric character"
        )
    return errors


def is_qualified_name(key: str) -> bool:
    """A label key, annotation key, taint key or topology key: a name of up to 63 characters, with an
    optional DNS subdomain prefix and a slash (as the API server's `IsQualifiedName`)."""
    prefix, slash, name = key.rpartition("/")
    return bool(name) and not label_value_errors(name) and not (slash and subdomain_errors(prefix))


def label_map_error(mapping: Mapping[str, str], what: str, values: bool) -> str:
    """Why a map of `what` keys (and, when `values`, label values) is not one the API server takes; '' when
    it is (labels, node selectors, annotations, label selectors)."""
    for key, value in mapping.items():
        if not is_qualified_name(key):
            return f"{key!r} is not a valid {what} key"
        if values and label_value_errors(value):
            return f"{key}: {value!r} is not a valid {what} value (63 characters, [-A-Za-z0-9_.])"
    return ""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def fit(
    base: str, suffix: str = "", limit: int = LABEL_MAX, *, dns_label: bool = False, dns1035: bool = False
) -> str:
    """`base + suffix` when it is valid as is; otherwise a prefix of `base`, a hash of the whole `base` and
    `suffix` (deterministic: the same job always gets the same names). With `dns_label` the result is a
    DNS-1123 label (no dots: a pod's name that is also its hostname); with `dns1035` a DNS-1035 label (a
    Service's name: a letter first)."""
    name = base + suffix
    fits = len(name) <= limit
    if dns1035:
        fits = fits and not dns1035_errors(name)
    elif dns_label:
        fits = fits and not label_errors(name)
    if fits:
        return name
    digest = _digest(base)
    stem = base.replace(".", "-") if dns_label or dns1035 else base
    if dns1035 and not stem[:1].isalpha():
        stem = "r-" + stem
    keep = limit - len(suffix) - len(digest) - 1
    prefix = stem[:keep].rstrip("-.")
    return f"{prefix}-{digest}{suffix}"
