"""Parked slow nodes judged by their probe against the other nodes' when their recovery report does not come.

Fail-slow S4 parks a slow node: the job runs without it, and its agent times a probe product on the node's
device (`agent._parked`) and reports the recovery when the probe's level falls under its first. That word
can fail to come: the node recovered before its probe had a level of the slowdown (about four seconds after
the park: a settle, a warm-up and three probes; a throttled GPU that cools once idle does just that), or
Redis lost the report. A parked node is out of the world, so no validation pass can time it (the drained
node's second chance, `_failslow_revalidate`). What can: the nodes that train time the same product on
their own devices now and then (`IterationRecord.probe_s`, `agent._worker_probe.REFERENCE_EVERY_S`), so a
parked node's probe has something to be read against. `ParkedRecheck` keeps both; a parked slow device
with no recovery report `failSlow.parkedRecheckS` after its park is read window by window (the median of
`PROBES` probes, against the median over the other healthy training nodes of each one's last
`REFERENCES`), and is back once `AGREE` windows in a row read within the recovered bar: one window's
median drifts on a loaded host (a healthy node read 1.31x, then 1.19x a second later, on two cores), and a
node still slowed just over the threshold must not pass on one lucky window.

An idle device's probe cannot see a slowdown that only load brings (a GPU that throttles once it heats up
again): such a node would be taken back, named slow and parked again in a loop. Each time this check takes
a node back its next wait doubles (up to `LONGEST` first waits), so the loop costs a bounded share of the
job's time; a node that stays healthy `FORGET` first waits after it is forgiven.
Pure: the tracker (`_failslow`) holds one; the telemetry pass feeds it the records.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from statistics import median
from typing import Any

PROBES = 5
"""Probes per window: a window's median is the parked node's level (probe steps come every 0.2 s)."""
AGREE = 3
"""Windows in a row within the bar that take a parked node back (three seconds of probes)."""
REFERENCES = 3
"""A training node's latest references whose median is its own (one every 30 s)."""
LONGEST = 16
"""The longest wait before a parked node is judged, in first waits (after four trips)."""
FORGET = 2 * LONGEST
"""First waits after a node's last trip when its trips are forgotten."""
MAX_TRIPS = 64
"""The most trips a stored state may say (more is not a state this check writes in a job's life)."""
SHORTEST_S = 1e-7
"""A probe or reference under this is no timing (a product takes microseconds at the least)."""


@dataclass(frozen=True, slots=True)
class ProbeReading:
    """A window of a parked node's probes against the other nodes' references."""

    ratio: float
    level_s: float
    reference_s: float
    references: int
    """How many nodes' references the median was taken over."""
    back: bool
    """Whether this window was the `AGREE`-th in a row within the bar."""


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
    """Each node's probes since its last window was judged (windows do not overlap)."""
    _below: dict[int, int] = field(default_factory=dict)
    """Each parked node's windows in a row within the bar."""
    _references: dict[int, deque[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.first_s > 0:
            raise ValueError(f"first_s: must be > 0, got {self.first_s}")

    def reference(self, node: int, seconds: float) -> None:
        """A training node's own timing of the probe product."""
        if math.isfinite(seconds) and seconds >= SHORTEST_S:
            self._references.setdefault(node, deque(maxlen=REFERENCES)).append(seconds)

    def probe(self, node: int, seconds: float) -> None:
        """A parked node's probe step."""
        if math.isfinite(seconds) and seconds >= SHORTEST_S:
            self._probes.setdefault(node, deque(maxlen=PROBES)).append(seconds)

    def forget(self, node: int) -> None:
        """`node` failed: its reference is no speed of anything that trains, and it parks no more."""
        self._references.pop(node, None)
        self.trips.pop(node, None)

    def wait_s(self, node: int, now: float) -> float:
        """How long `node` waits after a park before its probe is judged: `first_s`, doubled for each time
        this check took it back, unless that was `FORGET` first waits ago."""
        count, last = self.trips.get(node, (0, 0.0))
        if count and now - last > FORGET * self.first_s:
            del self.trips[node]
            count = 0
        return float(self.first_s * 2.0 ** min(count, int(math.log2(LONGEST))))

    def due(self, parked: Iterable[int], now: float) -> list[int]:
        """The nodes of `parked` (the episode's slow devices that S4 parked) whose wait is over at `now`. A
        node no longer parked is forgotten (taken back, or gone), and its wait starts over if parked again,
        as do its probes: those of a node that was out of the plan meanwhile (back on its word while
        another node held the episode open) are not the new park's."""
        nodes = set(parked)
        for node in [n for n in self._since if n not in nodes]:
            del self._since[node]
        for node in nodes:
            if node not in self._since:
                self._since[node] = now
                self._probes.pop(node, None)
                self._below.pop(node, None)
        for node in [n for n, (_, last) in self.trips.items() if now - last > FORGET * self.first_s]:
            del self.trips[node]
        return sorted(node for node in nodes if now - self._since[node] >= self.wait_s(node, now))

    def parked_for(self, node: int, now: float) -> float:
        """Seconds since `node` was first seen parked (0 when it is not)."""
        since = self._since.get(node)
        return 0.0 if since is None else now - since

    def judge(
        self, node: int, bar: float, slow: Collection[int] = (), among: Collection[int] | None = None
    ) -> ProbeReading | None:
        """`node`'s newest full window of probes over the median of the other nodes' references, leaving out
        the `slow` ones (their devices are what the episode is about) and, given `among`, the nodes outside
        it (no longer training: their references are old); None until a window is full or while no other
        node has a reference. A judged window is done with: the next is the next `PROBES` probes."""
        window = self._probes.get(node)
        references = [
            median(timed)
            for other, timed in self._references.items()
            if other != node and other not in slow and (among is None or other in among)
        ]
        if window is None or len(window) < PROBES or not references:
            return None
        level, reference = median(window), median(references)
        window.clear()
        ratio = level / reference
        below = self._below.get(node, 0) + 1 if ratio <= bar else 0
        self._below[node] = below
        return ProbeReading(ratio, level, reference, len(references), back=below >= AGREE)

    def taken_back(self, node: int, now: float) -> None:
        """This check took `node` back: its next park waits twice as long."""
        count, _ = self.trips.get(node, (0, 0.0))
        self.trips[node] = (min(count + 1, MAX_TRIPS), now)
        self._since.pop(node, None)
        self._probes.pop(node, None)
        self._below.pop(node, None)

    def state(self) -> dict[str, list[float]]:
        return {str(node): [count, at] for node, (count, at) in sorted(self.trips.items())}

    def resume(self, raw: Any) -> None:
        """Continue from `state()` (None: a state from before this check existed). What Redis gave back is
        checked: a malformed entry raises ValueError or TypeError, and the caller's restore fails."""
        if raw is None:
            self.trips = {}
            return
        if not isinstance(raw, Mapping):
            raise TypeError(f"parked_trips: expected a mapping, got {type(raw).__name__}")
        trips = {}
        for node, value in raw.items():
            if not isinstance(value, list) or len(value) != 2:
                raise ValueError(f"parked_trips[{node!r}]: expected [count, at], got {value!r}")
            count, at = value
            if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_TRIPS:
                raise ValueError(f"parked_trips[{node!r}]: count must be an integer in [0, {MAX_TRIPS}]")
            if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
                raise ValueError(f"parked_trips[{node!r}]: at must be a finite number, got {at!r}")
            trips[int(node)] = (count, float(at))
        self.trips = trips
