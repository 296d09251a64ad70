"""What each worker does in one step of a plan: its 1F1B op list, its layers, and its gradient groups.

Pure functions of the plan (no torch.distributed), so every worker derives the same schedule independently.

Why a schedule of our own rather than `torch.distributed.pipelining.Schedule1F1B`: that schedule gives each
rank exactly one stage of one pipeline group. A rerouted plan makes a worker run its own stage *and* some
micro-batches of a failed peer's stage in another pipeline, and a heterogeneous plan gives replicas different
depths in one world. We therefore list-schedule every (pipeline, stage, micro-batch) op in a simulated time
line: an idle worker runs the op that can start first; among ops ready when it is idle, a backward first,
else the lowest forward, keeping at most `stages - stage` forwards in flight per stage (the 1F1B memory
bound). For one pipeline this is exactly 1F1B. (Preferring a backward that is not ready yet over a ready
forward would idle the worker and turn 1F1B into 2F2B: that cost the runtime 20-35% on pipelines.) Op
durations in the simulated time line are proportional to the segment's layer count (backward twice the
forward), so stages of unequal depth are ordered as they will run.
Each micro-batch follows a `chain` of segments: a live stage is one segment on its node; a rerouted stage
runs on one of its peer pipelines (round-robin by micro-batch), split at that pipeline's stage boundaries,
so a heterogeneous layout can reroute a stage whose layers its peers hold on several nodes.
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
    def receives(self) -> bool:
        """Whether the op takes a tensor from a neighbour: a forward its input, a backward its gradient."""
        return not self.first if self.kind == OpKind.FORWARD else not self.last

    @property
    def sends(self) -> bool:
        """Whether the op passes a tensor on: a forward its output, a backward its input's gradient."""
        return not self.last if self.kind == OpKind.FORWARD else not self.first

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


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    start, end = max(a[0], b[0]), min(a[1], b[1])
    return (start, end) if start < end else None


@dataclass(frozen=True, slots=True)
class Segment:
    """Layers of one stage of one pipeline as one node runs them for one micro-batch.

    A live stage is one segment on its own node. A rerouted stage runs on a peer pipeline, split at that
    pipeline's stage boundaries (peers of a heterogeneous layout may hold the failed layers on several
    nodes), so it becomes one segment per overlapping peer stage; `part` numbers them."""

    stage: int
    part: int
    layers: tuple[int, int]
    node: int


def peer_pipelines(plan: Plan, pipeline: int, stage: int) -> list[int]:
    """Pipelines whose live stages cover a rerouted stage's layers using only nodes in its `rerouted_to`."""
    spec = plan.pipelines[pipeline].stages[stage]
    peers = []
    for q, other in enumerate(plan.pipelines):
        if q == pipeline:
            continue
        overlapping = [s for s in other.stages if _overlap(s.layers, spec.layers) is not None]
        if all(not s.rerouted and s.node in spec.rerouted_to for s in overlapping):
            peers.append(q)
    if not peers:
        raise ValueError(
            f"pipelines[{pipeline}].stages[{stage}].rerouted_to: nodes {list(spec.rerouted_to)} do not hold "
            f"layers {list(spec.layers)} in any other pipeline"
        )
    return peers


def chain(plan: Plan, pipeline: int, local_microbatch: int) -> list[Segment]:
    """The nodes one micro-batch of `pipeline` passes through, layer range by layer range."""
    segments = []
    for s, spec in enumerate(plan.pipelines[pipeline].stages):
        if not spec.rerouted:
            segments.append(Segment(s, 0, spec.layers, spec.node))
            continue
        peers = peer_pipelines(plan, pipeline, s)
        # Micro-batches of a failed stage go round-robin over its peer pipelines (eq. 12-13's even spread).
        peer = plan.pipelines[peers[local_microbatch % len(peers)]]
        part = 0
        for other in peer.stages:
            piece = _overlap(other.layers, spec.layers)
            if piece is not None:
                segments.append(Segment(s, part, piece, other.node))
                part += 1
    return segments


def microbatch_offsets(plan: Plan) -> list[int]:
    offsets, total = [], 0
    for pipeline in plan.pipelines:
        offsets.append(total)
        total += pipeline.microbatches
    return offsets


def held_layers(plan: Plan) -> dict[int, set[int]]:
    """Layers each live node must hold, checking that rerouting peers can serve what is routed to them."""
    for p, pipeline in enumerate(plan.pipelines):
        for s, stage in enumerate(pipeline.stages):
            if stage.rerouted:
                peer_pipelines(plan, p, s)
    return plan.layers_by_node()


def designated_holders(plan: Plan) -> dict[int, int]:
    """Layer -> the lowest node holding it: the one copy that is checkpointed, exported and counted in the
    global gradient norm (after the gradient sum every holder's copy is the same)."""
    owners: dict[int, int] = {}
    for node, layers in sorted(held_layers(plan).items()):
        for layer in layers:
            owners.setdefault(layer, node)
    return owners


def build_ops(plan: Plan) -> dict[int, list[Op]]:
    """Every node's ops for one step, in an order that is deadlock-free across all nodes."""
    held_layers(plan)
    offsets = microbatch_offsets(plan)
    chains = {
        (p, j): chain(plan, p, j)
        for p, pipeline in enumerate(plan.pipelines)
        for j in range(pipeline.microbatches)
    }
    todo: dict[int, set[tuple[OpKind, int, int, int]]] = {}  # node -> {(kind, pipeline, local mb, position)}
    for (p, j), segments in chains.items():
        for k, segment in enumerate(segments):
            todo.setdefault(segment.node, set()).update((kind, p, j, k) for kind in OpKind)

    forward_done: dict[tuple[int, int, int], float] = {}
    backward_done: dict[tuple[int, int, int], float] = {}
    in_flight: dict[tuple[int, int], int] = {}
    clock = dict.fromkeys(todo, 0.0)
    ops: dict[int, list[Op]] = {node: [] for node in todo}
    remaining = sum(len(items) for items in todo.values())

    def ready_time(kind: OpKind, p: int, j: int, k: int) -> float | None:
        segments = chains[(p, j)]
        segment = segments[k]
        if kind == OpKind.FORWARD:
            # 1F1B memory bound: at most `stages - stage` micro-batches between forward and backward.
            depth = len(plan.pipelines[p].stages)
            if segment.part == 0 and in_flight.get((p, segment.stage), 0) >= depth - segment.stage:
                return None
            return 0.0 if k == 0 else forward_done.get((p, j, k - 1))
        if (p, j, k) not in forward_done:
            return None
        if k == len(segments) - 1:
            return forward_done[(p, j, k)]
        return backward_done.get((p, j, k + 1))

    # List scheduling: among all nodes, run the op that can start earliest (ties: lowest node id).
    while remaining:
        best = None
        for node in sorted(todo):
            choice = None
            for kind, p, j, k in todo[node]:
                ready = ready_time(kind, p, j, k)
                if ready is None:
                    continue
                # The earliest start; then backward first (frees activations), then the lowest micro-batch.
                start = max(clock[node], ready)
                key = (start, 0 if kind == OpKind.BACKWARD else 1, offsets[p] + j, p, k)
                if choice is None or key < choice[0]:
                    choice = (key, (kind, p, j, k))
            if choice is not None:
                start = choice[0][0]
                if best is None or (start, node) < (best[0], best[1]):
                    best = (start, node, choice[1])
        if best is None:
            raise RuntimeError("schedule made no progress: the plan's pipelines cannot be ordered")
        start, node, (kind, p, j, k) = best
        todo[node].discard((kind, p, j, k))
        segment = chains[(p, j)][k]
        depth = segment.layers[1] - segment.layers[0]
        end = start + depth * (1.0 if kind == OpKind.FORWARD else 2.0)
        clock[node] = end
        if kind == OpKind.FORWARD:
            forward_done[(p, j, k)] = end
            if segment.part == 0:
                in_flight[(p, segment.stage)] = in_flight.get((p, segment.stage), 0) + 1
        else:
            backward_done[(p, j, k)] = end
            if segment.part == 0:
                in_flight[(p, segment.stage)] -= 1
        ops[node].append(_make_op(plan, offsets, chains[(p, j)], kind, p, j, k))
        remaining -= 1
    return ops


def _make_op(
    plan: Plan, offsets: list[int], segments: list[Segment], kind: OpKind, p: int, j: int, k: int
) -> Op:
    segment = segments[k]
    before = segments[k - 1].node if k > 0 else None
    after = segments[k + 1].node if k < len(segments) - 1 else None
    forward = kind == OpKind.FORWARD
    return Op(
        kind=kind,
        pipeline=p,
        stage=segment.stage,
        microbatch=offsets[p] + j,
        layers=segment.layers,
        recv_from=before if forward else after,
        send_to=after if forward else before,
        first=segment.layers[0] == 0,
        last=segment.layers[1] == plan.num_layers,
    )


def sync_groups(plan: Plan) -> list[SyncGroup]:
    """Gradient all-reduce groups in colour-round order (the plan's rounds, or the restorer's)."""
    rounds = plan.allreduce_rounds or tuple(tuple(r) for r in allreduce_rounds(plan.pipelines))
    if not rounds:  # one replica: nothing to reduce
        return []
    groups = []
    for number, segments in enumerate(rounds):
        for start, end in segments:
            # Rerouted micro-batches' gradients accumulate on the peers' own copies, so the holders are the
            # live stages' nodes only. They stay in pipeline order: that is the ring the all-reduce runs
            # (ranks are numbered in pipeline order, `world_nodes`), the order the planner's fail-slow
            # topology change (Falcon's S3, `planner.failslow.reroute_slow_links`) scores when it moves a
            # slow link off it.
            holders = dict.fromkeys(
                stage.node
                for pipeline in plan.pipelines
                for stage in pipeline.stages
                if not stage.rerouted and stage.layers[0] <= start < stage.layers[1]
            )
            groups.append(SyncGroup(round=number, layers=(start, end), holders=tuple(holders)))
    return groups


def lane_ranks(nodes: list[int], lanes: int, lane: int) -> dict[int, int]:
    """Node -> the global rank of its `lane`-th worker in a world of `nodes` (`world_nodes`), each node's
    `lanes` workers (a stage over that many devices) side by side: `position * lanes + lane`."""
    return {node: position * lanes + lane for position, node in enumerate(nodes)}


def world_nodes(plan: Plan) -> list[int]:
    """Nodes in the process group of this plan, in rank order: those that run a stage in pipeline order
    (pipeline by pipeline, stage by stage), then those that only send a layer. So the holders of every
    gradient ring (`sync_groups`, pipeline order) have ascending ranks, and the group's ring, which gloo and
    NCCL run in group-rank order, is the plan's on any torch: `new_group` sorts the ranks it is given unless
    told not to, which torch 2.11 cannot be (no `sort_ranks`; the runtime's groups then died of a TypeError
    there). The plan's ring is what S3 scores when it moves a slow link off it."""
    running = [node for pipeline in plan.pipelines for node in pipeline.nodes]
    senders = {transfer.src for transfer in plan.transfers} - set(running)
    return [*dict.fromkeys(running), *sorted(senders)]
