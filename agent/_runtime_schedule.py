"""What each worker does in one step of a plan: its 1F1B op list, its layers, and its gradient groups.

Pure functions of the plan (no torch.distributed), so every worker derives the same schedule independently.

Why a schedule of our own rather than `torch.distributed.pipelining.Schedule1F1B`: that schedule gives each
rank exactly one stage of one pipeline group. A rerouted plan makes a worker run its own stage *and* some
micro-batches of a failed peer's stage in another pipeline, and a heterogeneous plan gives replicas different
depths in one world. We therefore list-schedule every (pipeline, stage, micro-batch) op in a simulated time
line: an idle worker runs a ready backward first, else the lowest ready forward, keeping at most
`stages - stage` forwards in flight per stage (the 1F1B memory bound). For one pipeline this is exactly 1F1B.
Each worker then executes its ops in simulated order with non-blocking sends and blocking receives; every
receive's matching send comes earlier in one global order, so execution cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from resilientjob.planner.plan import Plan
from resilientjob.planner.restorer import allreduce_rounds


class OpKind(StrEnum):
    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True, slots=True)
class Op:
    """One forward or backward of one micro-batch through one stage, with its neighbours."""

    kind: OpKind
    pipeline: int
    stage: int
    microbatch: int
    """Global micro-batch index within the step (pipelines take consecutive ranges)."""
    layers: tuple[int, int]
    recv_from: int | None
    send_to: int | None
    first: bool
    last: bool

    @property
    def tag(self) -> int:
        """Message tag of the tensor this op receives; unique per (micro-batch, direction, boundary)."""
        direction = 0 if self.kind == OpKind.FORWARD else 1
        boundary = self.layers[0] if self.kind == OpKind.FORWARD else self.layers[1]
        return (self.microbatch * 2 + direction) * 4096 + boundary

    @property
    def send_tag(self) -> int:
        direction = 0 if self.kind == OpKind.FORWARD else 1
        boundary = self.layers[1] if self.kind == OpKind.FORWARD else self.layers[0]
        return (self.microbatch * 2 + direction) * 4096 + boundary


@dataclass(frozen=True, slots=True)
class SyncGroup:
    """Layers [start, end) whose gradients the `holders` sum together in colour round `round`."""

    round: int
    layers: tuple[int, int]
    holders: tuple[int, ...]


def executor(plan: Plan, pipeline: int, stage: int, local_microbatch: int) -> int:
    """Node that runs this micro-batch on this stage: the stage's node, or a peer in rerouting mode."""
    spec = plan.pipelines[pipeline].stages[stage]
    if spec.rerouted:
        return spec.rerouted_to[local_microbatch % len(spec.rerouted_to)]
    return spec.node


def microbatch_offsets(plan: Plan) -> list[int]:
    offsets, total = [], 0
    for pipeline in plan.pipelines:
        offsets.append(total)
        total += pipeline.microbatches
    return offsets


def held_layers(plan: Plan) -> dict[int, set[int]]:
    """Layers each live node must hold, checking that rerouting peers already hold what they serve."""
    holdings = plan.layers_by_node()
    for index, pipeline in enumerate(plan.pipelines):
        for stage in pipeline.stages:
            for peer in stage.rerouted_to:
                missing = set(range(*stage.layers)) - holdings.get(peer, set())
                if missing:
                    raise ValueError(
                        f"pipelines[{index}].rerouted_to: node {peer} serves layers {list(stage.layers)} "
                        f"but does not hold {sorted(missing)}"
                    )
    return holdings


def build_ops(plan: Plan) -> dict[int, list[Op]]:
    """Every node's ops for one step, in an order that is deadlock-free across all nodes."""
    held_layers(plan)
    offsets = microbatch_offsets(plan)
    pending: dict[int, list[tuple[int, int, int]]] = {}  # node -> [(pipeline, stage, local mb)]
    for p, pipeline in enumerate(plan.pipelines):
        for s in range(len(pipeline.stages)):
            for j in range(pipeline.microbatches):
                pending.setdefault(executor(plan, p, s, j), []).append((p, s, j))

    forward_done: dict[tuple[int, int, int], float] = {}
    backward_done: dict[tuple[int, int, int], float] = {}
    in_flight: dict[tuple[int, int], int] = {}
    todo = {node: {(kind, *item) for item in items for kind in OpKind} for node, items in pending.items()}
    clock = dict.fromkeys(todo, 0.0)
    ops: dict[int, list[Op]] = {node: [] for node in todo}
    remaining = sum(len(items) for items in todo.values())

    def ready_time(kind: OpKind, p: int, s: int, j: int) -> float | None:
        stages = len(plan.pipelines[p].stages)
        if kind == OpKind.FORWARD:
            if in_flight.get((p, s), 0) >= stages - s:
                return None
            return 0.0 if s == 0 else forward_done.get((p, s - 1, j))
        if (p, s, j) not in forward_done:
            return None
        if s == stages - 1:
            return forward_done[(p, s, j)]
        return backward_done.get((p, s + 1, j))

    # List scheduling: among all nodes, run the op that can start earliest (ties: lowest node id).
    while remaining:
        best = None
        for node in sorted(todo):
            choice = None
            for kind, p, s, j in todo[node]:
                ready = ready_time(kind, p, s, j)
                if ready is None:
                    continue
                # Backward first (frees activations), then the lowest micro-batch: 1F1B's order.
                key = (0 if kind == OpKind.BACKWARD else 1, offsets[p] + j, p, s)
                if choice is None or key < choice[0]:
                    choice = (key, (kind, p, s, j), ready)
            if choice is not None:
                start = max(clock[node], choice[2])
                if best is None or (start, node) < (best[0], best[1]):
                    best = (start, node, choice[1])
        if best is None:
            raise RuntimeError("schedule made no progress: the plan's pipelines cannot be ordered")
        start, node, (kind, p, s, j) = best
        todo[node].discard((kind, p, s, j))
        end = start + (1.0 if kind == OpKind.FORWARD else 2.0)
        clock[node] = end
        if kind == OpKind.FORWARD:
            forward_done[(p, s, j)] = end
            in_flight[(p, s)] = in_flight.get((p, s), 0) + 1
        else:
            backward_done[(p, s, j)] = end
            in_flight[(p, s)] -= 1
        ops[node].append(_make_op(plan, offsets, kind, p, s, j))
        remaining -= 1
    return ops


def _make_op(plan: Plan, offsets: list[int], kind: OpKind, p: int, s: int, j: int) -> Op:
    stages = plan.pipelines[p].stages
    before = executor(plan, p, s - 1, j) if s > 0 else None
    after = executor(plan, p, s + 1, j) if s < len(stages) - 1 else None
    forward = kind == OpKind.FORWARD
    return Op(
        kind=kind,
        pipeline=p,
        stage=s,
        microbatch=offsets[p] + j,
        layers=stages[s].layers,
        recv_from=before if forward else after,
        send_to=after if forward else before,
        first=s == 0,
        last=s == len(stages) - 1,
    )


def sync_groups(plan: Plan) -> list[SyncGroup]:
    """Gradient all-reduce groups in colour-round order (the plan's rounds, or the restorer's)."""
    rounds = plan.allreduce_rounds or tuple(tuple(r) for r in allreduce_rounds(plan.pipelines))
    if not rounds:  # one replica: nothing to reduce
        return []
    groups = []
    for number, segments in enumerate(rounds):
        for start, end in segments:
            holders: set[int] = set()
            for pipeline in plan.pipelines:
                for stage in pipeline.stages:
                    if stage.layers[0] <= start < stage.layers[1]:
                        holders.update(stage.rerouted_to or (stage.node,))
                        break
            groups.append(SyncGroup(round=number, layers=(start, end), holders=tuple(sorted(holders))))
    return groups


def world_nodes(plan: Plan) -> list[int]:
    """Nodes in the process group of this plan: every node that runs a stage or sends a layer."""
    nodes = set(plan.nodes) | {transfer.src for transfer in plan.transfers}
    return sorted(nodes)
