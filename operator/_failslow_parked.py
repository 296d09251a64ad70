"""Parked slow nodes judged by their probe against the other nodes' when their recovery report does not come.

Fail-slow S4 parks a slow node: the job runs without it, and its agent times a probe product on the node's
device (`agent._parked`) and reports the recovery when the probe's level falls under its first. That word
can fail to come: the node recovered before its probe had a level of the slowdown (about four seconds after
the park: a settle, a warm-up and three probes; a throttled GPU that cools once idle does just that), or
Redis lost the report. A parked node is out of the world, so no validation pass can time it (the drained
node's second chance, `_failslow_revalidate`). What can: the nodes that train time the same product on
their own devices now and then (`IterationRecord.probe_s`, `agent._worker_probe.REFERENCE_EVERY_S`), so a
parked node's probe has something to be read against. `ParkedRecheck` keeps both; a parked slow device
with no recovery report `failSlow.parkedRecheckS` after its park whose probe level (the median of its last
`PROBES`) is within the recovered bar of the median of the other healthy nodes' latest references is back.

An idle device's probe cannot see a slowdown that only load brings (a GPU that throttles once it heats up
again): such a node would be taken back, named slow and parked again in a loop. Each time this check takes
a node back its next wait doubles (up to `LONGEST` first waits), so the loop costs a bounded share of the
job's time; a node that stays healthy `FORGET` first waits after it is forgiven.
Pure: the tracker (`_failslow`) holds one; the telemetry pass feeds it the records.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from statistics import median
from typing import Any

PROBES = 5
"""A parked node's latest probes whose median is its level (probe steps come every 0.2 s)."""
LONGEST = 16
"""The longest wait before a parked node is judged, in first waits (after four trips)."""
FORGET = 2 * LONGEST
"""First waits after a node's last trip when its trips are forgotten."""


@dataclass(frozen=True, slots=True)
class ProbeReading:
    """A parked node's probe level against the other nodes' references."""

    ratio: float
    level_s: float
    reference_s: float
    references: int
    """How many nodes' references the median was taken over."""


@dataclass(slots=True)
class ParkedRecheck:
    """Parked nodes' probes, the training nodes' references, and when each parked node may be judged."""

    first_s: float
    """Seconds after a park before its probe is judged (`failSlow.parkedRecheckS`, 60 by default): well past
    the agent's own recovery report, which comes within seconds of the level's fall."""
    trips: dict[int, tuple[int, float]] = field(default_factory=dict)
    """Node -> (how many times this check took it back, when last): stored with the episode
    (`FailSlowTracker.state`), so a restarted operator keeps the doubled waits."""
    _since: dict[int, float] = field(default_factory=dict)
    """Parked node -> when it was first seen parked (the wait counts from here; not stored: a restarted
    operator's wait starts over)."""
    _probes: dict[int, deque[float]] = field(default_factory=dict)
    _references: dict[int, float] = field(default_factory=dict)
    """Node -> its latest reference probe, while it trains."""

    def __post_init__(self) -> None:
        if not self.first_s > 0:
            raise ValueError(f"first_s: must be > 0, got {self.first_s}")

    def reference(self, node: int, seconds: float) -> None:
        """A training node's own timing of the probe product."""
        self._references[node] = seconds

    def probe(self, node: int, seconds: float) -> None:
        """A parked node's probe step."""
        self._probes.setdefault(node, deque(maxlen=PROBES)).append(seconds)

    def forget(self, node: int) -> None:
        """`node` failed: its reference is no speed of anything that trains."""
        self._references.pop(node, None)

    def wait_s(self, node: int, now: float) -> float:
        """How long `node` waits after a park before its probe is judged: `first_s`, doubled for each time
        this check took it back, unless that was `FORGET` first waits ago."""
        count, last = self.trips.get(node, (0, 0.0))
        if count and now - last > FORGET * self.first_s:
            del self.trips[node]
            count = 0
        return float(min(self.first_s * 2.0**count, LONGEST * self.first_s))

    def due(self, parked: Iterable[int], now: float) -> list[int]:
        """The nodes of `parked` (the episode's slow devices that S4 parked) whose wait is over at `now`. A
        node no longer parked is forgotten (taken back, or gone), and its wait starts over if parked again;
        so are its probes, which a new park's level must not mix with."""
        nodes = set(parked)
        for node in [n for n in self._since if n not in nodes]:
            del self._since[node]
            self._probes.pop(node, None)
        for node in nodes:
            self._since.setdefault(node, now)
        return sorted(node for node in nodes if now - self._since[node] >= self.wait_s(node, now))

    def parked_for(self, node: int, now: float) -> float:
        """Seconds since `node` was first seen parked (0 when it is not)."""
        since = self._since.get(node)
        return 0.0 if since is None else now - since

    def judge(self, node: int, slow: Collection[int] = ()) -> ProbeReading | None:
        """`node`'s probe level over the median of the other nodes' references, leaving out the `slow` ones
        (their devices are what the episode is about); None until it has `PROBES` probes or any other node
        a reference."""
        probes = self._probes.get(node)
        references = [s for other, s in self._references.items() if other != node and other not in slow]
        if probes is None or len(probes) < PROBES or not references:
            return None
        level, reference = median(probes), median(references)
        return ProbeReading(level / reference, level, reference, len(references))

    def taken_back(self, node: int, now: float) -> None:
        """This check took `node` back: its next park waits twice as long."""
        count, _ = self.trips.get(node, (0, 0.0))
        self.trips[node] = (count + 1, now)
        self._since.pop(node, None)
        self._probes.pop(node, None)

    def state(self) -> dict[str, list[float]]:
        return {str(node): [count, at] for node, (count, at) in sorted(self.trips.items())}

    def resume(self, raw: Mapping[str, Any] | None) -> None:
        """Continue from `state()` (None: a state from before this check existed)."""
        trips = {}
        for node, value in (raw or {}).items():
            count, at = value  # a malformed entry raises (ValueError, TypeError): the caller's restore fails
            trips[int(node)] = (int(count), float(at))
        self.trips = trips
