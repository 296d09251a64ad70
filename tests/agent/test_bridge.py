"""The bridge from the control plane to the training runtime: the pure parts (options, which nodes a
generation drops, which models train for real), and the local stack running a real 4-node GPT job through a
pod kill: training goes on under the new generation, the loss keeps falling, and every step processes
exactly its own global batch (no sample lost or repeated).

The pod killed is node 0's, the one that hosted the job's store before the store had a pod of its own
(issue #14): the store lives in the job's store pod, the kill takes every process of the killed pod (as a
container crash does), and the job neither loses its store nor stops."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import redis
import yaml
from _bridge_jobs import apply_demo_job
from _support import rjob_ok, until

from resilientjob.agent._bridge import wants_training
from resilientjob.agent._runtime_schedule import world_nodes
from resilientjob.agent.config import POD_PLAN_TIMEOUT_S, JobConfig
from resilientjob.agent.models import ModelKind
from resilientjob.agent.store_host import dropped_nodes
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan
from resilientjob.protocol.keys import JobKeys
from resilientjob.protocol.messages import PlanAnnouncement
from resilientjob.protocol.models import TOY_MODELS, ModelSource, model_source
from resilientjob.protocol.store_keys import samples_key, trained_samples
from resilientjob.protocol.workload import Workload

ROOT = Path(__file__).resolve().parents[2]


# ---- pure parts ----------------------------------------------------------------------------------------
def test_model_names_say_train_or_simulate_never_a_silent_fallback() -> None:
    assert {kind.value for kind in ModelKind} == TOY_MODELS
    trained = [
        "gpt",
        "pkg.mod:layers",
        "llama2-7b",
        "gpt3-2.7b",
        "hf:/models/x",
        "hf:./x",
        "hf:gpt2?n_layer=2",
    ]
    assert all(model_source(model) is not ModelSource.SYNTHETIC for model in trained)
    assert all(wants_training(model) for model in trained)
    assert model_source("synthetic:bert-large") is ModelSource.SYNTHETIC
    assert not wants_training("synthetic:bert-large")
    with pytest.raises(ValueError, match="synthetic:bert-large"):
        wants_training("bert-large")
    with pytest.raises(ValueError, match="synthetic:bert-large"):
        model_source("bert-large")
    with pytest.raises(ValueError, match="names no model"):
        model_source("uniform-8")


def test_a_pods_flags_make_its_config_and_bad_ones_are_named() -> None:
    workload = Workload(model="gpt")
    config = JobConfig.from_argv(
        ["--collective-timeout", "7", "--model-option", "hidden=64", "--model-option", "x=0.5"], workload
    )
    assert config.collective_timeout_s == 7 and config.model_options == {"hidden": 64, "x": 0.5}
    assert config.workload is workload
    defaults = JobConfig(workload=workload, plan_timeout_s=POD_PLAN_TIMEOUT_S)
    assert JobConfig.from_argv([], workload) == defaults
    with pytest.raises(ValueError, match="--model-option"):
        JobConfig.from_argv(["--model-option", "hidden"], workload)
    with pytest.raises(ValueError, match="unknown --bogus"):
        JobConfig.from_argv(["--bogus"], workload)
    with pytest.raises(ValueError, match=r"now spec\.training\.steps"):
        JobConfig.from_argv(["--steps", "7"], workload)
    with pytest.raises(ValueError, match="plan_timeout_s"):
        JobConfig.from_argv(["--plan-timeout", "0"], workload)


def _plan(nodes: list[int], generation: int = 0) -> Plan:
    pipelines = tuple(
        PipelinePlan(stages=(StagePlan(layers=(0, 4), node=node, gpus=(0,)),), microbatches=2)
        for node in nodes
    )
    return Plan(
        policy=Policy.DYNAMIC, generation=generation, microbatch_size=1, pipelines=pipelines, step_time_s=1.0
    )


def test_dropped_nodes_counts_deaths_not_parked_nodes() -> None:
    before = _plan([0, 1, 2, 3])
    after = PlanAnnouncement(
        generation=1, layout="", policy="dynamic", plan=_plan([0, 3], 1), published_at=0.0, parked=[1]
    )
    assert dropped_nodes(before, after) == {2}
    assert dropped_nodes(None, after) == set()


# ---- the local stack with real training ------------------------------------------------------------------
@pytest.mark.torch
@pytest.mark.cluster
@pytest.mark.slow
def test_pod_kill_training_continues_on_the_next_generation(stack: Path, tmp_path: Path) -> None:
    from torch._C._distributed_c10d import TCPStore

    from resilientjob.agent.data import SampleOrder

    # The demo turns replacement pods off; here node 0's replacement joins.
    manifest, client, keys, store = apply_demo_job(stack, tmp_path, "bridge", replaceFailedNodes=True)
    address = client.get(keys.store)
    assert address is not None
    # The store is served by the store pod's process, which registered the address it serves.
    store_log = (stack / "pods" / "bridge-store" / "log").read_text()
    assert f"store at {address.decode()}" in store_log, store_log

    def committed() -> int:
        return int(store.add("committed", 0))

    def published() -> PlanAnnouncement:
        return PlanAnnouncement.model_validate_json(client.get(keys.plan) or b"")

    until(lambda: committed() >= 20, 40, "20 committed steps on 4 workers")
    # Node 0 is world rank 0, the rank that records each committed step's loss (checked below).
    assert world_nodes(published().plan)[0] == 0
    killed_at = committed()
    pod_pid = int((stack / "pods" / "bridge-node-0" / "pid").read_text())
    assert len(_group(pod_pid)) > 1, "the agent runs its workers in its pod's process group"
    rjob_ok(stack, "chaos", "kill", "bridge-node-0")
    until(lambda: not _group(pod_pid), 10, "every process of the killed pod gone")

    def without_node_0() -> PlanAnnouncement | None:
        current = published()
        return current if current.generation >= 1 and 0 not in current.plan.nodes else None

    recovered = until(without_node_0, 20, "a generation without node 0")
    # The failure's generation; or already the next one, where node 0's replacement (a new pod under node
    # id 4, `operator/_capacity.py`) joined.
    assert (recovered.trigger, recovered.nodes) in (("NodeFailed", [0]), ("NodeJoined", [4]))
    assert committed() >= killed_at

    def grown_back() -> PlanAnnouncement | None:
        current = published()
        return current if 4 in current.plan.nodes else None

    # The replacement loads the model, says it can rendezvous, and the store publishes the plan that takes
    # it in: it gets its layers from its peers and trains on at the job's step.
    recovered = until(grown_back, 60, "node 4 (the replacement) in the layout")
    assert recovered.trigger == "NodeJoined" and recovered.nodes == [4]
    until(lambda: store.check([f"event/applied/{recovered.generation}/4"]), 60, "node 4 joined")
    replanned_at = committed()
    until(lambda: committed() >= replanned_at + 30, 90, "30 steps after the new generation")
    end = committed()
    assert int(store.add("failures", 0)) == 1  # the store host announced the death once

    def loss(step: int) -> tuple[int, float]:
        generation, value = store.get(f"loss/{step}").decode().split(":")
        return int(generation), float(value)

    # Node 0 (world rank 0) records each committed step's loss: had it died between a commit and its
    # record, the next world's rank 0 records that loss at the rendezvous. Every step has its record.
    unrecorded = [step for step in range(end) if not store.check([f"loss/{step}"])]
    assert unrecorded == [], unrecorded
    losses = [loss(step) for step in range(end)]
    after = [value for generation, value in losses if generation >= recovered.generation]
    assert len(after) >= 30, "training did not go on under the new generation"
    first, last = sum(v for _, v in losses[:15]) / 15, sum(after[-15:]) / 15
    assert last < 0.9 * first, (first, last)
    spec = manifest["spec"]
    order = SampleOrder(spec["data"]["numSamples"], spec["globalBatchSize"], seed=0)
    for step in range(end):
        # Each sample of the step's global batch exactly once: nothing repeated across the failure, and
        # nothing missing (a worker records its ids before it votes, so a committed step's record is whole
        # even when the killed worker died right after committing).
        ids = trained_samples(store.get(samples_key(step)).decode())
        assert sorted(ids) == sorted(order.step_ids(step)), f"step {step}"

    # The store pod itself dies: the operator creates it again, the new host takes the plan and the failure
    # count over from Redis and registers its address, the workers reconnect, and the operator commits the
    # same layout as the next generation so that every worker rendezvouses again on the new store. No worker
    # is lost or restarted, none is fenced, and training goes on from the step it had reached.
    workers = {n: int((stack / "pods" / f"bridge-node-{n}" / "pid").read_text()) for n in (1, 2, 3, 4)}
    rjob_ok(stack, "chaos", "kill", "bridge-store")

    def moved() -> bytes | None:
        now = client.get(keys.store)
        return now if now and now != address else None

    new_address = until(moved, 60, "the re-created store pod's address").decode()
    host, _, port = new_address.rpartition(":")
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    # A commit in flight when the store died may complete for some workers and be lost for others: those
    # behind apply it at the new store's rendezvous (`_runtime_commit.agree_on_step`), nobody stops.
    until(lambda: store.check(["committed"]) and committed() >= end + 20, 60, "20 steps on the new store")
    again = published()
    assert again.generation == recovered.generation + 1 and again.layout == recovered.layout
    assert again.trigger == "Replanned" and again.nodes == [] and "store pod was replaced" in again.reason
    assert int(store.add("failures", 0)) == 1
    assert all(_group(pid) for pid in workers.values()), "a worker pod died with the store"
    assert {int((stack / "pods" / f"bridge-node-{n}" / "pid").read_text()) for n in workers} == set(
        workers.values()
    )
    logs = "".join((stack / "pods" / f"bridge-node-{n}" / "log").read_text() for n in (1, 2, 3, 4))
    assert "store: reconnected to" in logs and "Traceback" not in logs
    client.close()


@pytest.mark.torch
@pytest.mark.cluster
@pytest.mark.slow
def test_two_devices_per_node_train_tensor_parallel_to_the_end_and_the_job_succeeds(
    stack: Path, tmp_path: Path
) -> None:
    """The pod path with a stage spanning both devices of a node (one worker process per device, tensor
    parallel), trained to `spec.training.steps`: the workers exit cleanly and the job ends Succeeded, not as
    failures."""
    manifest = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    manifest["metadata"]["name"] = "tp"
    manifest["spec"].update(nodes=2, gpusPerNode=2, faultTolerance=0)
    manifest["spec"]["training"]["steps"] = 12
    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump(manifest))
    rjob_ok(stack, "apply", "-f", str(path))
    state = json.loads((stack / "state.json").read_text())
    client = redis.Redis.from_url(state["redis_url"])
    keys = JobKeys("default", "tp")

    def phase() -> str | None:
        rows = [line.split()[1:] for line in rjob_ok(stack, "get").splitlines()]  # after the namespace
        row = next((r for r in rows if r and r[0] == "tp"), None)
        return row[1] if row and row[1] in ("Succeeded", "Failed") else None

    assert until(phase, 90, "the job to finish") == "Succeeded"
    published = PlanAnnouncement.model_validate_json(client.get(keys.plan) or b"")
    assert published.generation == 0, "finishing must not look like a failure to the operator"
    assert {len(stage.gpus) for p in published.plan.pipelines for stage in p.stages} == {2}
    node = published.plan.pipelines[-1].stages[-1].node
    log = rjob_ok(stack, "logs", f"tp-node-{node}")
    assert "step 12 gen 0" in log, log[-2000:]
    client.close()


def _group(pgid: int) -> list[int]:
    """Live processes of the process group `pgid` (zombies count as gone)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry))
    return found


def test_an_abort_reports_its_plans_wait_bound_for_the_operators_hang_window(tmp_path: Path) -> None:
    """The operator judges a node hung after twice the timeout its peers' aborts report (`operator/_aborts`).
    A plan of 4 s steps has its waits bounded by three steps, not the job's 5 s collective timeout: that is
    what the abort must say, or the operator fences healthy nodes that still wait within their bound."""
    from resilientjob.agent._bridge import _ProbeHooks

    sink = tmp_path / "sink"
    hooks = _ProbeHooks(0, str(sink), None, collective_timeout_s=5.0, plan_timeout_s=60.0)
    hooks.on_plan(_plan([0, 1], generation=3).model_copy(update={"step_time_s": 4.0}))
    hooks.on_abort(3, 7, "PeerFailure: gradient all-reduce: no progress within 12.0 s")
    hooks.on_abort(2, 5, "PeerFailure: an older generation, whose plan this worker never applied")
    hooks.on_plan(_plan([0, 1], generation=4))  # 1 s steps: the timeout is the longer
    hooks.on_abort(4, 9, "PeerFailure: commit: no progress within 5.0 s")
    hooks.probe.sink.close()
    with sink.open() as lines:
        reported = {line["generation"]: line["collective_timeout_s"] for line in map(json.loads, lines)}
    assert reported == {3: 12.0, 2: 5.0, 4: 5.0}
