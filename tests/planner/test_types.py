"""Data types validate on construction and name the bad field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from resilientjob.planner import (
    ClusterSpec,
    JobSpec,
    ModelProfile,
    PipelinePlan,
    Plan,
    PlannerError,
    Policy,
    StagePlan,
    builtin_profiles,
    uniform_profile,
)
from resilientjob.planner.estimator import estimate_pipeline


def _layer(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "forward_s": 0.1,
        "backward_s": 0.2,
        "param_bytes": 10,
        "optimizer_bytes": 20,
        "activation_bytes": 5,
    }
    base.update(overrides)
    return base


def test_profile_loads_json_and_yaml_with_extra_keys(tmp_path: Path) -> None:
    data = {"name": "m", "layers": [_layer(extra="ignored"), _layer(forward_s=0.3)], "profiler": "x"}
    (tmp_path / "p.json").write_text(json.dumps(data))
    (tmp_path / "p.yaml").write_text(
        "name: m\nlayers:\n"
        + "".join(
            f"  - {json.dumps(layer)}\n"
            for layer in data["layers"]  # type: ignore[attr-defined]
        )
    )
    for name in ("p.json", "p.yaml"):
        profile = ModelProfile.load(tmp_path / name)
        assert profile.num_layers == 2
        assert profile.stage_times(0, 2) == pytest.approx((0.4, 0.4))
        assert profile.state_bytes(1, 2) == 30


@pytest.mark.parametrize(
    ("layers", "field"),
    [
        ([_layer(forward_s=-1.0)], "profile.layers.0.forward_s"),
        ([_layer(param_bytes=-5)], "profile.layers.0.param_bytes"),
        ([{"forward_s": 1.0}], "profile.layers.0.backward_s"),
        ([], "profile.layers"),
    ],
)
def test_bad_profile_names_the_field(layers: list[dict[str, object]], field: str) -> None:
    with pytest.raises(PlannerError) as info:
        ModelProfile.from_mapping({"layers": layers})
    assert info.value.field == field


def test_missing_and_malformed_profile_files(tmp_path: Path) -> None:
    with pytest.raises(PlannerError, match="is no file and no built-in profile"):
        ModelProfile.load(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlannerError, match="not valid JSON"):
        ModelProfile.load(tmp_path / "bad.json")


def test_builtin_profiles_load_by_name() -> None:
    names = builtin_profiles()
    assert {"llama2-7b", "gpt3-2.7b", "gpt3-6.7b", "bert-large"} <= set(names)
    llama = ModelProfile.load("llama2-7b")
    assert llama.num_layers == 34  # embedding, 32 blocks, head
    assert 6e9 < llama.prefix("param")[-1] / 2 < 8e9  # bf16 bytes -> ~7B parameters


def test_multi_gpu_stage_is_faster() -> None:
    profile = uniform_profile(4)
    one = sum(profile.stage_times(0, 4, 1))
    four = sum(profile.stage_times(0, 4, 4))
    assert four == pytest.approx(one / (1 + 3 * 0.9))


def test_a_profile_rescaled_to_smaller_micro_batches_scales_time_and_activations_not_state() -> None:
    profile = uniform_profile(4, activation_bytes=1000).measured_at(4)
    half = profile.at_microbatch(2)
    assert half.microbatch_size == 2
    assert half.stage_times(0, 4) == pytest.approx(tuple(t / 2 for t in profile.stage_times(0, 4)))
    assert half.prefix("activation")[-1] == pytest.approx(profile.prefix("activation")[-1] / 2)
    assert half.state_bytes(0, 4) == profile.state_bytes(0, 4)  # weights do not shrink with the batch
    assert profile.at_microbatch(4) is profile
    # A profile that does not know its size cannot be rescaled: it is used as it is.
    unknown = uniform_profile(4)
    assert unknown.at_microbatch(1) is unknown
    with pytest.raises(PlannerError, match="microbatch_size"):
        profile.at_microbatch(0)
    assert profile == uniform_profile(4, activation_bytes=1000).measured_at(4)


def test_job_spec_rejects_indivisible_batch() -> None:
    with pytest.raises(ValidationError, match="not a multiple of microbatch_size"):
        JobSpec(global_batch=10, microbatch_size=4)
    assert JobSpec(global_batch=12, microbatch_size=4).num_microbatches == 3


def test_cluster_spec_bounds() -> None:
    with pytest.raises(ValidationError):
        ClusterSpec(nodes=0)
    with pytest.raises(ValidationError):
        ClusterSpec(nodes=2, inter_node_bandwidth=float("inf"))


def _plan(stages_a: list[tuple[int, int, int]], stages_b: list[tuple[int, int, int]]) -> Plan:
    def pipeline(stages: list[tuple[int, int, int]]) -> PipelinePlan:
        return PipelinePlan(
            stages=tuple(StagePlan(layers=(s, e), node=n) for s, e, n in stages), microbatches=4
        )

    return Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=2,
        pipelines=(pipeline(stages_a), pipeline(stages_b)),
        step_time_s=2.0,
    )


def test_plan_summary() -> None:
    plan = _plan([(0, 2, 0), (2, 4, 1)], [(0, 1, 2), (1, 3, 3), (3, 4, 4)])
    assert plan.layout == "DP2 PP[2,3]"
    assert plan.global_batch == 16
    assert plan.throughput == 8.0
    assert plan.nodes == (0, 1, 2, 3, 4)
    assert plan.layers_by_node()[3] == {1, 2}


def test_layout_of_thousands_of_pipelines_counts_depths_and_stays_short() -> None:
    shallow = [PipelinePlan(stages=(StagePlan(layers=(0, 4), node=n),), microbatches=1) for n in range(3000)]
    deep = [
        PipelinePlan(
            stages=(StagePlan(layers=(0, 2), node=3000 + 2 * i), StagePlan(layers=(2, 4), node=3001 + 2 * i)),
            microbatches=1,
        )
        for i in range(48)
    ]
    plan = Plan(policy=Policy.DYNAMIC, microbatch_size=1, pipelines=(*deep, *shallow), step_time_s=1.0)
    assert plan.layout == "DP3048 PP[1x3000,2x48]"
    assert len(plan.layout) < 64


def test_plan_rejects_gaps_and_double_booking() -> None:
    with pytest.raises(ValidationError, match="contiguous"):
        _plan([(0, 2, 0), (3, 4, 1)], [(0, 4, 2)])
    with pytest.raises(ValidationError, match="assigned to two stages"):
        _plan([(0, 2, 0), (2, 4, 1)], [(0, 4, 1)])
    with pytest.raises(ValidationError, match="different layer counts"):
        _plan([(0, 2, 0), (2, 4, 1)], [(0, 3, 2)])


def test_a_drained_pipeline_runs_no_micro_batch_and_its_nodes_are_idle() -> None:
    stages = (StagePlan(layers=(0, 2), node=2), StagePlan(layers=(2, 4), node=3))
    working = PipelinePlan(stages=(StagePlan(layers=(0, 4), node=0),), microbatches=4)
    drained = Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=2,
        step_time_s=1.0,
        pipelines=(working, PipelinePlan(stages=stages, microbatches=0)),
    )
    assert drained.global_batch == 8 and drained.nodes == (0, 2, 3) and drained.idle_nodes == (2, 3)
    # A working pipeline that reroutes a failed stage onto a drained replica's node keeps that node busy.
    rerouted = PipelinePlan(
        stages=(StagePlan(layers=(0, 2), node=4, rerouted_to=(2,)), StagePlan(layers=(2, 4), node=5)),
        microbatches=2,
    )
    busy = drained.model_copy(update={"pipelines": (*drained.pipelines, rerouted)})
    assert busy.idle_nodes == (3,)
    assert estimate_pipeline(uniform_profile(4), ClusterSpec(nodes=4), drained.pipelines[1]) == 0.0
    with pytest.raises(ValidationError, match="no pipeline runs a micro-batch"):
        Plan(
            policy=Policy.DYNAMIC,
            microbatch_size=2,
            step_time_s=1.0,
            pipelines=(PipelinePlan(stages=stages, microbatches=0),),
        )
