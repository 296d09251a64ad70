"""Drained slow nodes timed again by a validation pass when their recovery report does not come.

A node whose replica fail-slow S2 drained computes nothing the operator can weigh: the restore waits for its
agent's word, the recovery report of its probe (`agent._step_watch`). That word can fail to come: the node
recovered before its probe had a first level in the role (a few probes after the drain), or Redis lost the
report (restarted empty between the agent's send and the operator's read). The node would stay out of the
step for good, its share of the job's devices idle. It is still in the world, and a validation pass times its
device beside every other (Falcon's measure of a device's speed): `DrainedRevalidation` asks for a pass
`failSlow.drainedRecheckS` after a slow node was drained with no recovery since, then at doubling intervals
up to `LONGEST` times that, and a device timed within the recovered bar of the others' median is back.
Pure: the tracker (`_failslow`) holds one and the telemetry pass sends the request.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from statistics import median

LONGEST = 16
"""The longest interval between two passes for a node that stays slow, in first intervals: a pass holds
training for well under a second (0.3-0.5 s on the local stack's two cores), under 0.1% of the job's time
at the default's 16 minutes."""


@dataclass(slots=True)
class DrainedRevalidation:
    """When each drained slow node is due its next pass, and which nodes the outstanding pass is for."""

    first_s: float
    """Seconds after a drain before its first pass (`failSlow.drainedRecheckS`, 60 by default): well past the
    agent's own recovery report (a few probe steps after the probe's level falls), so a pass holds training
    only when that word is overdue."""
    asked: tuple[int, ...] = ()
    """The nodes of the pass sent and not answered yet (stored with the episode, `FailSlowTracker.state`, so
    a restarted operator reads that pass's result as theirs; the schedule is not stored: a restarted
    operator's next pass for them comes `first_s` after it starts)."""
    _due: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Node -> (when its next pass is due, the interval that led there)."""

    def __post_init__(self) -> None:
        if not self.first_s > 0:
            raise ValueError(f"first_s: must be > 0, got {self.first_s}")

    def due(self, drained: Iterable[int], now: float) -> list[int]:
        """The nodes of `drained` (the episode's slow nodes that S2 drained) due a pass at `now`. A node is
        first due `first_s` after the first call that names it; one no longer named is forgotten (taken
        back, or gone), and starts over if drained again."""
        nodes = set(drained)
        for node in [n for n in self._due if n not in nodes]:
            del self._due[node]
        for node in nodes:
            self._due.setdefault(node, (now + self.first_s, self.first_s))
        return sorted(node for node, (at, _) in self._due.items() if at <= now)

    def sent(self, nodes: Iterable[int], now: float) -> None:
        """A pass went out for `nodes`: each is due again after twice its last interval (at most `LONGEST`
        first intervals)."""
        self.asked = tuple(sorted(nodes))
        for node in self.asked:
            interval = min(2 * self._due.get(node, (now, self.first_s / 2))[1], LONGEST * self.first_s)
            self._due[node] = (now + interval, interval)

    def next_in(self, node: int, now: float) -> float | None:
        """Seconds until `node`'s next pass (None: not scheduled)."""
        found = self._due.get(node)
        return None if found is None else max(0.0, found[0] - now)

    def judge(self, gemm_s: Mapping[int, float], slow: Collection[int] = ()) -> dict[int, float | None]:
        """The asked nodes' GEMM time over the median of the other devices' in a pass's result, leaving out
        the `slow` ones where healthy ones remain (in a small world another slow device would drag the
        median up: a 2x device read 0.8x beside a 4x and a healthy one); None: the pass did not time it, or
        timed no other device. Clears `asked`."""
        nodes, self.asked = self.asked, ()
        ratios: dict[int, float | None] = {}
        for node in nodes:
            own = gemm_s.get(node)
            others = [seconds for other, seconds in gemm_s.items() if other != node]
            healthy = [seconds for other, seconds in gemm_s.items() if other != node and other not in slow]
            middle = median(healthy or others) if others else 0.0
            ratios[node] = own / middle if own is not None and own > 0 and middle > 0 else None
        return ratios
