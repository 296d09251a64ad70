"""Kubernetes resource quantities (`8`, `500m`, `64Gi`, `1.5G`, `.5`, `1e3`) and their exact values: one
table of suffixes for the pods' resources (`_api_pods`) and the accelerator memory (`api.quantity_bytes`)."""

from __future__ import annotations

import re
from decimal import Decimal

PATTERN = r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)(n|u|m|Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|[eE][-+]?[0-9]+)?$"
"""What a pod's resources take (no sign)."""

SCALE = {
    "": Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("0.001"),
    **{suffix: Decimal(1024) ** (i + 1) for i, suffix in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{suffix: Decimal(1000) ** (i + 1) for i, suffix in enumerate(("k", "M", "G", "T", "P", "E"))},
}


def value(text: int | str) -> Decimal:
    """The exact value of a quantity; ValueError when `text` is none."""
    if isinstance(text, int):
        return Decimal(text)
    match = re.fullmatch(PATTERN, text)
    if match is None:
        raise ValueError(f"{text!r} is not a quantity such as 8, 500m or 64Gi")
    suffix = match.group(3) or ""
    if suffix[:1] in ("e", "E"):
        return Decimal(text)  # a decimal exponent, which Decimal reads itself
    return Decimal(text.removesuffix(suffix)) * SCALE[suffix]
