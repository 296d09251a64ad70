"""`ClusterSpec.message_latency_s`: every pipeline hop and every ring all-reduce step costs it besides its
bytes; the default 0 leaves every estimate as it was (bandwidth only)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from resilientjob.planner.estimator import allreduce_time, estimate_pipeline, pipeline_time, send_time
from resilientjob.planner.plan import PipelinePlan, StagePlan
from resilientjob.planner.profile import uniform_profile
from resilientjob.planner.spec import ClusterSpec


def _pipeline(stages: int, layers: int, microbatches: int) -> PipelinePlan:
    per = layers // stages
    return PipelinePlan(
        stages=tuple(StagePlan(layers=(s * per, (s + 1) * per), node=s) for s in range(stages)),
        microbatches=microbatches,
    )


def test_default_latency_is_zero_and_keeps_bandwidth_only_estimates() -> None:
    profile = uniform_profile(8)
    plain = ClusterSpec(nodes=4)
    assert plain.message_latency_s == 0.0
    size = profile.layers[3].output_bytes
    assert send_time(profile, plain, 3, same_node=False) == size / plain.inter_node_bandwidth


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_one_microbatch_pays_two_hops_per_stage_boundary(stages: int) -> None:
    profile = uniform_profile(8)
    latency = 0.004
    slow = ClusterSpec(nodes=stages, message_latency_s=latency)
    fast = ClusterSpec(nodes=stages)
    pipeline = _pipeline(stages, 8, 1)
    # One micro-batch crosses every boundary once forward and once backward, all on the critical path.
    extra = estimate_pipeline(profile, slow, pipeline) - estimate_pipeline(profile, fast, pipeline)
    assert extra == pytest.approx(2 * (stages - 1) * latency)


def test_latency_grows_with_microbatches_in_1f1b() -> None:
    forward, backward = [0.01] * 2, [0.02] * 2
    times = [pipeline_time(forward, backward, 8, [latency]) for latency in (0.0, 0.001, 0.002)]
    assert times[0] < times[1] < times[2]
    # Each 1F1B pair of the steady state waits for a round trip: more than the 2 hops of one micro-batch.
    assert times[1] - times[0] > 2 * 0.001


def test_allreduce_pays_two_replicas_minus_one_messages_per_round() -> None:
    profile = uniform_profile(8)
    rounds = [[(0, 4)], [(4, 8)]]
    slow = ClusterSpec(nodes=4, message_latency_s=0.003)
    fast = ClusterSpec(nodes=4)
    extra = allreduce_time(profile, slow, rounds, 3) - allreduce_time(profile, fast, rounds, 3)
    assert extra == pytest.approx(2 * 2 * 2 * 0.003)
    assert allreduce_time(profile, slow, rounds, 1) == 0.0


def test_negative_latency_is_refused() -> None:
    with pytest.raises(ValidationError, match="message_latency_s"):
        ClusterSpec(nodes=2, message_latency_s=-1.0)
