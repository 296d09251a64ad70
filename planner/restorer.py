"""The restorer (Odyssey section IV-B): who moves where, which layers travel, and how gradients sync.

- `match_slots` assigns surviving nodes to the slots of a new layout so that the bytes nodes must receive
  are minimal (a min-cost bipartite matching, `scipy.optimize.linear_sum_assignment`).
- `transfer_list` names, for every layer a node lacks, a source among the surviving replicas, spreading the
  load over sources so no single node sends everything.
- `allreduce_rounds` colours the conflict graph of gradient all-reduces: after an asymmetric change the
  layer ranges reduced together no longer line up with stages, and two ranges on the same device cannot be
  reduced at the same time. Each colour is one round of parallel all-reduces.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np

from .errors import PlannerError
from .plan import PipelinePlan, Plan, StagePlan, Transfer
from .profile import ModelProfile


def _layer_bytes(profile: ModelProfile) -> np.ndarray:
    return np.array([layer.state_bytes for layer in profile.layers], dtype=np.float64)


def match_slots(
    holdings: Mapping[int, set[int]], slots: Sequence[set[int]], profile: ModelProfile
) -> list[int]:
    """Node id for each slot (layer set of the new layout), distinct, minimising the bytes received.

    `holdings` maps each surviving node to the layers it holds now; there must be at least as many nodes as
    slots. Ties go to the lower node id so results are deterministic.
    """
    nodes = sorted(holdings)
    if len(slots) > len(nodes):
        raise PlannerError("nodes", f"{len(slots)} slots need as many nodes, only {len(nodes)} survive")
    num_layers = profile.num_layers
    have = np.zeros((len(nodes), num_layers), dtype=np.float64)
    for row, node in enumerate(nodes):
        have[row, sorted(holdings[node])] = 1.0
    want = np.zeros((len(slots), num_layers), dtype=np.float64)
    for col, layers in enumerate(slots):
        want[col, sorted(layers)] = 1.0
    weighted_want = want * _layer_bytes(profile)
    # cost[i, j] = bytes of slot j's layers that node i does not hold yet.
    cost = weighted_want.sum(axis=1)[None, :] - have @ weighted_want.T
    # Imported here: `scipy.optimize` is 0.4 s of every import of the planner package (each `rjob` command,
    # each pod), and only a replan matches; an operator loads it ahead of the first one (`search.warm_up`).
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(cost)
    assignment = [0] * len(slots)
    for row, col in zip(rows, cols, strict=True):
        assignment[col] = nodes[row]
    return assignment


def transfer_list(
    holdings: Mapping[int, set[int]], targets: Mapping[int, set[int]], profile: ModelProfile
) -> list[Transfer]:
    """Transfers that give every node in `targets` the layers it lacks, from nodes in `holdings`.

    Sources are chosen per layer among the current holders, least-loaded first, so a layer held by three
    replicas is served by all three when three nodes need it.
    """
    holders: dict[int, list[int]] = {}
    for node, layers in holdings.items():
        for layer in layers:
            holders.setdefault(layer, []).append(node)
    sent: dict[int, int] = dict.fromkeys(holdings, 0)
    transfers: list[Transfer] = []
    for dst in sorted(targets):
        current = holdings.get(dst, set())
        for layer in sorted(targets[dst] - current):
            sources = holders.get(layer)
            if not sources:
                raise PlannerError(
                    "failed", f"layer {layer} has no surviving replica; a checkpoint is needed"
                )
            size = profile.layers[layer].state_bytes
            src = min(sources, key=lambda node: (sent[node], node))
            sent[src] += size
            transfers.append(Transfer(layer=layer, src=src, dst=dst, bytes=size))
    return transfers


def relabel(plan: Plan, slot_to_node: Sequence[int]) -> Plan:
    """The same plan with slot ids (0..k-1 in `node` fields) replaced by real node ids."""

    def stage(old: StagePlan) -> StagePlan:
        return old.model_copy(update={"node": slot_to_node[old.node]})

    pipelines = tuple(
        PipelinePlan(
            stages=tuple(stage(s) for s in pipeline.stages),
            microbatches=pipeline.microbatches,
            template=pipeline.template,
        )
        for pipeline in plan.pipelines
    )
    return plan.model_copy(update={"pipelines": pipelines})


def node_slots(plan: Plan) -> list[set[int]]:
    """Layer sets per slot of a plan whose `node` fields are slot ids 0..k-1."""
    holdings = plan.layers_by_node()
    return [holdings.get(slot, set()) for slot in range(max(holdings) + 1)]


def place_plan(
    plan: Plan, holdings: Mapping[int, set[int]], profile: ModelProfile
) -> tuple[Plan, list[Transfer]]:
    """Map a slot-numbered plan onto surviving nodes with the fewest bytes moved; return it with transfers."""
    slots = node_slots(plan)
    assignment = match_slots(holdings, slots, profile)
    placed = relabel(plan, assignment)
    return placed, transfer_list(holdings, placed.layers_by_node(), profile)


def _segments(pipelines: Sequence[PipelinePlan]) -> list[tuple[int, int]]:
    bounds = sorted({b for pipeline in pipelines for stage in pipeline.stages for b in stage.layers})
    return list(itertools.pairwise(bounds))


def allreduce_rounds(pipelines: Sequence[PipelinePlan]) -> list[list[tuple[int, int]]]:
    """Greedy (Welsh-Powell) colouring of the all-reduce conflict graph, O(S^2) in the number of segments.

    Vertices are the layer ranges whose holders are the same in every replica (the common refinement of all
    pipelines' stage boundaries); an edge joins two ranges that share a device. Returns the rounds, each a
    list of ranges reduced in parallel. With one replica there is nothing to reduce.
    """
    if len(pipelines) <= 1:
        return []
    segments = _segments(pipelines)
    devices: list[set[tuple[int, int]]] = []
    for start, _ in segments:
        owned: set[tuple[int, int]] = set()
        for pipeline in pipelines:
            for stage in pipeline.stages:
                if stage.layers[0] <= start < stage.layers[1]:
                    holders = stage.rerouted_to or (stage.node,)
                    owned.update((node, gpu) for node in holders for gpu in stage.gpus)
                    break
        devices.append(owned)
    count = len(segments)
    neighbours = [
        {other for other in range(count) if other != index and devices[index] & devices[other]}
        for index in range(count)
    ]
    colour: dict[int, int] = {}
    for index in sorted(range(count), key=lambda i: (-len(neighbours[i]), i)):
        taken = {colour[n] for n in neighbours[index] if n in colour}
        colour[index] = next(c for c in range(count) if c not in taken)
    rounds: list[list[tuple[int, int]]] = [[] for _ in range(max(colour.values()) + 1)]
    for index in range(count):
        rounds[colour[index]].append(segments[index])
    return rounds


def allreduce_rounds_from_bounds(shapes: Sequence[Sequence[int]]) -> list[list[tuple[int, int]]]:
    """`allreduce_rounds` for a layout given only by its pipelines' stage boundaries, each stage on its own
    devices (one node per stage, as dynamic parallelism lays out).

    `shapes` lists each distinct pipeline shape once as boundaries `[0, b1, ..., L]`: pipelines with the same
    boundaries add no conflict edges, so plan search can colour a candidate layout without building it.
    Callers skip the all-reduce when there is a single replica. Same greedy order as `allreduce_rounds`.
    """
    bounds = sorted({b for shape in shapes for b in shape})
    segments = list(itertools.pairwise(bounds))
    position = {bound: index for index, bound in enumerate(bounds)}
    count = len(segments)
    # Segments inside one stage share that stage's devices: a clique. Every clique holding a segment is an
    # interval of segments around it, so its neighbours are one interval [low, high) less itself; intervals
    # make this O(shapes x segments) where explicit neighbour sets cost O(stages x segments^2).
    low = list(range(count))
    high = list(range(1, count + 1))
    for shape in shapes:
        for start, end in itertools.pairwise(shape):
            first, stop = position[start], position[end]
            for member in range(first, stop):
                low[member] = min(low[member], first)
                high[member] = max(high[member], stop)
    colour = [-1] * count
    for vertex in sorted(range(count), key=lambda i: (low[i] - high[i], i)):
        taken = set(colour[low[vertex] : high[vertex]])
        chosen = 0
        while chosen in taken:
            chosen += 1
        colour[vertex] = chosen
    rounds: list[list[tuple[int, int]]] = [[] for _ in range(max(colour, default=-1) + 1)]
    for vertex in range(count):
        rounds[colour[vertex]].append(segments[vertex])
    return rounds


def transfer_time(transfers: Sequence[Transfer], bandwidth: float) -> float:
    """Seconds to carry out `transfers` in parallel: every node sends and receives at `bandwidth` bytes/s, so
    the busiest sender or receiver bounds the whole copy."""
    if bandwidth <= 0:
        raise PlannerError("bandwidth", f"must be positive, got {bandwidth}")
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    for transfer in transfers:
        sent[transfer.src] = sent.get(transfer.src, 0) + transfer.bytes
        received[transfer.dst] = received.get(transfer.dst, 0) + transfer.bytes
    busiest = max([*sent.values(), *received.values()], default=0)
    return busiest / bandwidth
