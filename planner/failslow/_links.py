"""Falcon's S3 (a), topology adjustment for slow links (Fig. 10), on any DP x PP layout.

What a step sends between nodes follows the runtime's two paths:
- the gradient all-reduce: every layer segment (`restorer.allreduce_rounds`) is reduced in a ring of its
  holders in pipeline order (the runtime makes the group in that order: `agent._runtime_schedule
  .sync_groups`). A ring of n moves 2 (n - 1) / n of the segment's gradients over each hop, and a ring of
  two has both hops on its one pair;
- the pipeline: consecutive stages of one pipeline exchange one micro-batch's boundary activations forward
  and as many gradient bytes back, per micro-batch.

`link_load` sums those bytes over slow node pairs. `reroute_slow_links` lowers it with two kinds of move:
reordering the pipelines (which changes every ring's order and moves no weights: the only free move of an
asymmetric layout, where a 2-stage pipeline's stage has no same-layered peer to trade places with), and
swapping two nodes' places (free between equal stages, else the weights move peer-to-peer). Each round
takes the move that lowers the load most, preferring fewer bytes to copy; the load is in bytes from the
profile, so whether the pipeline's activations or a ring's gradients should cross the slow link is decided
by what they weigh, not by a fixed rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import PlannerError
from ..plan import PipelinePlan, Plan
from ..profile import ModelProfile
from ..restorer import allreduce_rounds, transfer_list
from ._localize import Link

COPY_MARGIN = 0.1
"""Share of the starting load a move that copies weights must take off the slow links to be worth it."""

Slot = tuple[int, int]
"""(pipeline index in the original plan, stage index)."""


@dataclass(frozen=True, slots=True)
class LinkReroute:
    """S3 (a)'s answer: the new plan (its transfers set, generation unchanged) and the bytes one step sends
    over the slow links before and after."""

    plan: Plan
    bytes_before: float
    bytes_after: float
    reordered: bool
    """Whether the pipelines' order changed."""
    swapped: tuple[Link, ...]
    """Node pairs that traded places, in the order applied."""


class _Layout:
    """A plan as slots, a pipeline order and a node in each slot: cheap to change and to score."""

    def __init__(self, plan: Plan, profile: ModelProfile) -> None:
        self.plan = plan
        self.profile = profile
        self.stages = [tuple(stage.layers for stage in pipeline.stages) for pipeline in plan.pipelines]
        self.microbatches = [pipeline.microbatches for pipeline in plan.pipelines]
        self.node = {
            (p, s): stage.node
            for p, pipeline in enumerate(plan.pipelines)
            for s, stage in enumerate(pipeline.stages)
        }
        self.slots: dict[int, list[Slot]] = {}
        for slot, node in self.node.items():
            self.slots.setdefault(node, []).append(slot)
        self.rank = list(range(len(plan.pipelines)))
        """Position of each original pipeline in the current order."""
        rounds = plan.allreduce_rounds or allreduce_rounds(plan.pipelines)
        segments = sorted(segment for round_ in rounds for segment in round_)
        replicas = len(plan.pipelines)
        param = profile.prefix("param")
        share = 2 * (replicas - 1) / replicas if replicas > 1 else 0.0
        hops = 2 if replicas == 2 else 1
        self.segments = [
            (start, end, hops * share * float(param[end] - param[start])) for start, end in segments
        ]
        self.original = {node: self.holding(node) for node in self.slots}
        self.touched: set[int] = set()
        """Nodes that have traded places (the others hold what they held)."""

    def holding(self, node: int) -> set[int]:
        return {layer for p, s in self.slots[node] for layer in range(*self.stages[p][s])}

    def _ring_bytes(self, a: Slot, b: Slot) -> float:
        replicas = len(self.rank)
        if a[0] == b[0] or replicas < 2:
            return 0.0
        gap = abs(self.rank[a[0]] - self.rank[b[0]])
        if gap != 1 and gap != replicas - 1:
            return 0.0
        (a_start, a_end), (b_start, b_end) = self.stages[a[0]][a[1]], self.stages[b[0]][b[1]]
        low, high = max(a_start, b_start), min(a_end, b_end)
        return sum(weight for start, _, weight in self.segments if low <= start < high)

    def _send_bytes(self, a: Slot, b: Slot) -> float:
        if a[0] != b[0] or abs(a[1] - b[1]) != 1:
            return 0.0
        first = self.stages[a[0]][min(a[1], b[1])]
        # Forward activations and their gradients back, per micro-batch.
        return 2.0 * self.profile.layers[first[1] - 1].output_bytes * self.microbatches[a[0]]

    def load(self, links: Sequence[Link]) -> float:
        total = 0.0
        for x, y in links:
            for a in self.slots.get(x, ()):
                for b in self.slots.get(y, ()):
                    total += self._ring_bytes(a, b) + self._send_bytes(a, b)
        return total

    def moved_bytes(self, *also: int) -> float:
        """State bytes the nodes must fetch to hold their current layers (`also`: nodes swapped on trial)."""
        layers = self.profile.layers
        nodes = self.touched.union(also)
        return float(
            sum(
                layers[layer].state_bytes
                for node in nodes
                for layer in self.holding(node) - self.original[node]
            )
        )

    def swap_nodes(self, a: int, b: int) -> None:
        self.slots[a], self.slots[b] = self.slots[b], self.slots[a]
        for node in (a, b):
            for slot in self.slots[node]:
                self.node[slot] = node

    def swap_pipelines(self, p: int, q: int) -> None:
        self.rank[p], self.rank[q] = self.rank[q], self.rank[p]

    def result(self) -> Plan:
        order = sorted(range(len(self.rank)), key=self.rank.__getitem__)
        pipelines: list[PipelinePlan] = []
        for p in order:
            pipeline = self.plan.pipelines[p]
            stages = tuple(
                stage.model_copy(update={"node": self.node[(p, s)]})
                for s, stage in enumerate(pipeline.stages)
            )
            pipelines.append(pipeline.model_copy(update={"stages": stages}))
        moved = self.plan.model_copy(update={"pipelines": tuple(pipelines)})
        transfers = transfer_list(self.plan.layers_by_node(), moved.layers_by_node(), self.profile)
        return moved.model_copy(update={"transfers": tuple(transfers)})


def _check(plan: Plan, links: Sequence[Link]) -> list[Link]:
    if any(stage.rerouted for pipeline in plan.pipelines for stage in pipeline.stages):
        raise PlannerError("plan", "the layout reroutes failed stages; its traffic is not modelled")
    inside = set(plan.nodes)
    checked = []
    for a, b in links:
        if a == b:
            raise PlannerError("links", f"link ({a}, {b}) joins a node to itself")
        for node in (a, b):
            if node not in inside:
                raise PlannerError("links", f"node {node} is not in the layout")
        checked.append((a, b))
    return checked


def link_load(plan: Plan, profile: ModelProfile, links: Sequence[Link]) -> float:
    """Bytes one step of `plan` sends across the node pairs `links`, either way (gradient rings and
    pipeline sends, as the runtime runs them). Raises PlannerError for a node outside the plan."""
    return _Layout(plan, profile).load(_check(plan, links))


def reroute_slow_links(plan: Plan, profile: ModelProfile, links: Sequence[Link]) -> LinkReroute:
    """Greedy S3 (a): apply the move that lowers the slow links' load most, cheapest copies first, until
    none does.

    Moves: swap two pipelines' places in the order (free), or swap two nodes' places where one is an end of
    a slow link (free between equal stages). Keys compare (load, bytes to copy, pipeline moves before node
    swaps, indices), so the result is deterministic and a free move wins a tie. A move that copies more
    weights than the layout already does must also take `COPY_MARGIN` of the starting load off the links:
    gigabytes of copies are not worth a sliver of link traffic. Every round lowers the load, so the rounds
    are bounded; a round scores ends x (pipelines + nodes) moves, each in O(links x slots per node^2 x
    segments): four slow links on 1,024 nodes (DP256 x PP4) take about 1.3 s in all, off the event loop.
    """
    checked = _check(plan, links)
    layout = _Layout(plan, profile)
    start = current = layout.load(checked)
    ends = sorted({node for link in checked for node in link})
    swapped: list[Link] = []
    reordered = False
    while current > 0:
        copied = layout.moved_bytes()
        best: tuple[float, float, int, int, int] | None = None
        end_pipelines = sorted({p for node in ends for p, _ in layout.slots[node]})
        for p in end_pipelines:
            for q in range(len(layout.rank)):
                if q == p:
                    continue
                layout.swap_pipelines(p, q)
                key = (layout.load(checked), layout.moved_bytes(), 0, min(p, q), max(p, q))
                layout.swap_pipelines(p, q)
                if key[0] < current * (1 - 1e-9) and (best is None or key < best):
                    best = key
        for a in ends:
            for b in sorted(layout.slots):
                if b == a:
                    continue
                layout.swap_nodes(a, b)
                key = (layout.load(checked), layout.moved_bytes(a, b), 1, min(a, b), max(a, b))
                layout.swap_nodes(a, b)
                bar = current - COPY_MARGIN * start if key[1] > copied else current * (1 - 1e-9)
                if key[0] < bar and (best is None or key < best):
                    best = key
        if best is None:
            break
        current, _, kind, x, y = best
        if kind == 0:
            layout.swap_pipelines(x, y)
            reordered = True
        else:
            layout.swap_nodes(x, y)
            layout.touched.update((x, y))
            swapped.append((x, y))
    return LinkReroute(layout.result(), start, current, reordered, tuple(swapped))
