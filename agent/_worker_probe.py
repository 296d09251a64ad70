"""What a training worker process learns about itself without touching the training loop (Falcon 4.2-4.3):
the `torch.distributed` tracer, chaos orders (when the job allows them), each committed step split into
compute and communication from the trace, a per-group profile every `PROFILE_EVERY` steps, and the
validation pass at an agreed iteration boundary.

The worker writes one JSON line per event to a sink file the pod's agent tails (`_bridge.TrainingAgent`):
`{"kind": "step", ...}` and `{"kind": "profile", ...}`; the agent turns them into `IterationRecord`s and
`ProfileRecord`s (and every device's `{"kind": "abort", ...}` line, `_bridge._ProbeHooks.on_abort`, into a
`WorkerAbort`). Validation results go through the job's TCPStore to the store host, which forwards each one
to Redis exactly once (`_validation_relay`).

The pass (`validation.validate`) benchmarks every device and the links of the world's ring; the probe adds
the links of the training's own data-parallel rings (the stages holding the same layers, in pipeline order,
all tested at once since the rings are disjoint: 2 or 3 more passes), so that a congested link between two
replicas of one stage, which the world ring (numbered pipeline by pipeline) never crosses, is named too.

Communication time of a step is the time the worker was *held* by communication: inside a synchronous call,
or from the first `wait()` on an asynchronous one to its end (`trace_reader.blocked_s`); waiting for a slower
peer counts as communication, as in Falcon, and the rest of the step is this node's compute.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

import redis

from resilientjob.planner.errors import PlannerError
from resilientjob.planner.failslow import Link, ring_schedule
from resilientjob.planner.plan import Plan
from resilientjob.protocol.keys import JobKeys
from resilientjob.protocol.messages import LinkTiming, ValidationResult, ValidationTopology
from resilientjob.protocol.store_keys import VALIDATION_REQUEST_KEY, validation_result_key

from . import _parked, chaos, trace_reader, tracing, validation
from ._runtime_schedule import lane_ranks, world_nodes
from ._tensor_parallel import tp_degree

PROFILE_EVERY = 10
"""Steps between two per-group profiles (`ProfileRecord`)."""
DRAINED_PROBE_SIZE = 384
DRAINED_PROBE_REPEATS = 3
"""A drained node probes once per training step, between steps, while its peers compute: on a CPU products
of 384, the best of 3 (about a millisecond each on one core), stay hidden there and take little from peers
that share the node's cores; products of 256 timed too noisily (a cold cache after the step's wait moved the
best of 3 by up to 20%). An accelerator's products are `_parked.ACCELERATOR_PROBE_SIZE` wide."""
REFERENCE_FIRST_STEP = 5
"""The worker's step after which it times its first reference: its start-up behind it, under the job's load
(timed after the first step, while the other workers were still starting, the local stack's references
read ~20% under a parked node's probe in the training that followed)."""
REFERENCE_EVERY_S = 30.0
"""Seconds between two reference probes of a node that trains: the parked node's own probe product, timed
after a step (after step `REFERENCE_FIRST_STEP`, then on the first step after each multiple of this on the
wall clock, so that the nodes of a job time theirs in the same step or the next, and a synchronous job
pays one product's time (~2 ms on a GPU, 20-30 ms on a CPU core) per period, not one per node).
The operator judges a parked node's probe against the other nodes' latest (`operator._failslow_parked`): a
parked node whose slowdown ended before its own probe had a level of it sends no recovery report."""


def _measured(device: str, size: int = _parked.PROBE_SIZE, repeats: int = _parked.PROBE_REPEATS) -> float:
    """`_parked.measure` in a worker: the product on one thread, then the worker's own thread count back
    (it trains on the threads it had)."""
    import torch

    threads = torch.get_num_threads()
    try:
        return _parked.measure(device, size, repeats)
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True, slots=True)
class BoundaryRequest:
    """A validation request as the workers see it: run it before step `step` of `generation`."""

    id: int
    generation: int
    step: int
    topology: ValidationTopology

    def __post_init__(self) -> None:
        if self.id < 1:
            raise ValueError(f"id: must be >= 1, got {self.id}")
        if self.generation < 0 or self.step < 0:
            raise ValueError(f"generation and step: must be >= 0, got {self.generation} and {self.step}")

    def encode(self) -> str:
        return json.dumps(
            {"id": self.id, "generation": self.generation, "step": self.step, "topology": self.topology.value}
        )

    @classmethod
    def decode(cls, raw: bytes | str) -> BoundaryRequest:
        data = json.loads(raw)
        return cls(
            int(data["id"]), int(data["generation"]), int(data["step"]), ValidationTopology(data["topology"])
        )


def rank_table(plan: Plan, lane: int = 0) -> dict[int, int]:
    """Node -> the global rank of its `lane`-th worker under `plan`: the runtime numbers the world's nodes
    in order, each node's k workers (a stage over k devices) side by side, `position * k + lane`."""
    return lane_ranks(world_nodes(plan), tp_degree(plan), lane)


def nodes_by_rank(plan: Plan) -> dict[int, int]:
    """Every global rank under `plan` -> its node (all k ranks of a node map to it)."""
    nodes, lanes = world_nodes(plan), tp_degree(plan)
    return {rank: node for lane in range(lanes) for node, rank in lane_ranks(nodes, lanes, lane).items()}


def data_parallel_rings(plan: Plan) -> list[list[int]]:
    """Global ranks of each data-parallel group of `plan` (the stages holding the same layers, in pipeline
    order) that has two members or more, lane by lane: the rings its gradient all-reduces run over. The
    same on every rank (each calls the link tests with them)."""
    groups: dict[tuple[tuple[int, int], int], list[int]] = {}
    for lane in range(tp_degree(plan)):
        ranks = rank_table(plan, lane)
        for pipeline in plan.pipelines:
            for stage in pipeline.stages:
                if stage.node in ranks:
                    groups.setdefault((stage.layers, lane), []).append(ranks[stage.node])
    return [members for _, members in sorted(groups.items()) if len(set(members)) > 1]


def ring_passes(rings: Sequence[Sequence[int]]) -> list[list[Link]]:
    """The planner's ring schedule for each (disjoint) ring in global ranks, pass i of every ring in pass i:
    within a pass no rank sends or receives twice, so all rings are tested at once."""
    passes: list[list[Link]] = []
    for ring in rings:
        for index, links in enumerate(ring_schedule(len(ring))):
            if index == len(passes):
                passes.append([])
            passes[index].extend((ring[src], ring[dst]) for src, dst in links)
    return passes


def node_label(label: str, nodes_by_rank: Mapping[int, int]) -> str:
    """A trace group label in global ranks (`0,1,2` or `0,1@1`) rewritten in node ids."""
    ranks, _, peer = label.partition("@")

    def node(rank: str) -> str:
        return str(nodes_by_rank.get(int(rank), f"r{rank}"))

    text = ",".join(node(rank) for rank in ranks.split(",") if rank)
    return f"{text}@{node(peer)}" if peer else text


def result_in_nodes(
    report: validation.ValidationReport,
    request: BoundaryRequest,
    nodes_by_rank: Mapping[int, int],
    held_s: float,
) -> ValidationResult:
    """The pass's report (global ranks) as the operator's `ValidationResult` (node ids). A node of k devices
    is as fast as its slowest; the links between one node's own devices are not the operator's to move
    (it plans nodes), so they are left out."""

    def node(rank: int) -> int:
        return nodes_by_rank[rank]

    gemm_s: dict[int, float] = {}
    for rank, result in report.gemm.items():
        gemm_s[node(rank)] = max(gemm_s.get(node(rank), 0.0), result.seconds)
    between = {link: result for link, result in report.links.items() if node(link[0]) != node(link[1])}
    return ValidationResult(
        id=request.id,
        generation=request.generation,
        step=request.step,
        gemm_s=gemm_s,
        links=[
            LinkTiming(src=node(src), dst=node(dst), seconds=result.seconds)
            for (src, dst), result in sorted(between.items())
        ],
        slow_nodes=sorted({node(rank) for rank in report.slow_gpus}),
        slow_links=sorted(
            {(node(src), node(dst)) for src, dst in report.slow_links if node(src) != node(dst)}
        ),
        held_s=held_s,
        finished_at=time.time(),
    )


def chaos_client(environ: Mapping[str, str] | None = None) -> redis.Redis | None:
    """A sync Redis client for the chaos watcher, from the pod's environment (None without a URL)."""
    env = os.environ if environ is None else environ
    url = env.get("RJOB_REDIS_URL")
    if not url:
        return None
    # Bounded waits: a poll against an unreachable Redis must not hang the watcher (it keeps the last order).
    return redis.Redis.from_url(
        url, password=env.get("RJOB_REDIS_PASSWORD") or None, socket_connect_timeout=2.0, socket_timeout=2.0
    )


class WorkerProbe:
    """The per-process state: the tracer, the chaos watcher, the step window and the last validation."""

    def __init__(
        self,
        node: int,
        sink: IO[str],
        *,
        profile_every: int = PROFILE_EVERY,
        lane: int = 0,
        device: str = "cpu",
        reference_every_s: float = REFERENCE_EVERY_S,
    ) -> None:
        if profile_every < 2:
            raise ValueError(f"profile_every: must be >= 2, got {profile_every}")
        if not reference_every_s > 0:
            raise ValueError(f"reference_every_s: must be > 0, got {reference_every_s}")
        self.node = node
        self.lane = lane
        """This worker's local rank among its node's k: the ranks its chaos links and labels address."""
        self.device = device
        """Where validation's products and link payloads run: the worker's own device (NCCL and HCCL send
        device tensors only)."""
        self.nodes_by_rank: dict[int, int] = {}
        self.sink = sink
        self.profile_every = profile_every
        self.tracer = tracing.install()
        self.ranks: dict[int, int] = {}
        self.rings: list[list[int]] = []
        """The current plan's data-parallel rings (global ranks), whose links validation tests too."""
        self.watcher: chaos.ChaosWatcher | None = None
        self.validated = 0
        """Id of the newest validation request handled (run or skipped)."""
        self._step_began = 0.0
        self._step_cursor = 0
        self._step_injected = 0.0
        self._window_cursor = 0
        self._window_steps = 0
        self.reference_every_s = reference_every_s
        self._reference_period: int | None = None
        """The wall clock's period (`reference_every_s`) of the last reference probe (None: none yet)."""
        self._steps_ended = 0
        self._reference_failed = False

    def start_chaos(self, keys: JobKeys, client: redis.Redis | None) -> None:
        """Obey this node's chaos orders if the job allows chaos (`chaos.allowed`)."""
        if client is None or not chaos.allowed():
            return
        self.watcher = chaos.start(self.tracer, client, keys, self.node, rank_of=self.ranks.get)

    def on_plan(self, plan: Plan) -> None:
        """A new plan renumbers the ranks: chaos link targets and profile labels follow (one dict, updated
        in place, so the injector's `rank_of` sees it at once)."""
        if self.watcher is not None:
            self.watcher.injector.switch_begins()
        self.ranks.clear()
        self.ranks.update(rank_table(plan, self.lane))
        self.nodes_by_rank = nodes_by_rank(plan)
        self.rings = data_parallel_rings(plan)
        self._window_cursor = self.tracer.ring.head
        self._window_steps = 0

    # ---- steps ------------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        if self.watcher is not None:
            self.watcher.injector.switch_ends()
        self.tracer.compute_begins()  # the wait since the last step's end is not compute to stretch
        self._step_began = time.perf_counter()
        self._step_cursor = self.tracer.ring.head
        self._step_injected = self.watcher.injector.injected_s if self.watcher is not None else 0.0

    def end_step(
        self,
        generation: int,
        step: int,
        samples: int,
        loss: float,
        role: str,
        *,
        drained_on: str | None = None,
    ) -> dict[str, Any]:
        """The committed step's line: wall time, and its compute and communication split from the trace.

        `drained_on`: the device of a node the plan runs no micro-batch on (S2 drained its replica). Its
        step is all waiting, which says nothing of its device, so its compute is a probe product timed
        there, stretched by the node's compute chaos order as its training would be: the node's agent
        reports the recovery from these steps, as a parked node's does from its own probes. Lane 0 of a
        node that trains times the parked node's probe every `reference_every_s` (`probe_s`)."""
        ended = time.perf_counter()
        wall = max(1e-6, ended - self._step_began)
        records = self.tracer.ring.records(since=self._step_cursor)
        communication = min(wall, trace_reader.blocked_s(records, self._step_began, ended))
        injector = self.watcher.injector if self.watcher is not None else None
        compute = max(1e-6, wall - communication)
        stretch = 0.0
        if drained_on is not None:
            factor = injector.compute_factor() if injector is not None else 1.0
            product = _measured(drained_on, DRAINED_PROBE_SIZE, DRAINED_PROBE_REPEATS)
            compute, stretch = product * factor, product * (factor - 1.0)  # the wall is the job's: as it was
        elif injector is not None and injector.stretch_step(
            wall - communication, injector.injected_s - self._step_injected
        ):
            # A slow device: the step's compute took F times as long (the sleep is compute, not a call).
            ended = time.perf_counter()
            wall = max(1e-6, ended - self._step_began)
            compute = max(1e-6, wall - communication)
        # What a chaos order cost this step: its compute delays count as compute, its link delays as
        # communication; the rest of compute_s is the worker's own (what an ordered factor multiplies).
        chaos_s = (injector.injected_s - self._step_injected if injector is not None else 0.0) + stretch
        line: dict[str, Any] = {
            "kind": "step",
            "generation": generation,
            "step": step,
            "wall_s": wall,
            "compute_s": compute,
            "communication_s": communication,
            "chaos_s": chaos_s,
            "samples": samples,
            "loss": loss,
            "role": role,
        }
        if drained_on is None and self.lane == 0 and self._reference_due():
            reference = self._reference(injector.compute_factor() if injector is not None else 1.0)
            if reference is not None:
                line["probe_s"] = reference
        self._write(line)
        self._window_steps += 1
        if self._window_steps >= self.profile_every:
            self._profile(generation, step)
        return line

    def _reference_due(self) -> bool:
        self._steps_ended += 1
        if self._steps_ended < REFERENCE_FIRST_STEP or self._reference_failed:
            return False
        period = int(time.time() // self.reference_every_s)
        if period == self._reference_period:
            return False
        self._reference_period = period
        return True

    def _reference(self, factor: float) -> float | None:
        """The reference probe, stretched by `factor`; None, and never again in this worker, when it fails
        (a device near its memory's end: a side measurement must not fail the training)."""
        try:
            return _measured(self.device) * factor
        except Exception as exc:  # whatever the device raised, the step stands
            self._reference_failed = True
            print(f"reference probe failed, not timed again in this worker: {exc}", flush=True)
            return None

    def _profile(self, generation: int, step: int) -> None:
        records = self.tracer.ring.records(since=self._window_cursor)
        self._window_cursor = self.tracer.ring.head
        self._window_steps = 0
        try:
            found = trace_reader.profile(records)
        except PlannerError:
            return  # no recurring period in this window (a reconfiguration inside it): skip one profile
        nodes_by_rank = self.nodes_by_rank
        self._write(
            {
                "kind": "profile",
                "generation": generation,
                "step": step,
                "iterations": found.iterations,
                "iteration_s": found.iteration_s,
                "compute_s": found.compute_s,
                "communication_s": found.communication_s,
                "groups": {node_label(label, nodes_by_rank): s for label, s in found.group_s.items()},
            }
        )

    def applied(self, generation: int, rendezvous_s: float, copy_s: float, copied_bytes: int) -> None:
        """This node's switch to `generation`, for the agent to send with the generation's first step."""
        self._write(
            {
                "kind": "applied",
                "generation": generation,
                "rendezvous_s": rendezvous_s,
                "copy_s": copy_s,
                "bytes": copied_bytes,
            }
        )

    def _write(self, line: Mapping[str, Any]) -> None:
        self.sink.write(json.dumps(line) + "\n")

    # ---- validation --------------------------------------------------------------------------------------
    def maybe_validate(
        self, store: Any, generation: int, step: int, world_rank: int | None
    ) -> ValidationResult | None:
        """Run the validation pass if a request's boundary is this step of this generation (called between
        steps, nothing in flight). Every member of the world calls it and runs the same pass; world rank 0
        leaves the result in the store. A request this worker can no longer meet is marked handled."""
        if store is None or world_rank is None or not store.check([VALIDATION_REQUEST_KEY]):
            return None
        try:
            request = BoundaryRequest.decode(store.get(VALIDATION_REQUEST_KEY))
        except (ValueError, KeyError, TypeError):
            return None
        if request.id <= self.validated:
            return None
        if request.generation < generation or (request.generation == generation and request.step < step):
            self.validated = request.id  # an earlier world's request, or one we are past: not ours to run
            return None
        if request.generation > generation or request.step > step:
            # A later step, or the next generation's, published before this worker switched to it: its
            # peers of that world run it there, and so must this worker (marked handled here, it left a
            # joiner alone in the pass's collectives, and the job stalled until every worker timed out).
            return None
        self.validated = request.id
        began = time.perf_counter()
        report = validation.validate(validation.Topology(request.topology.value), device=self.device)
        # The rings' links the world pass did not already measure (all of them, in a pipelined layout).
        passes = [[link for link in links if link not in report.links] for links in ring_passes(self.rings)]
        passes = [links for links in passes if links]
        if passes:
            with self.tracer.quiet():
                report = validation.time_more_links(report, passes, device=self.device)
        held = time.perf_counter() - began
        result = result_in_nodes(report, request, self.nodes_by_rank, held)
        if world_rank == 0:
            store.set(validation_result_key(request.id), result.model_dump_json())
        self._write({"kind": "validation", "id": request.id, "step": step, "held_s": held})
        return result

    def stop(self) -> None:
        chaos.stop(self.tracer, self.watcher)
        self.watcher = None
