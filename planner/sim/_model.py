"""The simulator's vocabulary: policies, costs, events, scenarios and results.

Everything here validates on construction and raises `PlannerError` naming the field, so a bad CLI flag or a
bad trace line is reported as one line, never a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from ..errors import PlannerError
from ..plan import Policy
from ..spec import TransitionCosts


class SimPolicy(StrEnum):
    """Recovery policies as the simulator names them; each maps onto one planner policy."""

    ADAPTIVE = "adaptive"  # Odyssey: the planner's `auto` choice
    TEMPLATES = "templates"  # Oobleck: pipeline templates
    REROUTE = "reroute"  # ReCycle: reroute, checkpoint-restart once a stage lost every replica
    CHECKPOINT = "checkpoint"  # Varuna: checkpoint-restart with a new symmetric layout
    REDUNDANT = "redundant"  # Bamboo: the planner's `dynamic` layout plus redundant computation
    DYNAMIC = "dynamic"  # the planner's dynamic parallelism alone (an ablation of `adaptive`)

    @property
    def planner_policy(self) -> Policy:
        """The planner policy this simulator policy asks `replan` for."""
        return _PLANNER_POLICY[self]


_PLANNER_POLICY = {
    SimPolicy.ADAPTIVE: Policy.AUTO,
    SimPolicy.TEMPLATES: Policy.TEMPLATES,
    SimPolicy.REROUTE: Policy.REROUTE,
    SimPolicy.CHECKPOINT: Policy.CHECKPOINT,
    SimPolicy.REDUNDANT: Policy.DYNAMIC,
    SimPolicy.DYNAMIC: Policy.DYNAMIC,
}

# The policies `--policy all` runs: the papers' systems. `dynamic` is an ablation, asked for by name.
PAPER_POLICIES: tuple[SimPolicy, ...] = (
    SimPolicy.ADAPTIVE,
    SimPolicy.TEMPLATES,
    SimPolicy.REROUTE,
    SimPolicy.CHECKPOINT,
    SimPolicy.REDUNDANT,
)


def parse_policy(name: str) -> SimPolicy:
    """`adaptive`, `templates`, ... (also the planner's `auto` for `adaptive`)."""
    if name == Policy.AUTO.value:
        return SimPolicy.ADAPTIVE
    try:
        return SimPolicy(name)
    except ValueError:
        names = ", ".join(p.value for p in SimPolicy)
        message = f"unknown policy {name!r}; choose one of {names}, oracle or all"
        raise PlannerError("policy", message) from None


class SimCosts(BaseModel):
    """Costs the simulator charges on top of the planner's own estimates. Every one is a named parameter."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    transition: TransitionCosts = Field(
        default_factory=TransitionCosts,
        description="The planner's costs: restart, checkpoint load/save/interval and fail-stop detection "
        "latency. Passed to `replan` so its transition estimates and the simulator agree.",
    )
    planning_s: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="Planning time charged per replan. None charges the real planner's measured "
        "`plan.planning_s` (the first time a plan is computed; cached plans keep that measurement); a "
        "number, which also stands for the search in the planner's choice (`TransitionCosts.search_s`), "
        "makes runs bit-for-bit reproducible across processes.",
    )
    restart_policy_checkpoint_interval_s: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="Checkpoint interval of the `checkpoint` policy, whose every recovery restarts from one "
        "(Varuna checkpoints often). None uses Young's optimum sqrt(2 x save time x mean time between "
        "failures of the job). The other policies keep `transition.checkpoint_interval_s`: for them a "
        "checkpoint is the last resort.",
    )
    redundancy_overhead: float = Field(
        default=0.5,
        ge=0,
        allow_inf_nan=False,
        description="Bamboo's redundant computation while healthy, as a fraction of step time. Oobleck "
        "section 7.4.2 measures more than 50%.",
    )
    redundancy_memory_factor: float = Field(
        default=2.0,
        ge=1,
        allow_inf_nan=False,
        description="Bamboo holds a second copy of its neighbour's state: the planner plans it on devices "
        "with 1/factor of their memory.",
    )
    slow_detection_iterations: int | None = Field(
        default=None,
        ge=0,
        description="Iterations from a fail-slow's onset (or end) to its detection. None measures it with "
        "the real change-point detector (BOCD + verification) on jittered slowed iteration times.",
    )
    rebalance_s: float = Field(
        default=2.0, ge=0, allow_inf_nan=False, description="Falcon S2 (micro-batch redistribution) pause."
    )
    topology_s: float = Field(
        default=45.0,
        ge=0,
        allow_inf_nan=False,
        description="Falcon S3 (node swap through host memory) pause; Falcon section 5.3: within a minute.",
    )


class FailSlowKind(StrEnum):
    COMPUTE = "compute"  # a slow GPU or CPU contention: the node's stages run slower
    LINK = "link"  # a congested inter-node link at the node's NIC: its collectives run slower


@dataclass(frozen=True, slots=True)
class FailStop:
    """A node stops at `time_s` (a device failure takes its node down: the planner plans whole nodes)."""

    time_s: float
    node: int


@dataclass(frozen=True, slots=True)
class NodeChange:
    """A replayed availability change: the node goes `up` (joins) or down (leaves without warning)."""

    time_s: float
    node: int
    up: bool


@dataclass(frozen=True, slots=True)
class FailSlow:
    """A node (compute) or its link runs `severity` times slower from `time_s` for `duration_s`."""

    time_s: float
    node: int
    kind: FailSlowKind
    severity: float
    duration_s: float

    def __post_init__(self) -> None:
        if self.severity < 1:
            raise PlannerError("severity", f"a fail-slow is at least 1x slower, got {self.severity}")
        if self.duration_s <= 0:
            raise PlannerError("duration_s", f"must be positive, got {self.duration_s}")

    @property
    def end_s(self) -> float:
        return self.time_s + self.duration_s


@dataclass(frozen=True, slots=True)
class Recovery:
    """One reaction of the job: what happened, what the planner chose, what it cost."""

    time_s: float
    cause: str  # fail-stop, leave, join, slowdown, recovery, s2, s3, s4
    node: int
    policy: str  # the concrete plan policy (or mitigation step) applied
    layout: str
    pause_s: float  # zero-throughput time charged
    lost_samples: float  # work thrown away (partial iteration or roll-back to the checkpoint)
    throughput_after: float


@dataclass(slots=True)
class PolicyResult:
    """What one policy achieved in one run. `timeline` is piecewise constant: (start_s, samples/s, nodes)
    where nodes counts the nodes that are up (each with `gpus_per_node` devices)."""

    policy: SimPolicy
    hours: float
    gpus_per_node: int
    samples: float
    failure_free_throughput: float
    timeline: list[tuple[float, float, int]] = field(default_factory=list)
    recoveries: list[Recovery] = field(default_factory=list)
    replans: int = 0
    infeasible: str = ""  # why the policy could not run at all (e.g. out of memory), else empty
    label: str = ""  # the name to report under when it is not the policy's (the hindsight oracle)
    initial_layout: str = ""  # the planner's generation-0 layout, e.g. `DP8 PP[4,4,4,4,4,4,4,4]`

    @property
    def name(self) -> str:
        return self.label or self.policy.value

    @property
    def avg_throughput(self) -> float:
        return self.samples / (self.hours * 3600.0) if self.hours > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "avg_throughput": self.avg_throughput,
            "samples": self.samples,
            "failure_free_throughput": self.failure_free_throughput,
            "throughput_timeline": [[t, thr] for t, thr, _ in self.timeline],
            "active_nodes_timeline": [[t, nodes] for t, _, nodes in self.timeline],
            "active_devices_timeline": [[t, nodes * self.gpus_per_node] for t, _, nodes in self.timeline],
            "recoveries": [
                {
                    "time_s": r.time_s,
                    "cause": r.cause,
                    "node": r.node,
                    "policy": r.policy,
                    "layout": r.layout,
                    "pause_s": r.pause_s,
                    "lost_samples": r.lost_samples,
                    "throughput_after": r.throughput_after,
                }
                for r in self.recoveries
            ],
            "replans": self.replans,
            "initial_layout": self.initial_layout,
            "infeasible": self.infeasible,
        }
