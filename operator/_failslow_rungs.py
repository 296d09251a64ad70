"""Whether the first rung of a fail-slow episode made the job slower, pure: no I/O.

A rung is chosen from estimates (the planner's model with the slow nodes slowed by their measured factors).
On a noisy host a factor can be wrong, or a healthy node can be named slow, and the rung then costs more
than it saves: S2 measured on the demo's GPT moved micro-batches off three nodes a validation pass had named
on noise, and the job ran 1.4x slower than with the slowdown left alone. Falcon's controller never looks
back; `FirstRungCheck` does: it takes the job's step time (the slowest node's step wall: in synchronous
training every node waits for it) over the last `window` steps before the first rung, and over the first
`window` steps of the generation that published it. When the rung slowed the job by the episode's own
threshold, the tracker publishes the plan from before the episode again (`Action.REVERT`); the episode goes
on, and its later rungs are judged by the ski-rental loss as before.

Only the episode's first published rung is judged, and only S2 and S3 (layouts of the same nodes): the plan
before it is the healthy plan the announcement keeps, while a later rung's predecessor is kept nowhere, and
S4's parked node keeps running probe steps that say nothing of the job. The check arms when the rung is
decided, learns its generation when the reconciler commits it, and disarms when the rung is not published.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import median
from typing import Any

JUDGED_ACTIONS = ("microbatch", "topology")
"""Rungs that re-arrange the same nodes (S2, S3); S4 takes nodes out and is judged by its estimate."""


@dataclass(slots=True)
class FirstRungCheck:
    """Step times around the episode's first rung; `observe` says once whether to revert it."""

    threshold: float
    window: int = 8
    action: str = ""
    """The rung being judged ("" when none is, or it was judged already)."""
    decided_on: int = -1
    """The generation the rung was decided on: its steps, up to the new plan, are the level before."""
    generation: int = -1
    """The generation that published the rung (-1 while its commit is pending): only its steps count after."""
    judged: bool = False
    """Whether this episode's first rung was published (and judged, when it could be): never again."""
    _before: list[float] = field(default_factory=list)
    _after: list[float] = field(default_factory=list)

    def arm(self, action: str, generation: int) -> None:
        """A rung was just decided on `generation`; the first S2 or S3 of the episode is judged once the
        reconciler says which generation published it (`published`)."""
        if self.judged or self.action or action not in JUDGED_ACTIONS:
            return
        self.action, self.decided_on, self.generation, self._after = action, generation, -1, []

    def published(self, generation: int) -> None:
        """The reconciler committed the decided rung as `generation`. Whatever it was, it is the episode's
        first published rung: no later one is judged."""
        if self.action and self.generation < 0:
            self.generation = generation
        self.judged = True

    def declined(self) -> None:
        """The decided rung was not published (nothing would help, or the commit lost a race)."""
        if self.action and self.generation < 0:
            self.action, self.decided_on, self._after = "", -1, []

    def same_layout(self, old: int, new: int) -> bool:
        """Generation `new` republished generation `old`'s layout (a world re-formed, a store replaced):
        when `old` published the rung being judged, `new`'s steps are the rung's too. Whether it moved."""
        if not (self.action and self.generation == old):
            return False
        self.generation = new
        return True

    def observe(self, generation: int, seconds: float) -> str | None:
        """A step of the slowest node under `generation`: before the rung's plan, the level it started from
        (the last `window` steps); under it, once `window` steps are in, the reason to revert when the plan
        made the job slower by the threshold. Steps of other generations (a fail-stop between) say nothing."""
        if not self.action or generation == self.decided_on:
            self._before = [*self._before[-(self.window - 1) :], seconds]  # the layout the rung started from
            return None
        if generation != self.generation:  # the rung's commit is pending, or another plan runs meanwhile
            return None
        self._after.append(seconds)
        if len(self._after) < self.window:
            return None
        before, after, action = median(self._before or [seconds]), median(self._after), self.action
        enough = len(self._before) >= max(1, self.window // 2)
        self.action, self.decided_on, self._before, self._after = "", -1, [], []
        if not enough or after < self.threshold * before:
            return None
        return (
            f"{action} made the job slower: its step {before:.3g}s -> {after:.3g}s ({after / before:.2f}x, "
            f"over {self.window} steps each) >= the {self.threshold}x threshold; back to the plan before it"
        )

    def reset(self) -> None:
        """A new episode."""
        self.action, self.decided_on, self.generation, self.judged = "", -1, -1, False
        self._before, self._after = [], []

    def state(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "decided_on": self.decided_on,
            "generation": self.generation,
            "judged": self.judged,
            "before": list(self._before),
            "after": list(self._after),
        }

    def resume(self, raw: Mapping[str, Any] | None) -> None:
        """Continue from `state()` (None: a state from before this check existed; start clean)."""
        self.reset()
        if not raw:
            return
        self.action = str(raw.get("action", ""))
        self.decided_on = int(raw.get("decided_on", -1))
        self.generation = int(raw.get("generation", -1))
        self.judged = bool(raw.get("judged", False))
        self._before = [float(v) for v in raw.get("before", [])][-self.window :]
        self._after = [float(v) for v in raw.get("after", [])][-self.window :]
