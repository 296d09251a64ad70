"""What the operator publishes for a fail-slow rung (`_mitigation.mitigation_message`), from a parsed spec
through the planner: a revert brings the healthy plan back under the NodeSlow trigger, for S2 and for S3."""

from __future__ import annotations

import asyncio

import yaml
from _support import ROOT, bert_spec_fields

from resilientjob.operator._failslow import Action, Mitigation, link_plan, microbatch_plan, sync_time
from resilientjob.operator._mitigation import mitigation_message
from resilientjob.operator._redis_state import announcement
from resilientjob.operator.api import Reason, parse_spec
from resilientjob.operator.planning import plan_initial, planner_inputs
from resilientjob.planner.plan import Plan

SPEC = parse_spec(bert_spec_fields())


def _after_s2(factor: float) -> tuple[Plan, Plan]:
    inputs = planner_inputs(SPEC)
    healthy = plan_initial(SPEC, inputs)
    slow = healthy.pipelines[0].stages[0].node
    split = microbatch_plan(
        healthy,
        inputs.profile,
        inputs.cluster,
        {slow: factor},
        sync_time(healthy, inputs.profile, inputs.cluster),
    )
    assert isinstance(split, Plan), split
    return healthy, split


def test_a_revert_publishes_the_healthy_plan_again_under_node_slow() -> None:
    healthy, split = _after_s2(3.0)
    slow = healthy.pipelines[0].stages[0].node
    current = announcement(split, strategy="microbatch", restore=healthy)
    mitigation = Mitigation(Action.REVERT, {slow: 3.0}, "microbatch made the job slower", 5.0, 1.0)
    message = asyncio.run(mitigation_message(SPEC, planner_inputs(SPEC), current, mitigation, lambda _: True))
    assert not isinstance(message, str), message
    assert message.generation == split.generation + 1 and message.strategy == "revert"
    assert message.trigger == Reason.NODE_SLOW and "made the job slower" in message.reason
    counts = [p.microbatches for p in message.plan.pipelines]
    assert counts == [p.microbatches for p in healthy.pipelines] != [p.microbatches for p in split.pipelines]
    assert message.plan.transfers == ()


def test_a_revert_of_s3_publishes_the_healthy_placement_although_estimated_as_fast() -> None:
    # S3 moves nodes, not work: the planner estimates it exactly as fast as the healthy plan, so a restore
    # (which asks the healthy plan to be faster) would keep it. A revert undoes it anyway, copying back.
    inputs = planner_inputs(SPEC)
    healthy = plan_initial(SPEC, inputs)
    a, b = (pipeline.stages[0].node for pipeline in healthy.pipelines[:2])
    moved = link_plan(healthy, inputs.profile, inputs.cluster, [(a, b)], sync_s=0.0)
    assert isinstance(moved, Plan), moved
    current = announcement(moved, strategy="topology", restore=healthy)
    mitigation = Mitigation(
        Action.REVERT, {a: 2.0, b: 2.0}, "topology made the job slower", 5.0, 1.0, ((a, b),)
    )
    message = asyncio.run(mitigation_message(SPEC, inputs, current, mitigation, lambda _: True))
    assert not isinstance(message, str), message
    assert message.strategy == "revert" and message.restore == healthy
    assert message.plan.layers_by_node() == healthy.layers_by_node()
    if moved.layers_by_node() != healthy.layers_by_node():
        assert message.plan.transfers  # the weights S3 moved go back


def test_s2_splits_micro_batches_only_where_the_spec_allows_and_says_so() -> None:
    # The demo's first plan with worker 7 (a whole-model replica of two micro-batches of 4) at x1.5. Whole
    # micro-batches: it keeps one. With `microBatchSplit: 4` S2 cuts them to balance finer, and says so.
    body = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())["spec"]
    published = {}
    for split in (1, 4):
        spec = parse_spec({**body, "failSlow": {**body["failSlow"], "microBatchSplit": split}})
        inputs = planner_inputs(spec)
        current = announcement(plan_initial(spec, inputs), strategy="")
        mitigation = Mitigation(Action.MICROBATCH, {7: 1.5}, "node slow", 5.0, 1.0)
        message = asyncio.run(mitigation_message(spec, inputs, current, mitigation, lambda _: True))
        assert not isinstance(message, str), message
        assert message.plan.global_batch == spec.global_batch_size
        published[split] = message
        # The decision names the samples each replica had and has: what moved off the slow one.
        had = [p.microbatches * 4 for p in current.plan.pipelines]
        has = [p.microbatches * message.plan.microbatch_size for p in message.plan.pipelines]
        assert f"samples per replica {had} -> {has}" in message.reason, message.reason
        assert sum(has) == sum(had) and has != had
    assert published[1].plan.microbatch_size == 4 and "micro-batches of" not in published[1].reason
    finer = published[4].plan
    assert finer.microbatch_size < 4
    assert f"micro-batches of 4 -> {finer.microbatch_size} samples" in published[4].reason
    mine = [p.microbatches * finer.microbatch_size for p in finer.pipelines if 7 in p.nodes]
    assert mine == [min(p.microbatches * finer.microbatch_size for p in finer.pipelines)]  # the least work
