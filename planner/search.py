"""Plan search: the planner's one entry point for the operator, the simulator and the fail-slow code.

`initial_plan` lays out a fresh job over every node. `replan` answers a change (nodes failed or joined) the
way Odyssey does (section III, IV-A): it builds one candidate per recovery policy

- `reroute` (ReCycle): keep the layout; peers run the failed stages' micro-batches (`_reroute`);
- `dynamic` (Odyssey Algorithm 1): a new, possibly asymmetric DP x PP layout over every alive node
  (`_dynamic`), placed on the nodes with the fewest bytes moved (`restorer.place_plan`);
- `templates` (Oobleck): pipeline templates instantiated or reinstantiated (`templates`);
- `checkpoint` (Varuna): a symmetric layout restarted from the last checkpoint;

estimates each one's step time and transition time (measured search time + detection + weight transfer
bounded by the busiest sender or receiver + restart; reroute restarts nothing; checkpoint reloads and redoes
the work since the last checkpoint written, given as a `CheckpointState`: all the work when none was, no
candidate when none was and the job writes none; half an interval when no state is given, the simulator's
expected loss) and scores it by eq. 8: throughput x effective-time ratio, where the time between failures is
`1 / (failure rate per node-hour x alive nodes)` and the ratio is the share of it left after the transition.

`auto` takes the best score among reroute, dynamic, templates and checkpoint. Fault tolerance is a
constraint of every `auto` candidate: each keeps f + 1 replicas of every layer while the alive nodes can
hold f + 1 pipelines (a reroute or template plan that leaves fewer is infeasible, the checkpoint layout has
at least f + 1 pipelines), and otherwise as many as fit, saying why in its reason.
The dynamic candidate also weighs the checkpoint candidate's symmetric layouts (which may idle nodes), and on
up to `EXHAUSTIVE_NODES` alive nodes every partition, so its layout is never slower than another
candidate's on the same nodes. A named policy is used as asked (its reason notes replicas it gives up). When
the asked policy cannot run (above all when some layer lost every replica) the plan falls back to
`checkpoint` and the candidates say why.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._dynamic import DynamicSearch, Layout, all_degrees, degree_window
from ._reroute import lost_layers, reroute
from ._search_shapes import clear_shape_tables
from .errors import PlannerError
from .estimator import _simulate_1f1b
from .plan import Candidate, Plan, Policy
from .profile import ModelProfile
from .restorer import place_plan, relabel, transfer_time
from .spec import CheckpointState, ClusterSpec, JobSpec, TransitionCosts

if TYPE_CHECKING:
    from .templates import TemplateSet

DP_WINDOW = 1  # Odyssey: the new DP degree rarely differs from the current one by more than one
REPLAN_SPREAD = 2  # pipeline depths within a replanned layout differ by at most this
INITIAL_SPREAD = 1  # the initial layout tries every DP degree, so it keeps pipelines nearly equal
EXHAUSTIVE_NODES = 16  # up to this many alive nodes a replan tries every partition (p(16) = 231 of them)
INITIAL_ALTERNATIVES = 5  # runner-up layouts listed as candidates of an initial plan
# What `auto` weighs: Odyssey's two recoveries, Oobleck's template (re-)instantiation and the checkpoint
# restart. Templates are generated once per job (`warm_up` does it ahead of failures).
AUTO_POLICIES = (Policy.REROUTE, Policy.DYNAMIC, Policy.TEMPLATES, Policy.CHECKPOINT)
# Above this many nodes `auto` does not generate templates at failure time (with their time curves that
# takes seconds at 1,024 nodes: 14.7 s on the loaded development machine, docs/benchmarks/templates.md): the
# candidate waits for `warm_up` to have made them.
TEMPLATES_ON_DEMAND_NODES = 128


# ---- templates (Oobleck), generated once per (profile, cluster, f) -----------------------------------------
_TEMPLATE_CACHE: OrderedDict[tuple[str, str, int], TemplateSet] = OrderedDict()
_TEMPLATE_CACHE_SIZE = 8


def _template_set(profile: ModelProfile, cluster: ClusterSpec, fault_tolerance: int) -> TemplateSet:
    """The TemplateSet for this model and cluster; generated on first use (Oobleck plans offline) and kept."""
    from .templates import generate_templates

    key = (profile.model_dump_json(), cluster.model_dump_json(), fault_tolerance)
    found = _TEMPLATE_CACHE.get(key)
    if found is None:
        found = generate_templates(profile, cluster, fault_tolerance)
        _TEMPLATE_CACHE[key] = found
        while len(_TEMPLATE_CACHE) > _TEMPLATE_CACHE_SIZE:
            _TEMPLATE_CACHE.popitem(last=False)
    else:
        _TEMPLATE_CACHE.move_to_end(key)
    return found


def prepare_templates(profile: ModelProfile, cluster: ClusterSpec, job: JobSpec) -> bool:
    """Generate and cache the job's pipeline templates ahead of failures; False if templates cannot be made
    for this job (the `templates` candidate then reports why)."""
    try:
        _template_set(profile, cluster, job.fault_tolerance)
    except (PlannerError, ImportError):
        return False
    return True


# ---- scoring (Odyssey eq. 8) -------------------------------------------------------------------------------
def mean_time_between_failures(failure_rate_per_node_hour: float, nodes: int) -> float:
    """Expected seconds until the next failure among `nodes` nodes; infinite at rate 0."""
    if failure_rate_per_node_hour == 0 or nodes == 0:
        return math.inf
    return 3600.0 / (failure_rate_per_node_hour * nodes)


def score(global_batch: int, step_time_s: float, transition_s: float, between_failures_s: float) -> float:
    """Eq. 8: samples/s after the change times the effective-time ratio. The time between two failures is
    fixed by the failure rate, so the ratio is the part of it not spent in transition (0 if it all is)."""
    if step_time_s <= 0:
        return 0.0
    throughput = global_batch / step_time_s
    if math.isinf(between_failures_s):
        return throughput
    ratio = max(0.0, between_failures_s - transition_s) / between_failures_s
    return throughput * ratio


@dataclass(frozen=True, slots=True)
class _Option:
    """One candidate of a replan: a plan with its transition, or the reason there is none."""

    policy: Policy
    plan: Plan | None
    search_s: float
    transition_s: float
    reason: str

    def candidate(self, global_batch: int, between_failures_s: float) -> Candidate:
        if self.plan is None:
            return Candidate(
                policy=self.policy,
                layout="-",
                step_time_s=0.0,
                transition_s=0.0,
                score=0.0,
                feasible=False,
                reason=self.reason,
            )
        return Candidate(
            policy=self.policy,
            layout=self.plan.layout,
            step_time_s=self.plan.step_time_s,
            transition_s=self.transition_s,
            score=score(global_batch, self.plan.step_time_s, self.transition_s, between_failures_s),
            reason=self.reason,
        )


# ---- validation --------------------------------------------------------------------------------------------
def _check_job(cluster: ClusterSpec, job: JobSpec) -> None:
    f = job.fault_tolerance
    if f >= cluster.nodes:
        raise PlannerError(
            "fault_tolerance",
            f"{f} simultaneous failures cannot be survived with {cluster.nodes} nodes; "
            f"need at least {f + 1} (f + 1) nodes",
        )
    if job.num_microbatches < f + 1:
        raise PlannerError(
            "global_batch",
            f"{job.global_batch} samples make {job.num_microbatches} micro-batches, fewer than the f + 1 = "
            f"{f + 1} pipelines needed to survive {f} failures; the nearest that can is "
            f"{(f + 1) * job.microbatch_size}",
        )


def _no_layout(search: DynamicSearch, nodes: int, what: str) -> PlannerError:
    """Say which knob makes every layout impossible."""
    layers = search.profile.num_layers
    if all(search.table.split(depth) is None for depth in range(1, min(nodes, layers) + 1)):
        need = max(
            (search.table.stage_memory(layer, layer + 1, 0, 1) for layer in range(layers)), default=0.0
        )
        return PlannerError(
            "device_memory_bytes",
            f"the model does not fit on {nodes} nodes of {search.cluster.gpus_per_node} GPU(s) with "
            f"{search.cluster.device_memory_bytes} bytes each (one layer alone needs up to {int(need)})",
        )
    if search.job.pp_range is not None or search.job.dp_range is not None:
        return PlannerError("pp_range", f"no DP x PP layout of {what} fits the job's dp_range/pp_range")
    return PlannerError(
        "fault_tolerance",
        f"{what} cannot hold f + 1 = {search.job.fault_tolerance + 1} pipelines that each fit in memory",
    )


# ---- initial plan ------------------------------------------------------------------------------------------
def initial_plan(
    profile: ModelProfile,
    cluster: ClusterSpec,
    job: JobSpec,
    *,
    policy: Policy = Policy.AUTO,
    costs: TransitionCosts = TransitionCosts(),  # noqa: B008 - frozen model, safe as a default
) -> Plan:
    """Generation 0 over the nodes of `cluster` (node ids 0..nodes-1): every one of them, unless no layout
    that uses them all fits; then identical pipelines with some nodes idle (the highest ids).

    `templates` instantiates Oobleck templates; every other policy runs Algorithm 1 over every DP degree
    (at least f + 1 pipelines so any f failures leave a replica of every layer). `reroute` and `checkpoint`
    prefer a symmetric layout when one uses every node, since their recoveries (eq. 13, Varuna) assume it.
    """
    del costs  # nothing transitions into generation 0
    started = time.perf_counter()
    _check_job(cluster, job)
    policy = Policy(policy)
    nodes = cluster.nodes
    if policy is Policy.TEMPLATES:
        from .templates import instantiate

        templates = _template_set(profile, cluster, job.fault_tolerance)
        plan = instantiate(templates, list(range(nodes)), profile, cluster, job)
        return plan.model_copy(update={"generation": 0, "planning_s": time.perf_counter() - started})

    search = DynamicSearch(profile, cluster, job, nodes)
    degrees = all_degrees(nodes, job, minimum=job.fault_tolerance + 1)
    layouts = search.search(degrees, INITIAL_SPREAD, keep=INITIAL_ALTERNATIVES)
    if not layouts:
        # No layout fits that uses every node (more nodes than layers, or depths memory rules out):
        # identical pipelines with some nodes idle, as a replan would take.
        layouts = search.symmetric(keep=INITIAL_ALTERNATIVES, minimum=job.fault_tolerance + 1)
    if not layouts:
        raise _no_layout(search, nodes, f"{nodes} nodes")
    chosen = layouts[0]
    label = Policy.DYNAMIC
    if policy in (Policy.REROUTE, Policy.CHECKPOINT):
        symmetric = search.search(degrees, 0, keep=1)
        if symmetric:
            chosen = symmetric[0]
        label = Policy.CHECKPOINT if policy is Policy.CHECKPOINT else Policy.DYNAMIC
    plan = chosen.to_plan(profile, cluster, job, label)
    # Fill the split of every depth now, before training starts, so that a replan at failure time (with a
    # node or two fewer, or a checkpoint layout of any depth) finds them ready.
    for depth in range(1, min(nodes, profile.num_layers) + 1):
        search.table.split(depth)
    if policy is Policy.AUTO and nodes <= TEMPLATES_ON_DEMAND_NODES:
        prepare_templates(profile, cluster, job)  # Oobleck plans offline: `auto`'s templates candidate
    alternatives = [chosen, *(layout for layout in layouts if layout is not chosen)][:INITIAL_ALTERNATIVES]
    candidates = tuple(
        Candidate(
            policy=label,
            layout=layout.describe(),
            step_time_s=layout.step_time_s,
            transition_s=0.0,
            score=score(job.global_batch, layout.step_time_s, 0.0, math.inf),
        )
        for layout in alternatives
    )
    return plan.model_copy(
        update={"generation": 0, "candidates": candidates, "planning_s": time.perf_counter() - started}
    )


# ---- replanning --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Change:
    """A validated change to the current plan."""

    alive: tuple[int, ...]  # every node that can run a stage now, sorted
    failed_now: tuple[int, ...]
    joined: tuple[int, ...]
    failed_all: frozenset[int]
    holdings: dict[int, set[int]]  # layers each alive node holds (empty for joined and idle nodes)
    lost: tuple[int, ...]  # layers no alive node holds
    emptied: frozenset[int] = frozenset()  # alive nodes whose layers are not to be trusted (`replan`)


def _change(
    current: Plan,
    profile: ModelProfile,
    cluster: ClusterSpec,
    failed: Collection[int],
    joined: Collection[int],
    emptied: Collection[int] = (),
    standby: Collection[int] | None = None,
) -> _Change:
    if profile.num_layers != current.num_layers:
        raise PlannerError(
            "profile", f"has {profile.num_layers} layers but the current plan covers {current.num_layers}"
        )
    failed_set, joined_set = set(failed), set(joined)
    both = failed_set & joined_set
    if both:
        raise PlannerError("joined", f"node {min(both)} is listed as both failed and joined")
    previously_failed = set(current.failed_nodes)
    running = set(current.nodes)
    # Alive before the change: the nodes the plan runs on and the idle ones (`standby`; None: every node of
    # the initial cluster), minus earlier failures.
    idle = set(range(cluster.nodes)) if standby is None else set(standby)
    before = (idle | running) - previously_failed
    for node in sorted(failed_set):
        if node not in before:
            state = "already failed" if node in previously_failed else "not a node of the cluster"
            raise PlannerError("failed", f"node {node} is {state} (alive nodes: {_ranges(before)})")
    for node in sorted(joined_set):
        if node < 0:
            raise PlannerError("joined", f"node ids are >= 0, got {node}")
        if node in running:
            raise PlannerError("joined", f"node {node} already runs a stage of the current plan")
    failed_all = (previously_failed - joined_set) | failed_set
    alive = tuple(sorted((before | joined_set) - failed_set))
    if not alive:
        raise PlannerError("failed", "no node survives; the job cannot continue")
    emptied_set = set(emptied) & set(alive)
    held = current.layers_by_node()
    holdings = {node: set() if node in emptied_set else set(held.get(node, ())) for node in alive}
    lost = tuple(lost_layers(current, failed_all | failed_set | emptied_set))
    return _Change(
        alive=alive,
        failed_now=tuple(sorted(failed_set)),
        joined=tuple(sorted(joined_set)),
        failed_all=frozenset(failed_all),
        holdings=holdings,
        lost=lost,
        emptied=frozenset(emptied_set),
    )


def _ranges(nodes: Collection[int]) -> str:
    ordered = sorted(nodes)
    if not ordered:
        return "none"
    parts, start, previous = [], ordered[0], ordered[0]
    for node in [*ordered[1:], None]:
        if node is not None and node == previous + 1:
            previous = node
            continue
        parts.append(str(start) if start == previous else f"{start}..{previous}")
        if node is not None:
            start = previous = node
    return ",".join(parts)


def _lost_reason(lost: Sequence[int]) -> str:
    shown = ",".join(str(layer) for layer in lost[:8]) + ("..." if len(lost) > 8 else "")
    return f"layers {shown} have no surviving replica; only a checkpoint can restore them"


class _Replanner:
    """Builds the candidates of one replan call."""

    def __init__(
        self,
        current: Plan,
        profile: ModelProfile,
        cluster: ClusterSpec,
        job: JobSpec,
        change: _Change,
        costs: TransitionCosts,
        checkpoint: CheckpointState | None = None,
        strict: bool = True,
    ) -> None:
        self.current = current
        self.profile = profile
        self.cluster = cluster
        self.job = job
        self.change = change
        self.costs = costs
        self.checkpoint = checkpoint
        self.strict = strict  # `auto`: a candidate that keeps fewer replicas than it could is infeasible
        self._search: DynamicSearch | None = None
        self._found: tuple[Layout, str] | None = None

    @property
    def search(self) -> DynamicSearch:
        if self._search is None:
            self._search = DynamicSearch(self.profile, self.cluster, self.job, len(self.change.alive))
        return self._search

    def option(self, policy: Policy) -> _Option:
        builders: dict[Policy, Callable[[], tuple[Plan, float, str]]] = {
            Policy.REROUTE: self._reroute,
            Policy.DYNAMIC: self._dynamic,
            Policy.TEMPLATES: self._templates,
            Policy.CHECKPOINT: self._checkpoint,
        }
        started = time.perf_counter()
        try:
            if policy is not Policy.CHECKPOINT and self.change.lost:
                raise PlannerError("failed", _lost_reason(self.change.lost))
            if policy is Policy.REROUTE and self.change.emptied:
                # Rerouting moves no weights: a node whose layers are in doubt cannot keep its stage.
                raise PlannerError(
                    "failed", f"nodes {sorted(self.change.emptied)} may not hold the layers of their stages"
                )
            plan, fixed, reason = builders[policy]()
            if policy is Policy.TEMPLATES:
                reason = self._check_replicas(plan, reason)
        except PlannerError as exc:
            return _Option(policy, None, time.perf_counter() - started, 0.0, exc.message)
        except ImportError:
            return _Option(policy, None, time.perf_counter() - started, 0.0, "pipeline templates unavailable")
        search_s = time.perf_counter() - started
        if self.costs.search_s is not None:
            search_s = self.costs.search_s
        transition = search_s + self.costs.detection_s + fixed
        return _Option(policy, plan, search_s, transition, reason)

    def _check_replicas(self, plan: Plan, reason: str) -> str:
        """`reason`, noting replicas given up; under `auto`, PlannerError when the plan keeps fewer replicas
        of some layer than the alive nodes can hold (f + 1, or as many pipelines as fit)."""
        kept, thin = replicas(plan, self.profile.num_layers)
        target, why = self.replica_target()
        if kept < target and self.strict:
            raise PlannerError(
                "fault_tolerance",
                f"keeps {kept} replica(s) of layers {_span(thin)}; the {len(self.change.alive)} alive nodes "
                f"can hold {target}",
            )
        if kept < target:
            reason += f"; keeps {kept} replica(s) of layers {_span(thin)} where {target} fit"
        return reason + (f"; {why}" if why else "")

    def _moved(self, plan: Plan) -> float:
        return self.costs.restart_s + transfer_time(plan.transfers, self.cluster.inter_node_bandwidth)

    def _reroute(self) -> tuple[Plan, float, str]:
        # A rejoined node lost its state: its old stage stays rerouted until the next reconfiguration.
        dead = self.change.failed_all | set(self.change.joined)
        plan = reroute(self.current, dead, self.profile, self.cluster)
        plan = plan.model_copy(update={"failed_nodes": tuple(sorted(self.change.failed_all))})
        reason = self._check_replicas(plan, "no restart, no weight transfer")
        if self.change.joined:
            reason += "; joined nodes idle until the next reconfiguration"
        return plan, 0.0, reason

    def _layout(self) -> tuple[Layout, str]:
        """The best layout of the alive nodes with at least f + 1 pipelines, and "" ; or, when no such layout
        fits, the best with fewer and the reason. Symmetric layouts that leave nodes idle are searched too, so
        the dynamic candidate is never slower than the checkpoint candidate's layout."""
        if self._found is not None:
            return self._found
        nodes = len(self.change.alive)
        minimum = self.job.fault_tolerance + 1
        window = degree_window(len(self.current.pipelines), nodes, self.job, DP_WINDOW, minimum)
        attempts: list[list[tuple[Sequence[int], int]]] = [
            [(window, REPLAN_SPREAD), (self.search.depth_degrees(minimum), INITIAL_SPREAD)],
            [(all_degrees(nodes, self.job, minimum), INITIAL_SPREAD)],
        ]
        if nodes <= EXHAUSTIVE_NODES:
            # Small enough to try every layout: the window is a speed heuristic, not a rule.
            attempts = [[(all_degrees(nodes, self.job, minimum), nodes)]]
        for groups in attempts:
            found = self.search.search_groups(groups, keep=1)
            if found:
                self._found = (_fastest([*found, *self.search.symmetric(minimum=minimum)]), "")
                return self._found
        # Fewer than f + 1 pipelines fit: as many as do, and the candidates say why.
        most = self.search.most_pipelines()
        if most < 1:
            raise _no_layout(self.search, nodes, f"the {nodes} alive nodes")
        fewer = self.search.search_groups([(all_degrees(nodes, self.job, most), INITIAL_SPREAD)], keep=1)
        # A pipeline takes a node of its own at least: with as many pipelines as nodes, nodes are the limit.
        limit = "of a node each" if most >= nodes else "that each fit in memory"
        why = f"the {nodes} alive nodes cannot hold f + 1 = {minimum} pipelines {limit} (at most {most})"
        self._found = (_fastest([*fewer, *self.search.symmetric(minimum=most)]), why)
        return self._found

    def replica_target(self) -> tuple[int, str]:
        """Replicas of every layer a plan must keep: f + 1 while the alive nodes can hold that many pipelines,
        else as many as they can (with the reason)."""
        layout, why = self._layout()
        return (self.job.fault_tolerance + 1, "") if not why else (layout.dp, why)

    def _dynamic(self) -> tuple[Plan, float, str]:
        layout, why = self._layout()
        slots = layout.to_plan(self.profile, self.cluster, self.job, Policy.DYNAMIC)
        placed, transfers = place_plan(slots, self.change.holdings, self.profile)
        plan = placed.model_copy(update={"transfers": tuple(transfers)})
        moved = sum(t.bytes for t in transfers)
        reason = f"{len(transfers)} layer copies, {_size(moved)}"
        idle = len(self.change.alive) - layout.nodes
        if idle:
            reason += f"; {idle} node(s) idle"
        return plan, self._moved(plan), reason + (f"; {why}" if why else "")

    def _templates(self) -> tuple[Plan, float, str]:
        from .template_recovery import reinstantiate
        from .templates import instantiate

        key = (self.profile.model_dump_json(), self.cluster.model_dump_json(), self.job.fault_tolerance)
        if self.strict and self.cluster.nodes > TEMPLATES_ON_DEMAND_NODES and key not in _TEMPLATE_CACHE:
            raise PlannerError(
                "templates", "not generated yet: the planner's warm-up makes them ahead of failures"
            )
        templates = _template_set(self.profile, self.cluster, self.job.fault_tolerance)
        if self.current.policy is Policy.TEMPLATES:
            plan = reinstantiate(
                templates,
                self.current,
                self.change.failed_now,
                self.profile,
                self.cluster,
                self.job,
                joined=self.change.joined,
                emptied=self.change.emptied,
            )
            how = "reinstantiated"
        else:
            nodes = len(self.change.alive)
            slots = instantiate(templates, list(range(nodes)), self.profile, self.cluster, self.job)
            placed, transfers = place_plan(slots, self.change.holdings, self.profile)
            plan = placed.model_copy(update={"transfers": tuple(transfers)})
            how = "instantiated"
        return plan, self._moved(plan), f"templates {how}; {len(plan.transfers)} layer copies"

    def _lost_work(self) -> tuple[float, str]:
        """Seconds of training a restart redoes, and how it was found."""
        state = self.checkpoint
        if state is None:
            # No job state given (the simulator's periodic-checkpoint model): half an interval on average.
            return (
                self.costs.checkpoint_interval_s / 2,
                "from the last checkpoint, losing half an interval of work on average",
            )
        lost = state.lost_steps()
        if lost is None:
            raise PlannerError(
                "checkpoint", "no checkpoint was written and the job writes none; nothing to restart from"
            )
        seconds = lost * self.current.step_time_s
        if state.last_step is None:
            return (
                seconds,
                f"from the initial weights (no checkpoint written yet): all {lost} steps so far redone "
                f"({seconds:.0f} s)",
            )
        return (
            seconds,
            f"from the checkpoint of step {state.last_step}, {lost} steps redone ({seconds:.0f} s)",
        )

    def _checkpoint(self) -> tuple[Plan, float, str]:
        lost_s, how = self._lost_work()
        nodes = len(self.change.alive)
        target, why = self.replica_target()
        layouts = self.search.symmetric(minimum=target)
        if not layouts:
            raise _no_layout(self.search, nodes, f"the {nodes} alive nodes")
        layout = layouts[0]
        slots = layout.to_plan(self.profile, self.cluster, self.job, Policy.CHECKPOINT)
        plan = relabel(slots, self.change.alive[: layout.nodes])
        fixed = self.costs.checkpoint_load_s + lost_s
        idle = nodes - layout.nodes
        reason = f"restart {how}"
        if idle:
            reason += f"; {idle} node(s) idle"
        return plan, fixed, reason + (f"; {why}" if why else "")


def replicas(plan: Plan, num_layers: int) -> tuple[int, list[int]]:
    """The fewest nodes holding any one layer in `plan` (rerouted stages hold nothing: their node is gone),
    and the layers held that thinly."""
    holders = [0] * num_layers
    for layers in plan.layers_by_node().values():
        for layer in layers:
            holders[layer] += 1
    fewest = min(holders, default=0)
    return fewest, [layer for layer, count in enumerate(holders) if count == fewest]


def _span(layers: Sequence[int]) -> str:
    return _ranges(layers) if layers else "none"


def _fastest(layouts: Sequence[Layout]) -> Layout:
    """Lowest step time; ties to more nodes used (idle nodes help no one), then to the earlier layout."""
    return min(layouts, key=lambda layout: (layout.step_time_s, -layout.nodes))


def clear_caches() -> None:
    """Forget the per-depth split tables and the memoised 1F1B simulations (what an operator restart loses):
    cold-start measurements start from here."""
    clear_shape_tables()
    _simulate_1f1b.cache_clear()


def warm_up(profile: ModelProfile, cluster: ClusterSpec, job: JobSpec) -> int:
    """Fill the job's per-depth split tables ahead of any failure, so the first replan after an operator
    restart costs what later ones do (Odyssey IV-C: the search can be done in advance). Safe to run in a
    thread beside `replan`: both fill the same cache with the same values. Returns the feasible depths."""
    import scipy.optimize  # noqa: F401 - the transfers' matching (`restorer`), not left to the first replan

    search = DynamicSearch(profile, cluster, job, cluster.nodes)
    feasible = sum(search.allowed(depth) for depth in range(1, min(cluster.nodes, profile.num_layers) + 1))
    prepare_templates(profile, cluster, job)  # the `templates` candidate's set, with its time curves
    return feasible


def replan(
    current: Plan,
    profile: ModelProfile,
    cluster: ClusterSpec,
    job: JobSpec,
    *,
    failed: Collection[int] = (),
    joined: Collection[int] = (),
    emptied: Collection[int] = (),
    standby: Collection[int] | None = None,
    policy: Policy = Policy.AUTO,
    costs: TransitionCosts = TransitionCosts(),  # noqa: B008 - frozen model, safe as a default
    failure_rate_per_node_hour: float = 0.01,
    checkpoint: CheckpointState | None = None,
) -> Plan:
    """The plan after `failed` nodes stopped and `joined` nodes arrived; generation current + 1. `emptied`:
    alive nodes of the current plan whose layers are not to be trusted (a copy to them may have been cut
    short): they run again, but hold nothing, and their layers count as lost where no other node has them.
    `standby`: the nodes outside the current plan that can run a stage besides `joined`; None (a simulation,
    the CLI): every node of the cluster that has not failed. The operator passes none: it lists each ready
    idle node in `joined`, and an idle id whose pod is not running must not be planned on.

    `failed_nodes` accumulates every failure so far; `candidates` lists every policy considered with its
    step time, transition time and score; `policy` is the concrete policy chosen (never `auto`); transfers
    and `transition_s` belong to the chosen candidate. Raises PlannerError naming the field when the
    request is impossible (unknown nodes, no survivor, the model fits nowhere).
    """
    started = time.perf_counter()
    policy = Policy(policy)
    rate = failure_rate_per_node_hour
    if not (math.isfinite(rate) and rate >= 0):
        raise PlannerError("failure_rate_per_node_hour", f"must be a finite number >= 0, got {rate}")
    change = _change(current, profile, cluster, failed, joined, emptied, standby)
    between = mean_time_between_failures(rate, len(change.alive))
    replanner = _Replanner(current, profile, cluster, job, change, costs, checkpoint, policy is Policy.AUTO)
    order = AUTO_POLICIES if policy is Policy.AUTO else (policy,)
    options = [replanner.option(name) for name in order]
    if all(option.plan is None for option in options) and policy is not Policy.CHECKPOINT:
        options.append(replanner.option(Policy.CHECKPOINT))
    feasible = [(option, option.plan) for option in options if option.plan is not None]
    candidates = tuple(option.candidate(job.global_batch, between) for option in options)
    if not feasible:
        reasons = "; ".join(f"{option.policy}: {option.reason}" for option in options)
        raise PlannerError(
            "failed", f"no plan can run the job on {len(change.alive)} alive nodes ({reasons})"
        )
    best, chosen = max(
        feasible,
        key=lambda pair: (
            score(job.global_batch, pair[1].step_time_s, pair[0].transition_s, between),
            -pair[0].transition_s,
        ),
    )
    return chosen.model_copy(
        update={
            "generation": current.generation + 1,
            "failed_nodes": tuple(sorted(change.failed_all)),
            "candidates": candidates,
            "transition_s": best.transition_s,
            "planning_s": time.perf_counter() - started,
        }
    )


def _size(count: int) -> str:
    """Bytes as a reader takes them in: `2.38 GiB`, `476 KiB`, `12 B`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count} B"
