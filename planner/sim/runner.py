"""Build scenarios from user-facing parameters and run several policies and seeds over them.

`random_scenario` is what `rjob simulate` runs: Poisson fail-stops per device, optionally an availability
trace and Falcon-shaped fail-slows, all drawn from one seed. `run_policies` replays one scenario for every
policy with a shared plan cache, and `summarise` turns many seeds into means and spreads.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import PlannerError
from ..profile import ModelProfile
from ..spec import ClusterSpec, JobSpec
from ._model import PAPER_POLICIES, PolicyResult, SimCosts, SimPolicy, parse_policy
from .engine import ORACLE, PlannerPool, Scenario, simulate
from .events import falcon_failslows, load_trace, poisson_failures


def random_scenario(
    profile: ModelProfile,
    cluster: ClusterSpec,
    job: JobSpec,
    *,
    hours: float,
    failure_rate: float,
    seed: int,
    trace: str | Path | None = None,
    failslow_rate: float = 0.0,
    mitigation: bool = False,
    costs: SimCosts | None = None,
) -> Scenario:
    """Fail-stops at `failure_rate` per device per hour (no repair), an optional availability trace and
    fail-slows at `failslow_rate` per node per hour, all from `seed`."""
    if not math.isfinite(hours) or hours <= 0:
        raise PlannerError("hours", f"must be positive, got {hours}")
    if seed < 0:
        raise PlannerError("seed", f"must be >= 0, got {seed}")
    rng = np.random.default_rng(seed)
    horizon = hours * 3600.0
    stops = poisson_failures(rng, cluster.nodes, cluster.gpus_per_node, failure_rate, horizon)
    changes = load_trace(trace, cluster.nodes) if trace is not None else []
    slows = falcon_failslows(rng, cluster.nodes, failslow_rate, horizon) if failslow_rate > 0 else []
    per_node = failure_rate * cluster.gpus_per_node
    if changes:
        # The adaptive planner is told the observed rate: the trace's departures per node-hour.
        downs = sum(1 for change in changes if not change.up)
        per_node += downs / (cluster.nodes * hours)
    return Scenario(
        profile=profile,
        cluster=cluster,
        job=job,
        hours=hours,
        fail_stops=tuple(stops),
        changes=tuple(change for change in changes if change.time_s < horizon),
        failslows=tuple(slows),
        failure_rate_per_node_hour=max(per_node, 1e-6),
        costs=costs or SimCosts(),
        mitigation=mitigation,
    )


def run_policies(
    scenario: Scenario, policies: Sequence[SimPolicy | str], pool: PlannerPool | None = None
) -> dict[str, PolicyResult]:
    """Every policy through the same scenario (same events), sharing one plan cache."""
    shared = pool or PlannerPool()
    results: dict[str, PolicyResult] = {}
    for policy in policies:
        result = simulate(scenario, policy, shared)
        results[result.name] = result
    return results


@dataclass(frozen=True, slots=True)
class Spread:
    """Mean, sample standard deviation, minimum and maximum over seeds."""

    mean: float
    std: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise PlannerError("seeds", "need at least one run to summarise")
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        return cls(statistics.fmean(values), std, min(values), max(values), len(values))

    def text(self, digits: int = 3) -> str:
        return f"{self.mean:.{digits}f} ± {self.std:.{digits}f}"


def summarise(runs: Sequence[dict[str, PolicyResult]]) -> dict[str, Spread]:
    """Average throughput per policy over many seeds' runs."""
    names = list(runs[0]) if runs else []
    return {name: Spread.of([run[name].avg_throughput for run in runs]) for name in names}


def ratios(runs: Sequence[dict[str, PolicyResult]], numerator: str, denominator: str) -> Spread:
    """Per-seed ratio of two policies' average throughputs (seeds where the denominator ran at all)."""
    values = [
        run[numerator].avg_throughput / run[denominator].avg_throughput
        for run in runs
        if run[denominator].avg_throughput > 0
    ]
    return Spread.of(values) if values else Spread(math.inf, 0.0, math.inf, math.inf, 0)


def all_policies(names: str) -> list[SimPolicy | str]:
    """`all` or a comma-separated list; `oracle` is allowed by name."""
    if names == "all":
        return list(PAPER_POLICIES)
    chosen: list[SimPolicy | str] = []
    for name in (part.strip() for part in names.split(",") if part.strip()):
        chosen.append(ORACLE if name == ORACLE else parse_policy(name))
    if not chosen:
        raise PlannerError("policy", "name at least one policy, or all")
    return chosen
