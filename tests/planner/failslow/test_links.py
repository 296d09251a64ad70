"""S3 (a) on whole plans: the bytes a step sends over a node pair, and moves that take them off slow links."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilientjob.planner import PlannerError
from resilientjob.planner.failslow import link_load, reroute_slow_links
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan
from resilientjob.planner.profile import LayerProfile, ModelProfile

PARAM = 1000
"""Parameter (and gradient) bytes per layer."""
OUTPUT = 10
"""Boundary activation bytes per micro-batch."""


def profile(layers: int, param: int = PARAM, output: int = OUTPUT) -> ModelProfile:
    layer = LayerProfile(
        forward_s=0.01, backward_s=0.02, param_bytes=param, optimizer_bytes=2 * param, activation_bytes=0,
        output_bytes=output,
    )  # fmt: skip
    return ModelProfile(layers=(layer,) * layers)


def plan_of(pipelines: list[list[tuple[int, int, int]]], microbatches: int = 4) -> Plan:
    """Pipelines as lists of (start layer, end layer, node)."""
    return Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=1,
        pipelines=tuple(
            PipelinePlan(
                stages=tuple(StagePlan(layers=(a, b), node=node) for a, b, node in stages),
                microbatches=microbatches,
            )
            for stages in pipelines
        ),
        step_time_s=1.0,
    )


def grid(rows: list[list[int]], layers_per_stage: int = 2, microbatches: int = 4) -> Plan:
    width = layers_per_stage
    return plan_of(
        [[(c * width, (c + 1) * width, node) for c, node in enumerate(row)] for row in rows], microbatches
    )


def demo_layout() -> Plan:
    """The demo job's DP6 PP[2,2,1,1,1,1] on 8 layers: two 2-stage pipelines and four whole replicas."""
    return plan_of([[(0, 4, 0), (4, 8, 1)], [(0, 4, 2), (4, 8, 3)], *[[(0, 8, n)] for n in (4, 5, 6, 7)]], 2)


def test_link_load_counts_ring_hops_and_pipeline_sends() -> None:
    plan = grid([[0, 1], [2, 3], [4, 5]])  # DP3 x PP2, 2 layers per stage
    model = profile(4)
    hop = 2 * (3 - 1) / 3 * 2 * PARAM  # a ring of 3 moves 2 (n - 1) / n of the stage's gradients per hop
    assert link_load(plan, model, [(0, 2)]) == pytest.approx(hop)
    assert link_load(plan, model, [(4, 0)]) == pytest.approx(hop)  # the ring closes from row 2 to row 0
    assert link_load(plan, model, [(0, 1)]) == 2 * OUTPUT * 4  # activations and their gradients, x4
    assert link_load(plan, model, [(0, 3)]) == 0  # different stages of different pipelines
    assert link_load(plan, model, [(0, 2), (0, 1)]) == pytest.approx(hop + 2 * OUTPUT * 4)
    two = grid([[0, 1], [2, 3]])
    assert link_load(two, model, [(0, 2)]) == 2 * 2 * PARAM  # a ring of two: both hops on the one pair
    with pytest.raises(PlannerError) as info:
        link_load(plan, model, [(0, 9)])
    assert info.value.field == "links"


def test_an_asymmetric_layout_reorders_its_pipelines_and_copies_nothing() -> None:
    # The demo's slow link 0-2: stage 0 of the two 2-stage pipelines, neighbours on the ring of layers 0-3.
    plan, model = demo_layout(), profile(8)
    before = link_load(plan, model, [(0, 2)])
    assert before > 0
    change = reroute_slow_links(plan, model, [(0, 2)])
    assert change.bytes_before == before and change.bytes_after == 0
    assert link_load(change.plan, model, [(0, 2)]) == 0
    assert change.reordered and change.swapped == () and change.plan.transfers == ()
    assert change.plan.layers_by_node() == plan.layers_by_node()
    assert sorted(p.microbatches for p in change.plan.pipelines) == [2] * 6
    # The ring of layers 0-3 in the new pipeline order: 0 and 2 are no longer neighbours.
    ring = [p.stages[0].node for p in change.plan.pipelines]
    gap = abs(ring.index(0) - ring.index(2))
    assert gap not in (1, len(ring) - 1)


def test_a_free_move_wins_over_copying_weights() -> None:
    plan = grid([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]], layers_per_stage=2)
    change = reroute_slow_links(plan, profile(6), [(1, 4)])
    assert change.bytes_after == 0 and change.plan.transfers == ()
    assert change.plan.layers_by_node() == plan.layers_by_node()


@pytest.mark.parametrize(("output", "carried"), [(OUTPUT, "pipeline"), (100 * PARAM, "ring")])
def test_what_crosses_a_link_that_cannot_be_cleared_is_chosen_by_its_bytes(output: int, carried: str) -> None:
    # Falcon Fig. 10 on DP2 x PP2: node 0 has slow links to 2 and 3; in a 2 x 2 grid one of them must carry
    # either the ring of two (2 x 2 stages' gradients) or the pipeline (activations both ways, x4).
    plan, model = grid([[0, 1], [2, 3]]), profile(4, output=output)
    ring, sends = 2 * 2 * PARAM, 2 * output * 4
    change = reroute_slow_links(plan, model, [(0, 2), (0, 3)])
    assert change.bytes_before == pytest.approx(ring)
    assert change.bytes_after == pytest.approx(min(ring, sends))
    if carried == "pipeline":
        assert change.swapped and change.plan.transfers  # a node changed stage, so weights are copied
        held, new = plan.layers_by_node(), change.plan.layers_by_node()
        received: dict[int, set[int]] = {}
        for transfer in change.plan.transfers:
            received.setdefault(transfer.dst, set()).add(transfer.layer)
            assert transfer.layer in held[transfer.src]
        assert received == {n: new[n] - held[n] for n in new if new[n] - held[n]}
    else:
        assert change.bytes_after == change.bytes_before and change.plan == plan.model_copy(
            update={"transfers": ()}
        )


def test_reroute_refuses_what_it_cannot_model() -> None:
    plan = grid([[0, 1], [2, 3]])
    with pytest.raises(PlannerError, match="itself"):
        reroute_slow_links(plan, profile(4), [(1, 1)])
    failed = plan.model_copy(
        update={
            "pipelines": (
                plan.pipelines[0],
                plan.pipelines[1].model_copy(
                    update={
                        "stages": (
                            plan.pipelines[1].stages[0].model_copy(update={"rerouted_to": (0,)}),
                            plan.pipelines[1].stages[1],
                        )
                    }
                ),
            )
        }
    )
    with pytest.raises(PlannerError, match="reroutes"):
        reroute_slow_links(failed, profile(4), [(0, 1)])


@st.composite
def layouts(draw: st.DrawFn) -> Plan:
    """Up to 9 nodes in pipelines of 1-3 stages over 6 layers (any mix of shapes)."""
    count = draw(st.integers(2, 5))
    cuts = {1: [(0, 6)], 2: [(0, 3), (3, 6)], 3: [(0, 2), (2, 4), (4, 6)]}
    pipelines, node = [], 0
    for _ in range(count):
        depth = draw(st.sampled_from([1, 2, 3]))
        pipelines.append([(a, b, node + i) for i, (a, b) in enumerate(cuts[depth])])
        node += depth
    return plan_of(pipelines, microbatches=draw(st.integers(1, 4)))


@settings(max_examples=150, deadline=None)
@given(plan=layouts(), data=st.data(), output=st.sampled_from([0, OUTPUT, 10 * PARAM]))
def test_reroute_never_adds_load_and_keeps_the_job(plan: Plan, data: st.DataObject, output: int) -> None:
    nodes = list(plan.nodes)
    pairs = [(a, b) for a in nodes for b in nodes if a < b]
    links = data.draw(st.lists(st.sampled_from(pairs), min_size=1, max_size=3, unique=True))
    model = profile(6, output=output)
    change = reroute_slow_links(plan, model, links)
    after = change.plan
    assert change.bytes_after <= change.bytes_before
    assert link_load(after, model, links) == pytest.approx(change.bytes_after)
    assert link_load(plan, model, links) == pytest.approx(change.bytes_before)
    # The same job: the same nodes, pipeline shapes and micro-batches; only places changed.
    assert after.nodes == plan.nodes
    shape = [(tuple(s.layers for s in p.stages), p.microbatches) for p in plan.pipelines]
    assert sorted(shape) == sorted(
        (tuple(s.layers for s in p.stages), p.microbatches) for p in after.pipelines
    )
    # The copies give every node exactly the layers it lacks, from a node that held them.
    held, new = plan.layers_by_node(), after.layers_by_node()
    received: dict[int, set[int]] = {}
    for transfer in after.transfers:
        assert transfer.layer in held[transfer.src]
        received.setdefault(transfer.dst, set()).add(transfer.layer)
    assert received == {n: new[n] - held[n] for n in new if new[n] - held[n]}
    if not change.swapped:
        assert after.transfers == ()
