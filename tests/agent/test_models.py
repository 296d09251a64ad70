"""Models, data order, profiler, backend choice and the per-step schedule (single process, fast)."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from resilientjob.agent._runtime_schedule import OpKind, build_ops, chain, sync_groups
from resilientjob.agent.data import SampleOrder, SyntheticDataset
from resilientjob.agent.models import ModelConfig, ModelKind, load_model
from resilientjob.agent.p2p import LayerState, layer_state_bytes
from resilientjob.agent.profiler import measure_profile
from resilientjob.agent.runtime import backend_for
from resilientjob.cli import main as rjob
from resilientjob.planner.errors import PlannerError
from resilientjob.planner.failslow import link_load, reroute_slow_links
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan
from resilientjob.planner.profile import ModelProfile, uniform_profile
from resilientjob.testing.plans import RuntimePlanner

pytestmark = pytest.mark.serial  # the profiler times sleep layers within bounds


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_builtin_models_chain_layers_and_build_identically(kind: str) -> None:
    spec = load_model(kind, layers=5, hidden=16, heads=2, vocab=11, seq_len=6)
    x = torch.randint(11, (3, 6))
    for index in range(spec.num_layers):
        x = spec.layer(index)(x)
    assert x.shape == (3, 6, 11)
    first, again = spec.layer(2), spec.layer(2)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), again.parameters(), strict=True))
    flat = [torch.cat([p.reshape(-1) for p in spec.layer(i).parameters()]) for i in (1, 2)]
    assert not torch.equal(flat[0], flat[1])  # each layer has its own seed


def test_model_config_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="heads"):
        ModelConfig(hidden=10, heads=3)
    with pytest.raises(ValueError, match="layers"):
        ModelConfig(kind=ModelKind.GPT, layers=2)
    with pytest.raises(ValueError, match="model"):
        load_model("resnet")


def test_user_model_from_module_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_layers.py").write_text(
        textwrap.dedent(
            """
            import torch
            def build():
                return [torch.nn.Embedding(7, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 7)]
            def wide():
                return [torch.nn.Embedding(1000, 4), torch.nn.Linear(4, 1000)]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = load_model("my_layers:build", vocab=7, seq_len=5)
    assert spec.num_layers == 3
    assert spec.hidden_shape(2) == (2, 5, 4)
    # The vocabulary is the model's own (its embedding's rows, its head's logits), not the option's default:
    # token data for it was refused as "outside the model's vocabulary (32)".
    assert load_model("my_layers:build", seq_len=5).vocab == 7
    assert load_model("my_layers:wide", seq_len=5).vocab == 1000
    with pytest.raises(ValueError, match="model"):
        load_model("my_layers:missing")
    sys.modules.pop("my_layers", None)


def test_sleep_layers_take_calibrated_time() -> None:
    spec = load_model("sleep", layers=2, hidden=8, forward_sleep_s=0.01)
    x = spec.layer(0)(torch.randint(8, (1, 4)))
    begin = time.perf_counter()
    spec.layer(1)(x).sum().backward()
    elapsed = time.perf_counter() - begin
    assert 0.03 <= elapsed < 0.2  # 10 ms forward + 20 ms backward


def test_sleep_layers_per_sample_take_time_in_proportion_to_the_micro_batch() -> None:
    spec = load_model("sleep", layers=2, hidden=8, forward_sleep_s=0.005, sleep_samples=1)

    def seconds(samples: int) -> float:
        x = spec.layer(0)(torch.randint(8, (samples, 4)))
        begin = time.perf_counter()
        spec.layer(1)(x).sum().backward()
        return time.perf_counter() - begin

    one, four = seconds(1), seconds(4)
    assert 0.015 <= one < 0.1 and 0.06 <= four < 0.3  # 5 ms forward + 10 ms backward per sample
    assert four > 2.5 * one
    with pytest.raises(ValueError, match="sleep_samples"):
        load_model("sleep", sleep_samples=-1)


def test_dataset_is_deterministic_and_learnable_shape() -> None:
    data = SyntheticDataset(num_samples=10, seq_len=8, vocab=5, seed=3)
    assert torch.equal(data.sample(4), SyntheticDataset(10, 8, 5, seed=3).sample(4))
    assert not torch.equal(data.sample(4), data.sample(5))
    inputs, targets = data.batch([1, 2])
    assert inputs.shape == targets.shape == (2, 8)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_every_sample_once_per_epoch_for_any_batch_split() -> None:
    order = SampleOrder(num_samples=24, global_batch=8, seed=1)
    epoch0 = [i for step in range(3) for i in order.step_ids(step)]
    assert sorted(epoch0) == list(range(24))
    assert order.step_ids(3) != order.step_ids(0)  # the next epoch is reshuffled
    split = [i for mb in range(4) for i in order.microbatch_ids(2, mb, 2)]
    assert split == order.step_ids(2)


def test_backend_by_device() -> None:
    assert backend_for("cpu") == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    with pytest.raises(ValueError, match="torch_npu"):
        backend_for("npu:0")  # HCCL needs torch_npu, imported only when an NPU is asked for
    with pytest.raises(ValueError, match="device"):
        backend_for("meta")


def test_profile_bytes_match_what_a_layer_sends(tmp_path: Path) -> None:
    spec = load_model("gpt", layers=4, hidden=16, heads=2, vocab=9, seq_len=4)
    profile = measure_profile(spec, repeats=1)
    for index, layer in enumerate(profile.layers):
        state = LayerState(index, spec.layer(index))
        assert layer.state_bytes == state.nbytes()
        assert (layer.param_bytes, layer.optimizer_bytes) == layer_state_bytes(state.module)
        assert layer.forward_s > 0 and layer.backward_s > 0
    out = tmp_path / "p.json"
    assert rjob(["profile", "gpt", "--layers", "4", "--hidden", "16", "--heads", "2", "--out", str(out)]) == 0
    assert ModelProfile.load(out).num_layers == 4
    assert rjob(["profile", "nonsense"]) == 2


def _stage(start: int, end: int, node: int, **extra: object) -> StagePlan:
    return StagePlan(layers=(start, end), node=node, **extra)  # type: ignore[arg-type]


def test_schedule_is_1f1b_for_one_pipeline_and_covers_rerouted_work() -> None:
    plan = Plan(
        policy=Policy.REROUTE,
        microbatch_size=1,
        step_time_s=1,
        pipelines=(
            PipelinePlan(stages=(_stage(0, 2, 0), _stage(2, 4, 1)), microbatches=3),
            PipelinePlan(stages=(_stage(0, 2, 2, rerouted_to=(0,)), _stage(2, 4, 3)), microbatches=3),
        ),
    )
    ops = build_ops(plan)
    assert [f"{op.kind}{op.microbatch}" for op in ops[1]] == ["F0", "B0", "F1", "B1", "F2", "B2"]
    # Node 0 runs both pipelines' first stage: 2 x 3 micro-batches, forward and backward each.
    assert sorted((op.pipeline, op.kind) for op in ops[0]).count((1, OpKind.FORWARD)) == 3
    assert len(ops[0]) == 12 and 2 not in ops
    groups = sync_groups(plan)
    assert {(g.layers, g.holders) for g in groups} == {((0, 2), (0,)), ((2, 4), (1, 3))}


def test_sync_groups_keep_the_holders_in_pipeline_order() -> None:
    """The all-reduce ring runs in this order, so a fail-slow topology change that moves a slow link off the
    data-parallel ring (pipelines reordered) really takes it off: sorting the holders would put it back."""
    plan = Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=1,
        step_time_s=1,
        pipelines=tuple(
            PipelinePlan(stages=(_stage(0, 2, first), _stage(2, 4, second)), microbatches=1)
            for first, second in ((6, 1), (0, 7), (4, 3), (2, 5))
        ),
    )
    holders = {g.layers: g.holders for g in sync_groups(plan)}
    assert holders == {(0, 2): (6, 0, 4, 2), (2, 4): (1, 7, 3, 5)}


def test_the_rings_the_runtime_builds_are_the_rings_s3_scores() -> None:
    """`planner.failslow.link_load` (what S3 (a) minimises) counts a ring hop exactly where the runtime's
    all-reduce groups put two holders next to each other, on an asymmetric layout after S3 reordered it."""
    profile = uniform_profile(4)
    plan = Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=1,
        step_time_s=1,
        pipelines=(
            PipelinePlan(stages=(_stage(0, 2, 0), _stage(2, 4, 1)), microbatches=2),
            PipelinePlan(stages=(_stage(0, 2, 2), _stage(2, 4, 3)), microbatches=2),
            PipelinePlan(stages=(_stage(0, 4, 4),), microbatches=2),
            PipelinePlan(stages=(_stage(0, 4, 5),), microbatches=2),
        ),
    )
    moved = reroute_slow_links(plan, profile, [(0, 2)]).plan
    for layout in (plan, moved):
        neighbours = set()
        for group in sync_groups(layout):
            ring = group.holders
            neighbours |= {
                frozenset((a, ring[(i + 1) % len(ring)])) for i, a in enumerate(ring) if len(ring) > 1
            }
        for a in layout.nodes:
            for b in set(layout.nodes) - {a}:
                # uniform_profile sends no activations: the load is the ring's alone.
                on_ring = frozenset((a, b)) in neighbours
                assert (link_load(layout, profile, [(a, b)]) > 0) == on_ring, (layout.layout, a, b)
    assert frozenset((0, 2)) not in {
        frozenset((g.holders[i], g.holders[(i + 1) % len(g.holders)]))
        for g in sync_groups(moved)
        for i in range(len(g.holders))
    }


def test_heterogeneous_sync_groups_follow_colour_rounds() -> None:
    planner = RuntimePlanner.for_job(uniform_profile(8), nodes=8, global_batch=8, microbatch_size=1)
    plan = planner.recover(planner.initial(Policy.DYNAMIC), [3], Policy.DYNAMIC)
    groups = sync_groups(plan)
    for number in {g.round for g in groups}:
        members = [node for g in groups if g.round == number for node in g.holders]
        assert len(members) == len(set(members))  # one all-reduce per node per round
    covered = sorted(layer for g in groups for layer in range(*g.layers))
    assert covered == list(range(8))


def _gpt_planner(**options: object) -> RuntimePlanner:
    profile = measure_profile(
        load_model("gpt", layers=8, hidden=32, heads=2, vocab=32, seq_len=16), timed=False
    )
    return RuntimePlanner.for_job(profile, nodes=8, global_batch=16, microbatch_size=2, **options)  # type: ignore[arg-type]


def test_rerouted_stage_runs_across_a_peer_pipeline_with_other_boundaries() -> None:
    planner = _gpt_planner(fault_tolerance=2, dp_range=(3, 3))
    plan = planner.initial(Policy.DYNAMIC)
    assert plan.layout == "DP3 PP[3,3,2]"
    rerouted = planner.recover(plan, [1, 4], Policy.REROUTE)
    assert rerouted.policy == Policy.REROUTE and rerouted.transfers == ()
    # Layers 3..5 of the dead nodes live on node 6 (layers 0..3) and node 7 (layers 4..7) of pipeline 2.
    segments = [(segment.layers, segment.node) for segment in chain(rerouted, 0, 0)]
    assert segments == [((0, 3), 0), ((3, 4), 6), ((4, 6), 7), ((6, 8), 2)]
    ops = build_ops(rerouted)
    assert set(ops) == set(rerouted.nodes)
    served = sorted(op.microbatch for op in ops[6] if op.pipeline != 2 and op.kind == OpKind.FORWARD)
    assert served == list(range(6))  # every micro-batch of pipelines 0 and 1 passes node 6 once
    holders = {g.layers: g.holders for g in sync_groups(rerouted)}
    assert holders[(3, 4)] == (6,) and holders[(0, 3)] == (0, 3, 6)


def test_runtime_planner_is_the_planner_search() -> None:
    planner = _gpt_planner(dp_range=(2, 2))
    plan = planner.initial()
    assert plan.layout == "DP2 PP[4,4]"
    chosen = planner.recover(plan, [5])  # auto: Odyssey's score decides
    assert chosen.policy == max(chosen.candidates, key=lambda c: c.score).policy
    assert {c.policy for c in chosen.candidates} >= {Policy.REROUTE, Policy.DYNAMIC, Policy.CHECKPOINT}
    rerouted = planner.recover(plan, [1], Policy.REROUTE)
    assert [s.rerouted_to for s in rerouted.pipelines[0].stages if s.node == 1] == [(5,)]
    dynamic = planner.recover(plan, [1], Policy.DYNAMIC)
    # Every alive node, or a symmetric layout that idles one when the estimate says it is faster (the
    # dynamic search weighs the checkpoint candidate's layouts too, issue #14).
    assert 1 not in dynamic.nodes and len(dynamic.nodes) >= 6
    assert dynamic.transfer_bytes() > 0 and dynamic.global_batch == plan.global_batch
    lost = planner.recover(plan, [1, 5])  # both replicas of layers 2..3: only a checkpoint restores them
    assert lost.policy == Policy.CHECKPOINT and not {1, 5} & set(lost.nodes)
    upgraded = planner.upgrade(rerouted)
    assert upgraded.policy == Policy.DYNAMIC and 1 not in upgraded.nodes


def test_mixed_device_counts_are_refused_at_plan_apply() -> None:
    from resilientjob.agent.runtime import check_supported

    plan = Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=1,
        step_time_s=1,
        pipelines=(PipelinePlan(stages=(_stage(0, 2, 0, gpus=(0, 1)), _stage(2, 4, 1)), microbatches=2),),
    )
    with pytest.raises(PlannerError, match=r"pipelines\[0\]\.stages\[1\]\.gpus"):
        check_supported(plan)
