"""Event-driven cluster simulator driving the same planner, detector and mitigation code as the operator.

A `Scenario` fixes the cluster, the model, the job and every event (fail-stops, availability changes,
fail-slows) up front from one seed; `simulate(scenario, policy)` replays it for one recovery policy, calling
the planner's `initial_plan` and `replan` (`resilientjob.planner.search`) at every change, and reports the
samples trained, the throughput and active-node timelines and every recovery. `suite` builds the papers'
scenarios and writes `docs/results.md`; `plot` (matplotlib, imported lazily) draws them.
"""

from ._model import (
    PAPER_POLICIES,
    FailSlow,
    FailSlowKind,
    FailStop,
    NodeChange,
    PolicyResult,
    Recovery,
    SimCosts,
    SimPolicy,
    parse_policy,
)
from ._planner import CachedPlanner, Planner, default_planner
from .engine import ORACLE, PlannerPool, Scenario, simulate
from .events import (
    SPOT_TRACE,
    every_interval_failures,
    falcon_failslows,
    load_trace,
    parse_trace,
    poisson_failures,
)

__all__ = [
    "ORACLE",
    "PAPER_POLICIES",
    "SPOT_TRACE",
    "CachedPlanner",
    "FailSlow",
    "FailSlowKind",
    "FailStop",
    "NodeChange",
    "Planner",
    "PlannerPool",
    "PolicyResult",
    "Recovery",
    "Scenario",
    "SimCosts",
    "SimPolicy",
    "default_planner",
    "every_interval_failures",
    "falcon_failslows",
    "load_trace",
    "parse_policy",
    "parse_trace",
    "poisson_failures",
    "simulate",
]
