"""Fail-slow end to end on the local stack (issue 7): the real kopf operator against kmock, Redis, the process
kubelet and real gloo workers of the `sleep` model (calibrated-sleep layers, so that 2 shared cores give
stable step times): a job of 4 data-parallel groups, or with `--pipelined` 8 nodes as DP4 x PP2. Chaos orders
go through `rjob local chaos slow`.

Scenarios (`--scenario`):
- `compute`: node 1's compute slowed 1.5x (4 nodes, DP4; `--factor`, `--slow-node`, and `--manifest` for
  another job, e.g. the demo's real GPT; `--threshold` overrides the job's slowdownThreshold). Prints the
  detection delay in iterations (first SlowReport of the slowed node after the order, and when the operator
  opened its episode), the mitigation's delay (first step under its plan), the share of the slowdown the
  mitigation removed and the rungs the operator declined with its reasons. The share removed is given in
  both measures: of the step time's slowdown, as Falcon measures it ("1.9x to 1.2x", the slowed and the
  mitigated step time against the healthy one: `step_time_slowdown_removed`), and of the lost throughput,
  (mitigated - slow) / (healthy - slow) (`slowdown_removed`, the figure the docs gave before both were
  printed); a large slowdown halved is 75% of the first and 50% of the second. The order's onset is the
  slowed node's first step that held chaos delay (`IterationRecord.chaos_s`).
- `link`: the DP4 x PP2 job (8 nodes, `--pipelined` implied; or `--manifest` for another pipelined job,
  e.g. the demo's real GPT): the link between stage 0 of pipelines 0 and 1 (a data-parallel link)
  congested 5x; prints the detection delay, the validation result (the link
  named, training held), the plan change and the slowdown removed.
- `mixed`: Falcon Fig. 17 on the same layout with two micro-batches per pipeline (`MIXED_MICROBATCHES`,
  held to PP2 by `deviceMemory`) and small strategy overheads (`OVERHEADS`): the DP link slow, then a GPU
  slow, both persisting past the escalation to S4; writes throughput over time with the
  injections and mitigations marked to JSON and PNG (`--out`, default docs/img/failslow-mixed.png).
- `healthy`: no order for `--minutes` (the bench's job, or `--manifest examples/demo.yaml`); counts the
  SlowReports, those that opened an episode or were dismissed, and the mitigations; judges each episode by
  the job's own step times around its onset; ends with a VERDICT line (CLEAN, REAL SLOWDOWNS ONLY or FALSE
  ALARM, see `healthy_verdict`).

Usage: .venv/bin/python bench/bench_failslow_e2e.py --scenario compute
       .venv/bin/python bench/bench_failslow_e2e.py --scenario link
       .venv/bin/python bench/bench_failslow_e2e.py --scenario mixed
The 30-minute healthy run of issue 7 with the demo job:
       .venv/bin/python bench/bench_failslow_e2e.py --scenario healthy --minutes 30 --manifest X
with X = examples/demo.yaml.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import yaml

from resilientjob.agent import chaos
from resilientjob.operator.api import FailSlowSpec
from resilientjob.planner.failslow import slowdown_removed
from resilientjob.planner.restorer import allreduce_rounds
from resilientjob.protocol.chaos import ChaosOrder
from resilientjob.protocol.keys import JobKeys
from resilientjob.protocol.messages import IterationRecord, PlanAnnouncement, SlowReport, ValidationResult

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from _support import rjob_local  # noqa: E402

JOB = "failslow"
LAYERS = 8
FORWARD_S = 0.002
MICROBATCHES_PER_NODE = 8
"""Sleep per layer per micro-batch forward (backward twice): 8 layers x 8 micro-batches -> ~400 ms steps.
Eight micro-batches per node give S2 room: one slow node can hand a few of its micro-batches to the others.
Sleeps of 1 ms were too short on the loaded machine (compute CV 6-9% against 2% with 3 ms sleeps)."""


PIPELINED_LAYERS = 16
PIPELINED_FORWARD_S = 0.005
PIPELINED_HIDDEN = 4096
"""The DP4 x PP2 job (`--pipelined`): 16 sleep layers of hidden 4096 and sequence length 1, so that a
stage's gradients (8 x 16 KB) are 8 times one micro-batch's activations (16 KB): the gradient all-reduce
is the heavy traffic, as in real training, and a congested link hurts far less on a pipeline path.
Four micro-batches of one sample per step allow at most 4 replicas: the 8 nodes form 4 pipelines of 2."""

LINK_LATENCY_S = 0.0
LINK_BANDWIDTH_BPS = 2e6
"""The congested link's nominal figures (`--latency/--bandwidth` of `rjob local chaos slow --link`): no
per-message latency, so that the job's tiny control all-reduces over the world group are not slowed, and a
bandwidth at which a factor of 5 adds 4 x 128 KB / 2 MB/s = 0.26 s to each all-reduce of the stage's
gradients but 4 x 16 KB / 2 MB/s = 33 ms to a pipeline send."""


def manifest(
    nodes: int, pipelined: bool = False, mixed: bool = False, microbatch_size: int = 1, split: int = 1
) -> dict[str, Any]:
    """The bench's job: DP over `nodes` whole-model replicas, or the DP4 x PP2 job (`pipelined`), or the
    mixed case's (`mixed`): the pipelined job with `MIXED_MICROBATCHES` micro-batches, held to PP2 by
    `deviceMemory`, so that S2 can move a micro-batch off a slow pipeline. `microbatch_size` > 1 (the
    replicas' job only): the same samples per node in micro-batches of that size, the sleeps per sample (a
    device whose compute grows with the batch); `split`: the job's `failSlow.microBatchSplit`."""
    layers, forward_s = (PIPELINED_LAYERS, PIPELINED_FORWARD_S) if pipelined else (LAYERS, FORWARD_S)
    if microbatch_size > 1 and pipelined:
        raise ValueError("microbatch_size: only the replicas' job takes micro-batches of several samples")
    layer = {
        "forwardS": forward_s * microbatch_size,
        "backwardS": 2 * forward_s * microbatch_size,
        "paramBytes": 4352,
        "optimizerBytes": 8716,
        "activationBytes": 1024 * microbatch_size,
        "outputBytes": 1024 * microbatch_size,
    }
    options = ["--model-option", f"forward_sleep_s={forward_s}", "--model-option", f"layers={layers}"]
    if microbatch_size > 1:
        options += ["--model-option", "sleep_samples=1"]
    if pipelined:
        size = PIPELINED_HIDDEN * 4  # float32 bytes of one layer's scale, and of a 1 x 1 x hidden activation
        layer.update(paramBytes=size, optimizerBytes=2 * size + 4, activationBytes=size, outputBytes=size)
        options += ["--model-option", f"hidden={PIPELINED_HIDDEN}", "--model-option", "seq_len=1"]
    return {
        "apiVersion": "resilientjob.io/v1alpha1",
        "kind": "ResilientJob",
        "metadata": {"name": JOB, "namespace": "default"},
        "spec": {
            "image": "resilientjob/worker:latest",
            "command": [
                *(
                    "python",
                    "-m",
                    "resilientjob.agent",
                    "--collective-timeout",
                    "10",
                ),
                *options,
            ],
            "model": "sleep",
            "profile": {"inline": [{"name": f"layer{i}", **layer} for i in range(layers)]},
            "data": {"format": "synthetic", "numSamples": 4096, "seqLen": 1 if pipelined else 16},
            "training": {"steps": 1_000_000, "lr": 0.003, "weightDecay": 0, "gradClipNorm": 0},
            "nodes": nodes,
            "gpusPerNode": 1,
            "deviceResource": "none",
            "globalBatchSize": (
                MIXED_MICROBATCHES
                if mixed
                else GLOBAL_BATCH_PIPELINED
                if pipelined
                else MICROBATCHES_PER_NODE * nodes
            ),
            **({"deviceMemory": MIXED_DEVICE_MEMORY} if mixed else {}),
            "microBatchSize": microbatch_size,
            "faultTolerance": 1,
            "policy": "auto",
            "failSlow": {
                "slowdownThreshold": 1.3,
                "minDurationS": 2,
                "microBatchSplit": split,
                **({"overheads": OVERHEADS} if pipelined else {}),
            },
            "chaos": {"enabled": True},
        },
    }


GLOBAL_BATCH_PIPELINED = 4
"""Samples per step of the pipelined job (four micro-batches of one sample)."""

MIXED_MICROBATCHES = 8
MIXED_DEVICE_MEMORY = "1M"
"""The mixed case's job: eight micro-batches of one sample, two per pipeline. A whole replica of the 16
layers needs about 1.3 MB (the planner's peak), so with 1 MB per device the planner keeps PP2 (DP4 x PP2)
instead of the eight whole-model replicas it picks when memory allows. Two micro-batches per pipeline let
S2 move one off a pipeline whose device is slow (with one each, as the link job has, S2 has nothing to
move and the ladder goes from S3 to S4)."""

OVERHEADS = {"microbatchS": 1, "topologyS": 5, "restartS": 30}
"""The ski-rental controller's strategy costs for the pipelined job: small, so that a persisting slowdown
escalates to S4 within a few minutes (Falcon Fig. 17)."""


def grid(plan: PlanAnnouncement) -> list[list[int]]:
    """The plan's node of each (pipeline, stage)."""
    return [[stage.node for stage in pipeline.stages] for pipeline in plan.plan.pipelines]


def dp_pair(plan: PlanAnnouncement) -> tuple[int, int]:
    """Two nodes of the same stage in different pipelines (a data-parallel link), stage 0 of pipelines 0
    and 1."""
    rows = grid(plan)
    if len(rows) < 2 or len(rows[0]) < 2:
        raise RuntimeError(f"not a pipelined layout: {plan.layout}")
    return rows[0][0], rows[1][0]


ORDER_S = 1200
"""How long each chaos order lasts: past every scenario's end."""


GATHER_S = 1.0
"""How often the bench reads the job's new step records. The telemetry stream keeps only the last 10,000
(`STREAM_MAXLEN`): 35 s of the demo job at 36 steps/s on 16 cores, or the order's steps by the time a run
that waited for its episode looks back at them."""


class Stack:
    """`rjob local` in a temporary directory, and readers of the job's Redis streams. Every step record is
    gathered as it comes (a thread reads the stream every `GATHER_S`), so none is lost to the stream's cap."""

    def __init__(self, directory: Path, job: str = JOB) -> None:
        self.directory = directory
        self.job = job
        self.rjob("up")
        state = json.loads((directory / "state.json").read_text())
        self.client = redis.Redis.from_url(state["redis_url"])
        self.keys = JobKeys("default", job)
        self._records: list[IterationRecord] = []
        self._cursor = "0-0"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._gatherer = threading.Thread(target=self._gather_all_along, daemon=True)
        self._gatherer.start()

    def _gather(self) -> None:
        with self._lock:
            answer: Any = self.client.xread({self.keys.iterations: self._cursor})
            for _, entries in answer:
                for entry_id, fields in entries:
                    self._records.append(IterationRecord.model_validate_json(fields[b"m"]))
                    self._cursor = entry_id.decode()

    def _gather_all_along(self) -> None:
        while not self._stop.wait(GATHER_S):
            with contextlib.suppress(redis.RedisError, OSError):
                self._gather()

    def rjob(self, *args: str) -> str:
        done = rjob_local(self.directory, *args, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"rjob local {' '.join(args)}: {done.stdout}{done.stderr}")
        return done.stdout

    def stream(self, key: str) -> list[bytes]:
        return [fields[b"m"] for _, fields in self.client.xrange(key)]

    def iterations(self) -> list[IterationRecord]:
        """Every step record since the stack came up, in the order the stream holds them."""
        self._gather()
        with self._lock:
            return list(self._records)

    def reports(self) -> list[SlowReport]:
        return [SlowReport.model_validate_json(raw) for raw in self.stream(self.keys.reports)]

    def validations(self) -> list[ValidationResult]:
        return [
            ValidationResult.model_validate_json(raw) for raw in self.stream(self.keys.validation_results)
        ]

    def plan(self) -> PlanAnnouncement | None:
        raw = self.client.get(self.keys.plan)
        return PlanAnnouncement.model_validate_json(raw) if raw else None

    def step(self, node: int = 0) -> int:
        steps = [record.step for record in self.iterations() if record.node == node]
        return max(steps, default=0)

    def episode(self) -> dict[str, Any] | None:
        """The operator's fail-slow episode as it stores it (None while none is open): its slow nodes,
        links and the ski-rental controller's rung."""
        raw = self.client.get(self.keys.failslow)
        state = json.loads(raw)["state"] if raw else {}
        return state if state.get("episode") else None

    def declined(self) -> list[str]:
        """The operator's log lines of rungs it decided but did not publish, and why."""
        log = self.directory / "operator.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        return [line.split(": ", 1)[-1] for line in lines if " not applied: " in line]

    def slow(self, node: int, factor: float, *options: str) -> float:
        """`rjob local chaos slow` on `node` for ORDER_S; returns when the order was written (its expiry
        less ORDER_S), not when the command exited: an interpreter's exit takes a few tenths of a second,
        which are 5-10 steps of the demo job on a quiet 16-core host."""
        self.rjob(
            "chaos",
            "slow",
            f"{self.job}-node-{node}",
            "--factor",
            str(factor),
            "--for",
            f"{ORDER_S}s",
            *options,
        )
        raw = self.client.get(self.keys.chaos(node))
        if raw is None:
            raise RuntimeError(f"no chaos order on node {node} after `rjob local chaos slow`")
        return ChaosOrder.model_validate_json(raw).until - ORDER_S

    def down(self) -> None:
        self._stop.set()
        self._gatherer.join(timeout=5)
        self.rjob("down")


def wait(probe: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"{what}: not within {timeout_s} s")


SETTLE_S = 5.0
MEASURE_S = 5.0
"""A mitigated rate is measured from SETTLE_S after its plan; every rate over MEASURE_S at least, whatever
the step rate: on a quiet 16-core host the demo job makes 36 steps/s, and 30 steps are under a second."""


def measure(stack: Stack, node: int, steps: int, what: str) -> float:
    """Steps/s of the job from now over at least `steps` of `node`'s steps and MEASURE_S, read at once: a
    fast job's iteration stream holds only its last 10,000 records (about 35 s of 8 nodes at 36 steps/s)."""
    began, first = time.time(), stack.step(node)
    wait(
        lambda: stack.step(node) >= first + steps and time.time() >= began + MEASURE_S,
        300,
        f"{steps} steps {what}",
    )
    return throughput(stack.iterations(), node, began, time.time())


def step_time_share(healthy: float, slow: float, mitigated: float) -> float | None:
    """Falcon's share of the slowdown removed, in step time, as `rjob demo` prints it."""
    shares = slowdown_removed(healthy, slow, mitigated)
    return None if shares is None else shares[0]


def throughput(records: list[IterationRecord], node: int, first: float, last: float) -> float:
    """Samples per second of the job between two unix times, from one node's steps (all nodes of a
    synchronous job finish steps together): steps in the window x global batch / window."""
    mine = sorted((r.sent_at, r.step) for r in records if r.node == node and first <= r.sent_at <= last)
    if len(mine) < 3:
        return 0.0
    return (mine[-1][1] - mine[0][1]) / (mine[-1][0] - mine[0][0])


def timeline(
    records: list[IterationRecord], node: int | None = None, bucket_s: float = 5.0
) -> list[tuple[float, float]]:
    """(seconds since the first step, steps/s) per bucket, from one node's steps or, with `node` None, from
    every node's (all nodes of a synchronous job finish the same steps, and a node parked by S4 stops
    reporting while the others go on)."""
    stamps: dict[int, float] = {}
    for record in records:
        if node is None or record.node == node:
            stamps[record.step] = min(stamps.get(record.step, record.sent_at), record.sent_at)
    mine = sorted((at, step) for step, at in stamps.items())
    if not mine:
        return []
    start = mine[0][0]
    buckets: dict[int, list[int]] = {}
    for at, step in mine:
        buckets.setdefault(int((at - start) // bucket_s), []).append(step)
    return [(k * bucket_s, (max(v) - min(v) + 1) / bucket_s) for k, v in sorted(buckets.items())]


PATIENCE_S = 600.0
"""How long after its order the compute scenario waits at most for the detection, the episode and the
mitigation together (`--patience`)."""


def scenario_compute(
    stack: Stack, factor: float = 1.5, slow_node: int = 1, patience_s: float = PATIENCE_S
) -> dict[str, Any]:
    wait(lambda: stack.step(0) >= 40, 300, "40 healthy steps")
    healthy = measure(stack, 0, 30, "healthy")
    generation = stack.plan().generation if stack.plan() else 0
    injected = stack.slow(slow_node, factor)  # the worker's watcher reads the order within 0.25 s
    # An order that costs the job less than its threshold rightly opens no episode: after `patience_s`
    # the run ends with what it measured (the job's slowdown above all) instead of nothing.
    give_up = time.monotonic() + patience_s

    def within(timeout_s: float) -> float:
        return max(0.0, min(timeout_s, give_up - time.monotonic()))

    def detected() -> SlowReport | None:
        found = [r for r in stack.reports() if r.node == slow_node and r.detected_at >= injected]
        found = [r for r in found if not r.recovered]
        return found[0] if found else None

    # Either path may see it first: the worker's own detector (a SlowReport) or the operator (its sweep of
    # the job-wide rule, or the job-level trigger, open an episode without a report of that node).
    with contextlib.suppress(TimeoutError):
        wait(
            lambda: detected() or stack.episode(),
            within(300),
            f"a report from node {slow_node} or an episode",
        )
    try:
        wait(stack.episode, within(120), "the operator's episode")
        opened_at: float | None = time.time()
    except TimeoutError:
        opened_at = None
    report = detected()

    def mitigated() -> PlanAnnouncement | None:
        plan = stack.plan()
        return plan if plan is not None and plan.generation > generation else None

    try:
        new = wait(mitigated, within(180) if opened_at is not None else 10, "a mitigation plan")
    except TimeoutError:
        new = None
    mitigated_at = time.time()
    slow_to = new.published_at if new is not None else mitigated_at
    records = stack.iterations()
    slow = throughput(records, 0, injected + 0.5, slow_to)
    mitigated_rate = 0.0
    if new is not None:
        time.sleep(max(0.0, mitigated_at + SETTLE_S - time.time()))
        mitigated_rate = measure(stack, 0, 50, "after the mitigation")
    # The step before the slowed node's first step with chaos delay (its watcher polls every 0.25 s); from
    # a worker that does not report that delay, the step before its first that began after the order landed.
    delayed = [r.step for r in records if r.node == slow_node and r.sent_at >= injected and r.chaos_s]
    landed = [r.step for r in records if r.node == slow_node and r.sent_at >= injected + 0.25]
    inject_step = min(delayed or landed) - 1
    # The operator's decision: the first step node 0 reported under the mitigation's plan.
    mitigation_step = (
        min(
            (r.step for r in stack.iterations() if r.node == 0 and r.generation >= new.generation),
            default=None,
        )
        if new is not None
        else None
    )
    # When the operator opened its episode: the step it recorded in the mitigation's plan; without one, the
    # slowed node's step when the bench saw the episode in the operator's stored state (polled every 0.5 s).
    opened_step: int | None = None
    if new is not None and new.detected_step is not None:
        opened_step = new.detected_step
    elif opened_at is not None:
        seen = [r.step for r in records if r.node == slow_node and r.sent_at <= opened_at]
        opened_step = max(seen, default=inject_step)
    removed = (mitigated_rate - slow) / (healthy - slow) if new is not None and healthy > slow else None
    return {
        "compute_factor_measured": ordered_factor(records, slow_node, generation, injected, slow_to),
        "job_slowed_by": healthy / slow if slow > 0 else None,
        "episode_delay_iterations": None if opened_step is None else opened_step - inject_step,
        "declined": stack.declined(),
        "healthy_steps_per_s": healthy,
        "slow_steps_per_s": slow,
        "mitigated_steps_per_s": mitigated_rate,
        "slowdown_removed": removed,
        "step_time_slowdown_removed": step_time_share(healthy, slow, mitigated_rate) if new else None,
        "inject_step": inject_step,
        "detected_step": None if report is None else report.step,
        "detection_delay_iterations": None if report is None else report.step - inject_step,
        "factor": factor,
        "slow_node": slow_node,
        "mitigation_delay_iterations": None if mitigation_step is None else mitigation_step - inject_step,
        "detector_onset_step": None if report is None else report.onset_step,
        "slow_window_s": slow_to - injected - 0.5,
        "report": None if report is None else report.model_dump(mode="json"),
        "mitigation": None
        if new is None
        else {
            "generation": new.generation,
            "strategy": new.strategy,
            "layout": new.layout,
            "trigger": new.trigger,
        },
        "reports": [r.model_dump(mode="json") for r in stack.reports()],
    }


def ordered_factor(
    records: list[IterationRecord], node: int, generation: int, injected: float, slow_to: float
) -> float | None:
    """What the order did to the slowed node's own compute (`compute_s`, its trace's wall less
    communication): the median over its steps under the order and before any mitigation (the plan of the
    order's time, from 0.5 s after the order), against the median of its last 30 steps before the order.
    Chaos itself is checked by this (issue 15: within 10% of the factor ordered), apart from what the job
    does around it; None without 5 steps on each side."""
    mine = [r for r in records if r.node == node and r.generation == generation and r.compute_s is not None]
    before = [r.compute_s for r in mine if r.sent_at < injected][-30:]
    under = [r.compute_s for r in mine if injected + 0.5 <= r.sent_at < slow_to]
    if len(before) < 5 or len(under) < 5:
        return None
    base = statistics.median(before)
    return statistics.median(under) / base if base > 0 else None


def _plan_row(plan: PlanAnnouncement) -> dict[str, Any]:
    return {
        "at": plan.published_at,
        "generation": plan.generation,
        "strategy": plan.strategy,
        "trigger": plan.trigger,
        "layout": plan.layout,
        "grid": grid(plan),
        "parked": plan.parked,
    }


def link_traffic(plan: PlanAnnouncement, a: int, b: int) -> str:
    """What the link a-b carries under `plan` as the runtime runs it: "data-parallel" when a and b are
    neighbours in the all-reduce ring of a layer segment they both hold (the runtime builds each ring of
    holders in pipeline order, as the planner's S3 assumes: `_runtime_schedule.sync_groups`), "pipeline"
    when they are adjacent stages of one pipeline, else "none". Any layout, symmetric or not."""
    job = plan.plan
    if a not in job.nodes or b not in job.nodes:  # an end parked (S4) or gone
        return f"none (node {a if a not in job.nodes else b} is out of the plan)"
    rounds = job.allreduce_rounds or allreduce_rounds(job.pipelines)
    for start, _ in (segment for round_ in rounds for segment in round_):
        ring = tuple(
            dict.fromkeys(
                stage.node
                for pipeline in job.pipelines
                for stage in pipeline.stages
                if not stage.rerouted and stage.layers[0] <= start < stage.layers[1]
            )
        )
        if a in ring and b in ring and chaos.ring_neighbours(ring, a, b):
            return "data-parallel"
    for pipeline in job.pipelines:
        nodes = [stage.node for stage in pipeline.stages]
        if any({x, y} == {a, b} for x, y in itertools.pairwise(nodes)):
            return "pipeline"
    return "none"


def link_slow(stack: Stack, node: int, peer: int, factor: float) -> float:
    """Congest the link node-peer (the order on `node`); returns when the order was written."""
    return stack.slow(
        node,
        factor,
        "--link",
        str(peer),
        "--latency",
        str(LINK_LATENCY_S),
        "--bandwidth",
        str(LINK_BANDWIDTH_BPS),
    )


def scenario_link(stack: Stack, nodes: int) -> dict[str, Any]:
    """(b) a congested data-parallel link on the DP4 x PP2 job: detection, validation, S3 (a)."""
    wait(lambda: stack.step(0) >= 40, 300, "40 healthy steps")
    before = stack.plan()
    if before is None:
        raise RuntimeError("no plan published")
    a, b = dp_pair(before)
    # Steps are read from a node off the slowed link: a mitigation may park one of its ends (S4).
    watch = next(node for node in before.plan.nodes if node not in (a, b))
    healthy = measure(stack, watch, 40, "healthy")
    injected = link_slow(stack, a, b, 5.0)
    # The last step the watched node finished before the order was written (as the compute scenario
    # dates it: the CLI's exit comes 5-10 fast steps later).
    inject_step = max(
        (r.step for r in stack.iterations() if r.node == watch and r.sent_at <= injected),
        default=stack.step(watch),
    )

    def detected() -> SlowReport | None:
        found = [r for r in stack.reports() if r.detected_at >= injected and not r.recovered]
        return found[0] if found else None

    report = wait(detected, 240, "a SlowReport after the link order")

    def validated() -> ValidationResult | None:
        found = [v for v in stack.validations() if v.finished_at >= injected]
        return found[0] if found else None

    try:
        result: ValidationResult | None = wait(validated, 240, "a validation result")
    except TimeoutError:
        result = None

    def mitigated() -> PlanAnnouncement | None:
        plan = stack.plan()
        return plan if plan is not None and plan.generation > before.generation else None

    try:
        new: PlanAnnouncement | None = wait(mitigated, 240, "a mitigation plan")
    except TimeoutError:
        new = None
    mitigated_at = time.time()
    slow_to = new.published_at if new is not None else mitigated_at
    slow = throughput(stack.iterations(), watch, injected + 0.5, slow_to)
    mitigated_rate = 0.0
    if new is not None:
        time.sleep(max(0.0, mitigated_at + SETTLE_S - time.time()))
        mitigated_rate = measure(stack, watch, 60, "after the mitigation")
    removed = (mitigated_rate - slow) / (healthy - slow) if new is not None and healthy > slow else None
    carried = None if new is None else link_traffic(new, a, b)
    return {
        "link": [a, b],
        "steps_read_from_node": watch,
        "mitigation": None if new is None else {"trigger": new.trigger, "strategy": new.strategy},
        "healthy_steps_per_s": healthy,
        "slow_steps_per_s": slow,
        "mitigated_steps_per_s": mitigated_rate,
        "slowdown_removed": removed,
        "step_time_slowdown_removed": step_time_share(healthy, slow, mitigated_rate) if new else None,
        "inject_step": inject_step,
        "first_report": report.model_dump(mode="json"),
        "detection_delay_iterations": report.step - inject_step,
        "validation": None
        if result is None
        else {
            "step": result.step,
            "held_s": result.held_s,
            "slow_links": result.slow_links,
            "slow_nodes": result.slow_nodes,
            "after_injection_s": result.finished_at - injected,
        },
        "plan_before": _plan_row(before),
        "plan_after": None if new is None else _plan_row(new),
        "link_carries_before": link_traffic(before, a, b),
        "link_carries_after": carried,
        "reports": [r.model_dump(mode="json") for r in stack.reports()],
    }


class PlanWatch:
    """Records every plan generation the job publishes (polled twice a second on a thread)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.plans: dict[int, PlanAnnouncement] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                plan = self.stack.plan()
            except (redis.RedisError, OSError):
                plan = None
            if plan is not None and plan.generation not in self.plans:
                self.plans[plan.generation] = plan
            self._stop.wait(0.5)

    def stop(self) -> list[PlanAnnouncement]:
        self._stop.set()
        self._thread.join(timeout=5)
        return [self.plans[generation] for generation in sorted(self.plans)]


def scenario_mixed(stack: Stack, nodes: int, out: Path) -> dict[str, Any]:
    """(c) Falcon Fig. 17 on the DP4 x PP2 job with two micro-batches per pipeline: a DP link slow, then a
    GPU slow, both persisting until the ski-rental controller escalates to S4 (small `OVERHEADS`).
    Throughput over time with markers; the rungs each plan took, so that S2 after the link's S3 shows."""
    watch = PlanWatch(stack)
    wait(lambda: stack.step(0) >= 40, 300, "40 healthy steps")
    before = stack.plan()
    if before is None:
        raise RuntimeError("no plan published")
    a, b = dp_pair(before)
    rows = grid(before)
    gpu = rows[2][1]  # a node of another pipeline, other stage
    time.sleep(15)  # a healthy stretch on the plot
    events: list[dict[str, Any]] = []
    events.append({"at": link_slow(stack, a, b, 5.0), "label": f"link {a}-{b} x5"})

    def new_plan(after: int) -> Callable[[], PlanAnnouncement | None]:
        def probe() -> PlanAnnouncement | None:
            plan = stack.plan()
            return plan if plan is not None and plan.generation > after else None

        return probe

    with contextlib.suppress(TimeoutError):
        wait(new_plan(before.generation), 150, "a mitigation of the slow link")
    time.sleep(20)
    events.append({"at": stack.slow(gpu, 2.0), "label": f"GPU {gpu} x2"})

    def escalated() -> bool:
        return any(plan.strategy == "replace" for plan in watch.plans.values())

    with contextlib.suppress(TimeoutError):
        wait(escalated, 300, "escalation to S4")
    time.sleep(60)  # the job after S4, and whatever the controller does next
    plans = watch.stop()
    records = stack.iterations()
    first = min(r.sent_at for r in records)
    points = [(at, rate * MIXED_MICROBATCHES) for at, rate in timeline(records)]
    mitigations = [
        {"at": plan.published_at, "label": plan.strategy or plan.trigger, "generation": plan.generation}
        for plan in plans
        if plan.generation > before.generation
    ]
    result = {
        "link": [a, b],
        "gpu": gpu,
        "overheads": OVERHEADS,
        "timeline": points,
        "events": [{**event, "t": event["at"] - first} for event in events],
        "mitigations": [{**m, "t": m["at"] - first} for m in mitigations],
        "plans": [_plan_row(plan) for plan in plans],
        "reports": [r.model_dump(mode="json") for r in stack.reports()],
    }
    plot_mixed(result, out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    return result


def plot_mixed(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["timeline"]
    figure, axes = plt.subplots(figsize=(9, 3.6))
    axes.plot([t for t, _ in points], [v for _, v in points], color="black", linewidth=1.2)
    top = max((v for _, v in points), default=1.0) * 1.25
    for event in result["events"]:
        axes.axvline(event["t"], color="tab:red", linestyle="--", linewidth=1)
        axes.text(event["t"], top * 0.97, " " + event["label"], color="tab:red", va="top", fontsize=8)
    for index, mitigation in enumerate(result["mitigations"]):
        axes.axvline(mitigation["t"], color="tab:blue", linestyle=":", linewidth=1.2)
        y = top * (0.80 - 0.09 * (index % 3))
        axes.text(mitigation["t"], y, " " + mitigation["label"], color="tab:blue", va="top", fontsize=8)
    axes.set_ylim(0, top)
    axes.set_xlabel("seconds since the first step")
    axes.set_ylabel("samples/s (5 s buckets)")
    axes.set_title(
        "Fail-slow, mixed case (Falcon Fig. 17): DP link slow, then a GPU slow; DP4 x PP2, 2 micro-batches"
    )
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)


EPISODE_ONSET = re.compile(r": NodeSlow: .*? since step (\d+)")
"""The step an episode's finding dates the slowdown from (the operator's NodeSlow message)."""
JUDGE_WINDOW = 16
"""Steps after an episode's onset the bench measures (the operator's level window); 4x as many before."""


def job_step_times(steps: dict[tuple[int, int], float]) -> dict[int, float]:
    """The job's time per step: the median over nodes of each node's wall time of that step ((node, step)
    -> seconds). In a synchronous job every node's step lasts as long as the job's, give or take noise."""
    by_step: dict[int, list[float]] = {}
    for (_, step), seconds in steps.items():
        by_step.setdefault(step, []).append(seconds)
    return {step: statistics.median(values) for step, values in by_step.items()}


def judge_episode(job: dict[int, float], onset: int, window: int = JUDGE_WINDOW) -> float | None:
    """How much slower the job ran in the `window` steps from `onset` than in the 4 x `window` before,
    from the agents' raw step times (the bench's own measure, not the operator's); None without enough
    steps on either side."""
    before = [job[s] for s in range(onset - 4 * window, onset) if s in job]
    after = [job[s] for s in range(onset, onset + window) if s in job]
    if len(before) < window or len(after) < window // 2:
        return None
    return statistics.median(after) / statistics.median(before)


def healthy_verdict(ratios: list[float | None], threshold: float, mitigations: int) -> str:
    """CLEAN: no episode and no mitigation. REAL SLOWDOWNS ONLY: every episode opened on a slowdown of the
    job by at least `threshold` that the bench measured itself; nothing was ordered, so the host slowed the
    job (a shared machine does). FALSE ALARM: an episode the bench cannot confirm, or a mitigation without
    an episode."""
    if not ratios and not mitigations:
        return "CLEAN"
    if ratios and all(r is not None and r >= threshold for r in ratios):
        return "REAL SLOWDOWNS ONLY"
    return "FALSE ALARM"


def scenario_healthy(stack: Stack, minutes: float, threshold: float) -> dict[str, Any]:
    """(d) no order for `minutes`: every SlowReport, which of them opened an episode (the operator's
    `NodeSlow` finding) or were dismissed, and every fail-slow mitigation (a plan with a strategy). Each
    episode is judged against the job's own step times around its onset (`judge_episode`), which the bench
    gathers all along (`Stack`)."""
    watch = PlanWatch(stack)
    wait(lambda: stack.step(0) >= 10, 300, "10 steps")
    first_step = stack.step(0)
    time.sleep(minutes * 60)
    records = stack.iterations()
    seen = {(r.node, r.generation, r.step): r for r in records}
    plans = watch.stop()
    computes: dict[int, list[float]] = {}
    for record in records:
        if record.compute_s is not None:
            computes.setdefault(record.node, []).append(record.compute_s)
    spread = {
        node: statistics.stdev(values) / statistics.mean(values)
        for node, values in computes.items()
        if len(values) > 2
    }
    log = (stack.directory / "operator.log").read_text(errors="replace").splitlines()
    opened = [line for line in log if ": NodeSlow: " in line]
    dismissed = [line for line in log if "slow report ignored" in line]
    mitigations = [_plan_row(plan) for plan in plans if plan.strategy]
    reports = stack.reports()
    job = job_step_times({(node, step): r.seconds for (node, _, step), r in seen.items()})
    episodes: list[dict[str, Any]] = []
    for line in opened:
        match = EPISODE_ONSET.search(line)
        onset = int(match.group(1)) if match else None
        logged_at = line.split("]", 1)[0]
        if any(e["logged_at"] == logged_at and e["onset_step"] == onset for e in episodes):
            continue  # one finding per reporting node, logged together: one episode
        ratio = None if onset is None else judge_episode(job, onset)
        episodes.append(
            {
                "logged_at": logged_at,
                "onset_step": onset,
                "job_slowed_by": ratio,
                "finding": line.split("] ", 2)[-1],
            }
        )
    verdict = healthy_verdict([e["job_slowed_by"] for e in episodes], threshold, len(mitigations))
    measured = ", ".join(
        "n/a" if e["job_slowed_by"] is None else f"{e['job_slowed_by']:.2f}x" for e in episodes
    )
    return {
        "minutes": minutes,
        "steps": stack.step(0) - first_step,
        "slow_reports": [r.model_dump(mode="json") for r in reports],
        "reports_total": len(reports),
        "episodes_opened": len(opened),
        "reports_dismissed": len(dismissed),
        "dismissed": [line.split("] ", 2)[-1] for line in dismissed],
        "mitigations": len(mitigations),
        "mitigation_plans": mitigations,
        "generations": [plan.generation for plan in plans],
        "compute_cv": spread,
        "episodes": episodes,
        "threshold": threshold,
        # The whole run's steps, for bench_failslow_replay.py (the stream alone holds the last 10,000).
        "iterations": [
            [r.node, r.generation, r.step, r.seconds, r.compute_s, r.sent_at]
            for r in sorted(seen.values(), key=lambda r: r.sent_at)
        ],
        "verdict": (
            f"VERDICT: {verdict}: {minutes:g} min, "
            f"{stack.step(0) - first_step} steps, {len(reports)} SlowReports "
            f"({len(opened)} opened an episode, {len(dismissed)} dismissed), {len(mitigations)} mitigations"
            + (f"; the job measured slower by {measured} at the episodes' onsets" if episodes else "")
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=("compute", "link", "mixed", "healthy"), required=True)
    parser.add_argument("--nodes", type=int, default=None, help="default 4, or 8 with --pipelined")
    parser.add_argument(
        "--pipelined", action="store_true", help="the DP4 x PP2 job (link and mixed always use it)"
    )
    parser.add_argument(
        "--manifest", type=Path, help="healthy, compute, link: run this job (e.g. examples/demo.yaml)"
    )
    parser.add_argument("--factor", type=float, default=1.5, help="compute: the slowdown ordered")
    parser.add_argument("--slow-node", type=int, default=1, help="compute: the node slowed")
    parser.add_argument(
        "--patience",
        type=float,
        default=PATIENCE_S,
        help="compute: seconds after the order to wait at most for the episode and its mitigation; then "
        "the run reports what it measured (an order under the job's threshold opens none)",
    )
    parser.add_argument(
        "--threshold", type=float, default=None, help="override the job's failSlow.slowdownThreshold"
    )
    parser.add_argument(
        "--micro-batch-size",
        type=int,
        default=1,
        help="the replicas' job: micro-batches of this many samples (sleeps per sample)",
    )
    parser.add_argument(
        "--split", type=int, default=1, help="the job's failSlow.microBatchSplit (S2 may cut micro-batches)"
    )
    parser.add_argument("--minutes", type=float, default=5.0, help="healthy: how long to run")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "failslow-mixed.png")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument(
        "--workdir",
        type=Path,
        help="run the local stack in this directory and keep it (every pod's log, the operator's log)",
    )
    args = parser.parse_args()
    pipelined = args.pipelined or args.scenario in ("link", "mixed")
    nodes = args.nodes or (8 if pipelined else 4)
    if args.manifest is not None and args.scenario == "mixed":
        parser.error("--manifest: the mixed scenario runs its own job (its overheads are tuned to it)")
    if not 1.0 < args.factor <= 10.0:
        parser.error(f"--factor: must be in (1, 10], got {args.factor}")
    if args.micro_batch_size != 1 and (pipelined or args.manifest is not None):
        parser.error(
            "--micro-batch-size: only for the replicas' job (not --pipelined, link, mixed, --manifest)"
        )
    if args.micro_batch_size < 1 or MICROBATCHES_PER_NODE % args.micro_batch_size:
        parser.error(f"--micro-batch-size: must divide {MICROBATCHES_PER_NODE}, got {args.micro_batch_size}")
    if not args.patience > 0:
        parser.error(f"--patience: must be > 0, got {args.patience}")
    if not 1 <= args.split <= 8:
        parser.error(f"--split: must be in [1, 8], got {args.split}")
    if args.manifest is not None and args.split != 1:
        parser.error("--split: set failSlow.microBatchSplit in the manifest instead")
    job = manifest(nodes, pipelined, args.scenario == "mixed", args.micro_batch_size, args.split)
    if args.manifest is not None:
        job = yaml.safe_load(args.manifest.read_text())
    if args.threshold is not None:
        if not args.threshold > 1.0:
            parser.error(f"--threshold: must be > 1, got {args.threshold}")
        job["spec"].setdefault("failSlow", {})["slowdownThreshold"] = args.threshold
    name = job["metadata"]["name"]
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    kept = contextlib.nullcontext(str(args.workdir)) if args.workdir is not None else None
    with kept or tempfile.TemporaryDirectory(prefix="rjob-failslow-") as directory:
        stack = Stack(Path(directory), name)
        try:
            path = Path(directory) / "job.yaml"
            path.write_text(yaml.safe_dump(job))
            stack.rjob("apply", "-f", str(path))
            began = time.time()
            if args.scenario == "compute":
                result = scenario_compute(stack, args.factor, args.slow_node, args.patience)
            elif args.scenario == "link":
                result = scenario_link(stack, nodes)
            elif args.scenario == "mixed":
                result = scenario_mixed(stack, nodes, args.out)
            else:
                spec = FailSlowSpec.model_validate(job["spec"].get("failSlow") or {})
                threshold = spec.slowdown_threshold
                result = scenario_healthy(stack, args.minutes, threshold)
            plan = stack.plan()
            result["layout"] = None if plan is None else plan.layout
            result["wall_s"] = time.time() - began
            if args.json:
                # The raw material, to look again at what the detectors saw: every node's steps, and the
                # operator's log beside it.
                if "iterations" not in result:
                    result["iterations"] = [
                        [r.node, r.generation, r.step, r.seconds, r.compute_s, r.sent_at]
                        for r in stack.iterations()
                    ]
                log = Path(directory) / "operator.log"
                if log.exists():
                    args.json.with_suffix(".operator.log").write_text(log.read_text(errors="replace"))
        finally:
            stack.down()
    text = json.dumps(result, indent=1, default=str)
    if args.json:
        args.json.write_text(text)
    hidden = ("reports", "slow_reports", "timeline", "report", "iterations")
    summary = {k: v for k, v in result.items() if k not in hidden}
    print(json.dumps(summary, indent=1, default=str))
    if "reports" in result or "slow_reports" in result:
        for report in result.get("reports", result.get("slow_reports", [])):
            print(
                f"report node {report['node']} step {report['step']} kind {report['kind']} "
                f"x{report['slowdown']:.2f} recovered={report['recovered']}"
            )
    if "verdict" in result:
        print(result["verdict"])  # last, so that the outcome is the final line


if __name__ == "__main__":
    main()
