"""The one error type the planner raises for bad input: it names the offending field."""

from __future__ import annotations

from pydantic import ValidationError


class PlannerError(ValueError):
    """Bad or infeasible input. `field` names what the user must change (e.g. `global_batch`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def error_from_validation(exc: ValidationError, prefix: str = "") -> PlannerError:
    """Turn pydantic's multi-line report into one PlannerError naming the first bad field."""
    errors = exc.errors()
    # An unknown field first: it is mostly a misspelt one, which is then also reported missing.
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    location = ".".join(str(part) for part in first["loc"]) or "input"
    field = f"{prefix}.{location}" if prefix else location
    message = "unknown field" if first["type"] == "extra_forbidden" else str(first["msg"])
    # pydantic prefixes value errors with "Value error, "; the field name already says enough.
    message = message.removeprefix("Value error, ")
    return PlannerError(field, message)
