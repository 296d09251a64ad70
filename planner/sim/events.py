"""Where the simulator's events come from: Poisson fail-stops, availability traces, Falcon-shaped fail-slows.

All randomness flows from one `numpy.random.Generator` seeded by the caller, so a seed fixes every event.

Availability traces are CSV files with lines `time_s,node,up|down` (an optional header line naming the
columns, `#` comments and blank lines are allowed). Every node of the cluster is up at time 0; a `down` takes
a node away without warning (a preemption), an `up` brings a node back.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..errors import PlannerError
from ._model import FailSlow, FailSlowKind, FailStop, NodeChange

TRACE_DIR = Path(__file__).parent / "traces"
SPOT_TRACE = TRACE_DIR / "spot.csv"

# Falcon section 3 (Table 1, Fig. 1): computation fail-slows last about 10 minutes on average, network
# congestion about 24 minutes; durations range from tens of seconds to hours; network congestion is far more
# frequent (42 of 43 slow multi-node jobs). Severities: a GPU 20% slower (Case-2), a 21.6% throughput drop
# from CPU contention (Case-1), 0.57 -> 0.41 iterations/s from congestion and up to 80% drops at scale.
FALCON_LINK_SHARE = 0.75
FALCON_MEAN_DURATION_S = {FailSlowKind.COMPUTE: 600.0, FailSlowKind.LINK: 1440.0}
FALCON_MEAN_EXTRA_SLOWDOWN = {FailSlowKind.COMPUTE: 0.3, FailSlowKind.LINK: 0.6}
_DURATION_SIGMA = 1.0  # log-normal spread: the CDF spans two to three decades like Falcon's Fig. 1 (right)
_MIN_DURATION_S = 30.0
_MAX_DURATION_S = 10 * 3600.0
_MAX_SEVERITY = 6.0


def poisson_failures(
    rng: np.random.Generator, nodes: int, gpus_per_node: int, rate_per_device_hour: float, horizon_s: float
) -> list[FailStop]:
    """First-failure times of every node when each device fails at `rate_per_device_hour` (no repair).

    A node fails when the first of its devices does, so its failure time is exponential with rate G * r.
    Node ids are 0..nodes-1; the result is sorted by time and only failures before `horizon_s` are kept.
    """
    if rate_per_device_hour < 0 or not math.isfinite(rate_per_device_hour):
        raise PlannerError(
            "failure_rate", f"must be a finite rate >= 0 per device per hour, got {rate_per_device_hour}"
        )
    if rate_per_device_hour == 0:
        return []
    per_node_s = rate_per_device_hour * gpus_per_node / 3600.0
    times = rng.exponential(1.0 / per_node_s, size=nodes)
    order = np.argsort(times, kind="stable")
    return [FailStop(float(times[i]), int(i)) for i in order if times[i] < horizon_s]


def every_interval_failures(
    rng: np.random.Generator, nodes: int, interval_s: float, until_alive: int
) -> list[FailStop]:
    """Oobleck section 7.2: one failure every `interval_s` on average (exponential gaps), a random alive node
    each time, until `until_alive` nodes remain."""
    if interval_s <= 0:
        raise PlannerError("interval", f"must be positive, got {interval_s}")
    alive = list(range(nodes))
    events: list[FailStop] = []
    clock = 0.0
    while len(alive) > until_alive:
        clock += float(rng.exponential(interval_s))
        node = alive.pop(int(rng.integers(len(alive))))
        events.append(FailStop(clock, node))
    return events


def falcon_failslows(
    rng: np.random.Generator, nodes: int, rate_per_node_hour: float, horizon_s: float
) -> list[FailSlow]:
    """Fail-slows at `rate_per_node_hour` per node, with Falcon-shaped kind, duration and severity."""
    if rate_per_node_hour < 0 or not math.isfinite(rate_per_node_hour):
        raise PlannerError("failslow_rate", f"must be a finite rate >= 0, got {rate_per_node_hour}")
    count = int(rng.poisson(rate_per_node_hour * nodes * horizon_s / 3600.0))
    events = [
        _draw_failslow(rng, float(rng.uniform(0, horizon_s)), int(rng.integers(nodes))) for _ in range(count)
    ]
    return sorted(events, key=lambda e: (e.time_s, e.node))


def _draw_failslow(rng: np.random.Generator, time_s: float, node: int) -> FailSlow:
    kind = FailSlowKind.LINK if rng.random() < FALCON_LINK_SHARE else FailSlowKind.COMPUTE
    # A log-normal with the paper's mean: mu = ln(mean) - sigma^2 / 2.
    mu = math.log(FALCON_MEAN_DURATION_S[kind]) - _DURATION_SIGMA**2 / 2
    duration = float(np.clip(rng.lognormal(mu, _DURATION_SIGMA), _MIN_DURATION_S, _MAX_DURATION_S))
    extra = float(rng.exponential(FALCON_MEAN_EXTRA_SLOWDOWN[kind]))
    severity = min(1.1 + extra, _MAX_SEVERITY)
    return FailSlow(time_s, node, kind, severity, duration)


def parse_trace(lines: Iterable[str], nodes: int, source: str = "trace") -> list[NodeChange]:
    """Parse `time_s,node,up|down` lines; errors name the line. Node ids must lie in 0..nodes-1."""
    changes: list[NodeChange] = []
    for number, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = [part.strip() for part in line.split(",")]
        if number == 1 and parts and parts[0].lower() in {"time_s", "time"}:
            continue  # header
        where = f"{source} line {number}"
        if len(parts) != 3:
            raise PlannerError(where, f"expected time_s,node,up|down, got {line!r}")
        try:
            time_s = float(parts[0])
        except ValueError:
            raise PlannerError(where, f"time_s must be a number, got {parts[0]!r}") from None
        if not math.isfinite(time_s) or time_s < 0:
            raise PlannerError(where, f"time_s must be finite and >= 0, got {parts[0]!r}")
        try:
            node = int(parts[1])
        except ValueError:
            raise PlannerError(where, f"node must be an integer, got {parts[1]!r}") from None
        if not 0 <= node < nodes:
            raise PlannerError(where, f"node {node} is outside the cluster's nodes 0..{nodes - 1}")
        state = parts[2].lower()
        if state not in {"up", "down"}:
            raise PlannerError(where, f"state must be up or down, got {parts[2]!r}")
        changes.append(NodeChange(time_s, node, state == "up"))
    return sorted(changes, key=lambda c: c.time_s)


def load_trace(path: str | Path, nodes: int) -> list[NodeChange]:
    """Read an availability trace file (or `spot` for the shipped synthetic spot trace)."""
    target = SPOT_TRACE if str(path) == "spot" else Path(path)
    try:
        text = target.read_text()
    except OSError as exc:
        raise PlannerError("trace", f"cannot read {str(path)!r}: {exc.strerror}") from None
    return parse_trace(text.splitlines(), nodes, source="trace")


def trace_nodes(path: str | Path) -> int:
    """How many nodes a trace mentions (highest id + 1): the cluster size it was written for."""
    target = SPOT_TRACE if str(path) == "spot" else Path(path)
    try:
        text = target.read_text()
    except OSError as exc:
        raise PlannerError("trace", f"cannot read {str(path)!r}: {exc.strerror}") from None
    changes = parse_trace(text.splitlines(), nodes=2**31, source="trace")
    return max((c.node for c in changes), default=-1) + 1
