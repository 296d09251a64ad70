"""The change events every fail-slow detector emits, and the shared bad-input check for iteration times."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from ..errors import PlannerError


class ChangeKind(StrEnum):
    """Direction of a verified change in iteration time."""

    SLOWDOWN = "slowdown"
    RECOVERY = "recovery"


@dataclass(frozen=True, slots=True)
class ChangeEvent:
    """A change point in one worker's iteration times.

    `index` is the first iteration of the new level (the first slow, or first recovered, iteration);
    `detected_at` is the iteration whose arrival revealed it, so `detected_at - index` is the detection delay.
    `before_s` and `after_s` are the levels on either side (medians, robust to one-iteration spikes).
    """

    index: int
    kind: ChangeKind
    before_s: float
    after_s: float
    detected_at: int

    def __post_init__(self) -> None:
        if self.index < 0:
            raise PlannerError("index", f"must be >= 0, got {self.index}")
        if self.detected_at < self.index:
            raise PlannerError("detected_at", f"{self.detected_at} precedes the change at {self.index}")
        for name in ("before_s", "after_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise PlannerError(name, f"must be a positive iteration time, got {value}")

    @property
    def ratio(self) -> float:
        """after / before: 1.5 means 50% slower."""
        return self.after_s / self.before_s

    def as_json(self) -> dict[str, object]:
        """The `rjob detect` contract: index, kind, before_s, after_s."""
        return {
            "index": self.index,
            "kind": str(self.kind),
            "before_s": self.before_s,
            "after_s": self.after_s,
        }


def check_time(value: float, field: str = "iteration_time_s") -> float:
    """An iteration time must be finite and positive; anything else is a telemetry bug, not a slowdown."""
    if not (math.isfinite(value) and value > 0):
        raise PlannerError(field, f"iteration times must be finite and positive, got {value}")
    return float(value)
