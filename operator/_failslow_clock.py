"""When a worker's slowdown began, on the operator's clock, from what its agent says and what its steps
bear out. Pure: no I/O.

An agent's report dates its slowdown on the agent's own clock: `detected_at` less `slowed_s`, the seconds the
worker's steps took from the onset through the report. `minDurationS` counts from there (`_failslow`).
Neither figure is taken on trust:

- **The agent's clock may not be the operator's** (a node whose time sync failed). Each node's offset is
  the smallest (arrival - `sent_at`) over its recent step records: the clocks' difference plus the shortest
  delivery, as NTP's minimum-delay filter reads it. An offset within `[0, MAX_DELIVERY_S]` is delivery and
  the clocks are taken to agree; one outside it moves the onset onto the operator's clock. A clock behind
  by a minute would otherwise pass `minDurationS` at once; one ahead would hold it back.
- **The onset cannot precede the node's own steps.** The slowdown began after the node's last step before
  the onset ended, so a `slowed_s` reaching further back than that step's record (sent when it ended) is
  cut to it, with a step's leeway for the agent's sending. Without that record (the onset is older than
  the kept steps), the report's own figures bound it: its steps since the onset at the level it reported.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from resilientjob.protocol.messages import IterationRecord, SlowReport

KEPT_STEPS = 64
"""Step records per node kept for the offset and the onset bound (an agent reports a few steps after the
onset; an older onset is bounded by the report's own figures)."""
MAX_DELIVERY_S = 5.0
"""The longest shortest delivery of a node's records that is still delivery, not a clock behind: the
operator reads the stream every 0.25 s, and the smallest of 64 delays beyond this is a skew."""


@dataclass(slots=True)
class NodeClocks:
    """Recent step records of every node: (step, `sent_at` on the agent's clock, arrival on the operator's,
    the step's wall)."""

    _kept: dict[int, deque[tuple[int, float, float, float]]] = field(default_factory=dict)

    def observe(self, record: IterationRecord, arrival: float) -> None:
        kept = self._kept.get(record.node)
        if kept is None:
            kept = self._kept[record.node] = deque(maxlen=KEPT_STEPS)
        kept.append((record.step, record.sent_at, arrival, record.seconds))

    def forget(self, node: int) -> None:
        self._kept.pop(node, None)

    def walls(self, node: int) -> list[tuple[int, float]]:
        """The node's kept steps as (step, wall seconds), oldest first."""
        return [(step, seconds) for step, _, _, seconds in self._kept.get(node, ())]

    def offset(self, node: int) -> float:
        """Seconds to add to the node's clock to read the operator's: 0 while the smallest delay of its
        records is one a delivery explains (or no record has come)."""
        kept = self._kept.get(node)
        if not kept:
            return 0.0
        shortest = min(arrival - sent for _, sent, arrival, _ in kept)
        return 0.0 if 0.0 <= shortest <= MAX_DELIVERY_S else shortest

    def lasted(self, report: SlowReport) -> float:
        """How long the slowdown had lasted when reported: `slowed_s` (or, from an agent that does not
        measure it, the steps since the onset at the reported level, all but the last: a level is the
        steps' median, and a step lasts at least its compute), bounded by the node's own steps."""
        estimate = max(0, report.step - report.onset_step) * report.level_s
        claimed = report.slowed_s or estimate
        before = [
            (step, sent, seconds)
            for step, sent, _, seconds in self._kept.get(report.node, ())
            if step < report.onset_step
        ]
        if before:
            _, sent, seconds = max(before)
            return max(0.0, min(claimed, report.detected_at - sent + seconds))
        return min(claimed, estimate)

    def onset(self, report: SlowReport) -> float:
        """When the report's slowdown began, on the operator's clock."""
        return report.detected_at - self.lasted(report) + self.offset(report.node)
