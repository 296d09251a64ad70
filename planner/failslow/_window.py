"""The sliding-window baseline of Falcon's Tables 4-5: flag a >10% change of the recent median.

The median of the last `recent` iterations is compared with the median of the `reference` iterations before
them; a relative change of at least `min_change` is reported with the recent window's first iteration as the
onset. After a report the detector waits until the reference window lies wholly after the change, so one
fail-slow is not reported twice. It has no model of jitter, so its choice of windows trades missed short or
small changes against detection delay; it is here to be measured against BOCD, not used.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from ..errors import PlannerError
from ._events import ChangeEvent, ChangeKind, check_time


@dataclass(frozen=True, slots=True)
class WindowConfig:
    recent: int = 5
    """Iterations whose median is the current level."""
    reference: int = 20
    """Iterations before them whose median is the reference level."""
    min_change: float = 0.10
    """Relative change of the median that counts as a fail-slow (Falcon: 10%)."""

    def __post_init__(self) -> None:
        if self.recent < 1 or self.reference < 1:
            raise PlannerError("recent", f"windows must be >= 1, got {self.recent} and {self.reference}")
        if self.min_change <= 0:
            raise PlannerError("min_change", f"must be > 0, got {self.min_change}")


class SlidingWindowDetector:
    """`feed(seconds) -> ChangeEvent | None`, the same API as `ChangeDetector`."""

    def __init__(self, config: WindowConfig | None = None) -> None:
        self.config = config or WindowConfig()
        self._size = self.config.recent + self.config.reference
        self._values: deque[float] = deque(maxlen=self._size)
        self._count = 0
        self._quiet_until = 0

    def feed(self, seconds: float) -> ChangeEvent | None:
        value = check_time(seconds)
        t = self._count
        self._count += 1
        self._values.append(value)
        if len(self._values) < self._size or t < self._quiet_until:
            return None
        window = np.fromiter(self._values, dtype=np.float64)
        before = float(np.median(window[: self.config.reference]))
        after = float(np.median(window[self.config.reference :]))
        if abs(after / before - 1) < self.config.min_change:
            return None
        onset = t - self.config.recent + 1
        self._quiet_until = onset + self.config.reference + self.config.recent - 1
        kind = ChangeKind.SLOWDOWN if after > before else ChangeKind.RECOVERY
        return ChangeEvent(index=onset, kind=kind, before_s=before, after_s=after, detected_at=t)

    def detect(self, seconds: list[float] | np.ndarray) -> list[ChangeEvent]:
        events = []
        for value in seconds:
            event = self.feed(float(value))
            if event is not None:
                events.append(event)
        return events
