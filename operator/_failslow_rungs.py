"""Whether the first rung of a fail-slow episode made the job slower, pure: no I/O.

A rung is chosen from estimates (the planner's model with the slow nodes slowed by their measured factors).
On a noisy host a factor can be wrong, or a healthy node can be named slow, and the rung then costs more
than it saves: S2 measured on the demo's GPT moved micro-batches off three nodes a validation pass had named
on noise, and the job ran 1.4x slower than with the slowdown left alone. Falcon's controller never looks
back; `FirstRungCheck` does: it takes the job's step time (the slowest node's step wall: in synchronous
training every node waits for it) over the last `window` steps before the first rung, and over the first
`window` steps of the plan it published. When the rung slowed the job by the episode's own threshold, the
tracker publishes the plan from before the episode again (`Action.REVERT`); the episode goes on, and its
later rungs are judged by the ski-rental loss as before. Only the first rung is judged: the plan before it
is the healthy plan the announcement keeps, while a later rung's predecessor is not kept anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import median
from typing import Any


@dataclass(slots=True)
class FirstRungCheck:
    """Step times around the episode's first rung; `observe` says once whether to revert it."""

    threshold: float
    window: int = 8
    action: str = ""
    """The rung being judged ("" when none is, or it was judged already)."""
    generation: int = -1
    """The generation the rung was decided on: steps of later generations ran under its plan."""
    before_s: float = 0.0
    judged: bool = False
    """Whether this episode's first rung was judged (its check never arms again)."""
    _steps: list[float] = field(default_factory=list)

    def step(self, seconds: float) -> None:
        """A step of the slowest node while no rung is being judged: the level a first rung starts from."""
        if not self.action:
            self._steps = [*self._steps[-(self.window - 1) :], seconds]

    def arm(self, action: str, generation: int) -> None:
        """The episode's first rung was just decided on `generation`; judge it on the next plan's steps."""
        if self.judged or self.action or not self._steps:
            return
        self.action, self.generation, self.before_s = action, generation, median(self._steps)
        self._steps = []

    def observe(self, generation: int, seconds: float) -> str | None:
        """A step of the slowest node under `generation`; the reason to revert, once, when the rung's plan
        made the job slower by the threshold over its first `window` steps."""
        if not self.action or generation <= self.generation:
            return None
        self._steps.append(seconds)
        if len(self._steps) < self.window:
            return None
        after = median(self._steps)
        action, before = self.action, self.before_s
        self.action, self.judged, self._steps = "", True, []
        if after < self.threshold * before:
            return None
        return (
            f"{action} made the job slower: its step {before:.3g}s -> {after:.3g}s ({after / before:.2f}x, "
            f"over {self.window} steps each) >= the {self.threshold}x threshold; back to the plan before it"
        )

    def reset(self) -> None:
        """A new episode."""
        self.action, self.generation, self.before_s, self.judged, self._steps = "", -1, 0.0, False, []

    def state(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "generation": self.generation,
            "before_s": self.before_s,
            "judged": self.judged,
            "steps": list(self._steps),
        }

    def resume(self, raw: Mapping[str, Any] | None) -> None:
        """Continue from `state()` (None: a state from before this check existed; start clean)."""
        self.reset()
        if not raw:
            return
        self.action = str(raw.get("action", ""))
        self.generation = int(raw.get("generation", -1))
        self.before_s = float(raw.get("before_s", 0.0))
        self.judged = bool(raw.get("judged", False))
        self._steps = [float(v) for v in raw.get("steps", [])][-self.window :]
