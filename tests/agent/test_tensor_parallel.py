"""Stages spanning several devices of a node: tensor-parallel workers on gloo, checked against one process.

Every test runs real worker processes through the launcher (k per node) and compares the committed losses
and the final parameters, gathered whole, with the single-process reference run of the same seed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_tracing import run_gloo

from resilientjob.agent._tensor_parallel import (
    _deinterleave,
    _interleave,
    full_parameters,
    shard_layer,
    stage_groups,
    tp_degree,
)
from resilientjob.agent.data import SampleOrder
from resilientjob.agent.models import load_model
from resilientjob.agent.p2p import LayerState, layer_state_bytes
from resilientjob.agent.profiler import measure_profile
from resilientjob.agent.runtime import check_supported
from resilientjob.agent.worker import JobConfig
from resilientjob.cli import main
from resilientjob.planner.errors import PlannerError
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan
from resilientjob.planner.profile import ModelProfile, uniform_profile
from resilientjob.protocol.workload import OutputSpec
from resilientjob.testing.launcher import JobResult, Launcher
from resilientjob.testing.plans import RuntimePlanner
from resilientjob.testing.reference import reference_run

pytestmark = pytest.mark.torch

GPT4 = {"layers": 4, "hidden": 32, "heads": 2, "vocab": 32, "seq_len": 16}
LLAMA_HIDDEN = 48
"""SwiGLU's inner width 4 * 48 * 2 // 3 = 128 splits evenly over two devices (hidden 32 gives 85: refused)."""


@pytest.fixture(scope="module")
def gpt_profile_4() -> ModelProfile:
    """Exact bytes of the 4-layer GPT (what a whole layer's transfer moves), nominal times."""
    return measure_profile(load_model("gpt", **GPT4), timed=False)


def _plan(*pipelines: tuple[tuple[tuple[int, int], int], ...], microbatches: int = 2) -> Plan:
    return Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=2,
        step_time_s=1.0,
        pipelines=tuple(
            PipelinePlan(
                stages=tuple(StagePlan(layers=layers, node=node, gpus=(0, 1)) for layers, node in stages),
                microbatches=microbatches,
            )
            for stages in pipelines
        ),
    )


def _assert_params_match(result: JobResult, params: dict[int, list[torch.Tensor]], lr: float) -> set[int]:
    """Every surviving node's gathered parameters equal the reference's; returns the layers seen."""
    held = set()
    for node, value in result.return_values.items():
        assert value["local_rank"] == 0 and not value["left"]
        for layer, tensors in value["params"].items():
            held.add(layer)
            for gathered, expected in zip(tensors, params[layer], strict=True):
                got, want = gathered.clone(), expected.clone()
                if got.shape == (3 * GPT4["hidden"],):  # the fused qkv bias
                    # The key bias has an exactly zero gradient (softmax ignores a per-query constant), so
                    # both runs update it from rounding noise, which Adam scales up to ~lr: compare it at lr.
                    keys = slice(GPT4["hidden"], 2 * GPT4["hidden"])
                    torch.testing.assert_close(got[keys], want[keys], rtol=0, atol=lr)
                    got[keys] = want[keys] = 0.0
                # 5e-5 against an lr of 3e-3: sharded matmuls sum in another order, and Adam turns the
                # rounding of a near-zero gradient into ~1e-5 on some CPUs; a wrong shard is off by ~lr.
                where = f"node {node} layer {layer}"
                torch.testing.assert_close(got, want, rtol=0, atol=5e-5, msg=lambda m, at=where: f"{at}: {m}")
    return held


def _run(
    tmp_path: Path, job_config: Callable[..., JobConfig], plan: Plan, steps: int, model: str = "gpt"
) -> JobResult:
    options = dict(GPT4, hidden=LLAMA_HIDDEN) if model == "llama" else dict(GPT4)
    config = job_config(model=model, model_options=options, steps=steps, return_state=True)
    reference, params, _ = reference_run(config, plan.global_batch, plan.microbatch_size)
    planner = RuntimePlanner.for_job(
        uniform_profile(4), nodes=len(plan.nodes), global_batch=plan.global_batch, microbatch_size=2
    )
    result = Launcher(config, plan, planner, tmp_path).run(timeout_s=90)
    assert sorted(result.losses) == list(range(steps))
    for step in range(steps):
        assert result.losses[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step
    held = _assert_params_match(result, params, config.workload.training.lr)
    assert held == set(range(4))
    return result


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_tp2_on_one_node_matches_single_process(
    tmp_path: Path, job_config: Callable[..., JobConfig], model: str
) -> None:
    # Llama: rotary attention on each rank's own heads, no biases, SwiGLU's gate and up column-sharded.
    plan = _plan((((0, 4), 0),), microbatches=2)
    assert tp_degree(plan) == 2
    result = _run(tmp_path, job_config, plan, steps=3, model=model)
    # Lane 0 alone reports sample ids: each sample of a step once, not once per device.
    assert all(len(ids) == plan.global_batch for ids in result.samples.values())


HF_LLAMA = (
    "hf:llama?num_hidden_layers=2&hidden_size=32&intermediate_size=64&num_attention_heads=4"
    "&num_key_value_heads=2&vocab_size=32&max_position_embeddings=16"
)
"""A transformers Llama of grouped-query attention: 4 query heads and 2 key/value heads, 2 of each a rank."""


def test_tp2_of_a_transformers_llama_matches_single_process(
    tmp_path: Path, job_config: Callable[..., JobConfig]
) -> None:
    pytest.importorskip("transformers")
    plan = _plan((((0, 2), 0), ((2, 4), 1)), microbatches=2)
    config = job_config(model=HF_LLAMA, model_options={}, steps=3, return_state=True)
    output, checkpoints = tmp_path / "trained", tmp_path / "ckpt"
    saved = config.workload.checkpoint.model_copy(update={"path": str(checkpoints), "interval_steps": 2})
    workload = config.workload.model_copy(
        update={"output": OutputSpec(path=str(output)), "checkpoint": saved}
    )
    config = dataclasses.replace(config, workload=workload)
    reference, params, _ = reference_run(config, plan.global_batch, plan.microbatch_size)
    planner = RuntimePlanner.for_job(
        uniform_profile(4), nodes=2, global_batch=plan.global_batch, microbatch_size=2
    )
    result = Launcher(config, plan, planner, tmp_path).run(timeout_s=90)
    assert sorted(result.losses) == [0, 1, 2]
    for step in range(3):
        assert result.losses[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step
    assert _assert_params_match(result, params, config.workload.training.lr) == set(range(4))
    # The export gathered every sharded layer over its stage's two devices: the files hold the whole
    # trained layers (a shard alone would not even have their shapes).
    exported = load_model(f"hf:{output}", seq_len=16)
    for index, tensors in params.items():
        for got, want in zip(exported.layer(index).parameters(), tensors, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # The last step's checkpoint holds each block in two shards; `rjob export` merges them, offline, into
    # the same model the job wrote.
    assert any(checkpoints.glob("step3/layer1-tp1of2"))
    assert main(["export", str(checkpoints), "--model", HF_LLAMA, "--out", str(tmp_path / "merged")]) == 0
    merged = load_model(f"hf:{tmp_path / 'merged'}", seq_len=16)
    for index in params:
        for got, want in zip(
            merged.layer(index).parameters(), exported.layer(index).parameters(), strict=True
        ):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_gpt2_block_of_transformers_is_refused_with_the_field_to_change() -> None:
    pytest.importorskip("transformers")

    class _Mesh:  # shard_layer reads only the size before refusing
        def size(self) -> int:
            return 2

    block = load_model("hf:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=32&n_positions=16").layer(1)
    with pytest.raises(
        ValueError, match=r"model: layer GPT2Block has no tensor-parallel plan.*gpusPerNode: 1"
    ):
        shard_layer(block, _Mesh())  # type: ignore[arg-type]


def test_two_nodes_tp2_pipeline_matches_single_process(
    tmp_path: Path, job_config: Callable[..., JobConfig]
) -> None:
    plan = _plan((((0, 2), 0), ((2, 4), 1)), microbatches=3)
    _run(tmp_path, job_config, plan, steps=3)


def test_mixed_degrees_and_rerouted_multi_device_stages_are_refused() -> None:
    mixed = Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=2,
        step_time_s=1.0,
        pipelines=(
            PipelinePlan(
                stages=(
                    StagePlan(layers=(0, 2), node=0, gpus=(0, 1)),
                    StagePlan(layers=(2, 4), node=1, gpus=(0,)),
                ),
                microbatches=1,
            ),
        ),
    )
    with pytest.raises(PlannerError, match=r"pipelines\[0\]\.stages\[1\]\.gpus"):
        check_supported(mixed)
    rerouted = Plan(
        policy=Policy.REROUTE,
        microbatch_size=2,
        step_time_s=1.0,
        pipelines=(
            PipelinePlan(stages=(StagePlan(layers=(0, 4), node=0, gpus=(0, 1)),), microbatches=1),
            PipelinePlan(
                stages=(StagePlan(layers=(0, 4), node=1, gpus=(0, 1), rerouted_to=(0,)),), microbatches=1
            ),
        ),
    )
    with pytest.raises(PlannerError, match=r"pipelines\[1\]\.stages\[0\]\.rerouted"):
        check_supported(rerouted)


def test_single_device_plans_keep_degree_one() -> None:
    plan = Plan(
        policy=Policy.DYNAMIC,
        microbatch_size=2,
        step_time_s=1.0,
        pipelines=(PipelinePlan(stages=(StagePlan(layers=(0, 4), node=0),), microbatches=1),),
    )
    assert check_supported(plan) == 1


def test_layers_without_a_tensor_parallel_plan_are_refused() -> None:
    class _Mesh:  # shard_layer reads only the size before refusing
        def size(self) -> int:
            return 2

    with pytest.raises(ValueError, match="model: layer Linear has no tensor-parallel plan"):
        shard_layer(torch.nn.Linear(4, 4), _Mesh())  # type: ignore[arg-type]


def test_uneven_projections_are_refused() -> None:
    class _Mesh:  # shard_layer reads only the size before refusing
        def size(self) -> int:
            return 2

    block = load_model("llama", **GPT4).layer(1)  # SwiGLU inner width 85
    with pytest.raises(ValueError, match="hidden: gate of LlamaBlock is 85 wide"):
        shard_layer(block, _Mesh())  # type: ignore[arg-type]


def test_qkv_interleave_gives_each_shard_whole_heads_and_round_trips() -> None:
    rows = torch.arange(12.0).reshape(12, 1)  # q rows 0..3, k rows 4..7, v rows 8..11; two shards
    mixed = _interleave(rows, 2)
    assert mixed.flatten().tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    assert torch.equal(_deinterleave(mixed, 2), rows)


def test_unsharded_full_parameters_and_bytes_are_the_layer_itself() -> None:
    model = load_model("gpt", **GPT4)
    block = model.layer(1)
    state = LayerState(1, block)
    assert [t.shape for t in full_parameters(block, 1)] == [p.shape for p in block.parameters()]
    assert state.nbytes() == sum(layer_state_bytes(block))


def test_kill_a_node_copies_shards_peer_to_peer(
    tmp_path: Path, gpt_profile_4: ModelProfile, job_config: Callable[..., JobConfig]
) -> None:
    steps = 5
    planner = RuntimePlanner.for_job(
        gpt_profile_4, nodes=3, global_batch=8, microbatch_size=2, dp_range=(2, 2), gpus_per_node=2
    )
    plan = planner.initial(Policy.DYNAMIC)
    assert plan.layout == "DP2 PP[2,1]" and tp_degree(plan) == 2
    lone = plan.pipelines[1].stages[0].node  # the single-stage replica: killing it forces copies both ways
    config = job_config(model_options=dict(GPT4), steps=steps, return_state=True)
    reference, params, _ = reference_run(config, plan.global_batch, plan.microbatch_size)
    launcher = Launcher(config, plan, planner, tmp_path, fail_at={lone: 2}, policy=Policy.DYNAMIC)
    result = launcher.run(timeout_s=120)
    assert [p.layout for p in result.plans] == ["DP2 PP[2,1]", "DP2 PP[1,1]"]
    assert result.recoveries[0].failed == (lone,) and not result.recoveries[0].restarted
    assert sorted(result.losses) == list(range(steps))
    for step in range(steps):
        assert result.losses[step] == pytest.approx(reference[step], rel=1e-4), step
    order = SampleOrder(128, plan.global_batch, seed=0)
    for step in range(steps):
        assert sorted(result.samples[step]) == sorted(order.step_ids(step)), step
    # Each planned transfer crossed once per lane (shard j from local rank j) and the shards sum to it.
    recovered = result.plans[1]
    assert recovered.transfer_bytes() > 0
    moved: dict[tuple[int, int, int], list[int]] = {}
    for layer, src, dst, size in result.received[1]:
        moved.setdefault((layer, src, dst), []).append(size)
    assert {key: sum(sizes) for key, sizes in moved.items()} == {
        (t.layer, t.src, t.dst): t.bytes for t in recovered.transfers
    }
    assert all(len(sizes) == 2 for sizes in moved.values())
    assert sorted(result.return_values) == sorted(recovered.nodes)
    assert _assert_params_match(result, params, config.workload.training.lr) == set(range(4))


def test_failure_beyond_f_restarts_every_shard_from_the_checkpoint(
    tmp_path: Path, gpt_profile_4: ModelProfile, job_config: Callable[..., JobConfig]
) -> None:
    steps, interval = 6, 2
    planner = RuntimePlanner.for_job(
        gpt_profile_4,
        nodes=2,
        global_batch=8,
        microbatch_size=2,
        fault_tolerance=0,
        dp_range=(1, 1),
        pp_range=(1, 2),
        gpus_per_node=2,
    )
    plan = planner.initial(Policy.DYNAMIC)
    assert plan.layout == "DP1 PP[2]" and tp_degree(plan) == 2
    ckpt = tmp_path / "ckpt"
    config = job_config(
        model_options=dict(GPT4), steps=steps, checkpoint_dir=str(ckpt), checkpoint_interval=interval
    )
    reference, _, _ = reference_run(config, plan.global_batch, plan.microbatch_size)
    # Node 1 alone holds layers 2..3: its loss leaves no live copy, so every worker restarts from disk.
    result = Launcher(config, plan, planner, tmp_path / "logs", fail_at={1: 3}).run(timeout_s=120)
    recovery = result.recoveries[0]
    assert recovery.restarted and result.plans[-1].policy == Policy.CHECKPOINT
    assert recovery.committed_before == 3  # steps 0..2 committed; the restart redoes step 2 from step2/
    assert result.plans[-1].layout == "DP1 PP[1]" and tp_degree(result.plans[-1]) == 2
    # Each (layer, shard) was written once, by the local rank that holds that shard (in the last step, the
    # one kept with the step before it).
    assert sorted(path.name for path in ckpt.glob("step*")) == ["step4", f"step{steps}"]
    written = sorted(path.name for path in (ckpt / f"step{steps}").iterdir())
    assert written == sorted(f"layer{i}-tp{j}of2" for i in range(4) for j in range(2))
    assert sorted(result.losses) == list(range(steps))
    for step in range(steps):
        assert result.losses[step] == pytest.approx(reference[step], rel=1e-4), step


def _lane_left_waiting(rank: int, world: int) -> float | str:
    """Two nodes' stages of two lanes each. Lane 0 of node 1 (rank 2) has given the step up; lane 1 (rank 3)
    waits for it in a tensor-parallel collective: the seconds until that wait fails."""
    import time

    import torch.distributed as dist

    groups = stage_groups(stages=2, degree=2, timeout_s=2.0)
    mine = groups[rank // 2]
    if rank != 3:
        time.sleep(8.0)  # rank 2 never joins the collective; the others outlive rank 3's wait
        return "not waiting"
    began = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=mine)
    except RuntimeError:
        return time.monotonic() - began
    return "the collective completed without its peer"


def test_a_lane_left_in_a_tensor_parallel_collective_gives_up_after_the_collective_timeout(
    tmp_path: Path,
) -> None:
    """A stage's lanes can part at a wait between nodes (a dead peer's lane 1 sent, its lane 0 did not).
    The lane left in a tensor-parallel collective gives up after the job's collective timeout, as its
    peer did; under torch's default of 30 minutes it held the whole job."""
    results = run_gloo(tmp_path, 4, _lane_left_waiting)
    assert results[:3] == ["not waiting"] * 3
    waited = results[3]
    assert isinstance(waited, float), waited
    assert 1.5 <= waited < 7.0
