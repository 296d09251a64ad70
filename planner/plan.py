"""Execution plans: which node runs which layers of which pipeline, and why this plan was chosen."""

from __future__ import annotations

from collections import Counter
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

LAYOUT_LISTED = 16
"""`Plan.layout` lists every pipeline's depth up to this many pipelines, and counts them per depth beyond."""


class Policy(StrEnum):
    """Recovery policies, named the same in the planner, the CRD, the CLI and the simulator."""

    AUTO = "auto"  # Odyssey eq. 8 over reroute, dynamic, templates and checkpoint, keeping f + 1 replicas
    REROUTE = "reroute"  # ReCycle: failed stages' micro-batches run on their data-parallel peers
    DYNAMIC = "dynamic"  # new (possibly asymmetric) DP x PP layout over all alive nodes
    TEMPLATES = "templates"  # Oobleck: instantiate precomputed pipeline templates
    CHECKPOINT = "checkpoint"  # Varuna: restart from the last checkpoint with a new symmetric layout


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StagePlan(_Frozen):
    """Layers [start, end) on some GPUs of one node."""

    layers: tuple[int, int]
    node: int = Field(ge=0, description="Node id in the initial cluster's numbering.")
    gpus: tuple[int, ...] = Field(default=(0,), min_length=1, description="GPU indices within the node.")
    forward_s: float = Field(default=0.0, ge=0, description="Estimated forward time per micro-batch.")
    backward_s: float = Field(default=0.0, ge=0, description="Estimated backward time per micro-batch.")
    peak_memory_bytes: int = Field(default=0, ge=0, description="Estimated peak memory per GPU.")
    rerouted_to: tuple[int, ...] = Field(
        default=(), description="When `node` has failed: the data-parallel peers running its micro-batches."
    )

    @model_validator(mode="after")
    def _check(self) -> StagePlan:
        start, end = self.layers
        if not 0 <= start < end:
            raise ValueError(f"layers must be [start, end) with 0 <= start < end, got {list(self.layers)}")
        if len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"gpus repeat an index: {list(self.gpus)}")
        return self

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def rerouted(self) -> bool:
        return bool(self.rerouted_to)


class PipelinePlan(_Frozen):
    """One data-parallel replica: consecutive stages covering the whole model."""

    stages: tuple[StagePlan, ...] = Field(min_length=1)
    microbatches: int = Field(
        ge=0,
        description="Micro-batches this pipeline runs per step; 0 for a replica fail-slow mitigation drained "
        "(it keeps its weights and its part in the gradient sum, and computes nothing).",
    )
    template: int | None = Field(default=None, description="Oobleck template (node count) it came from.")

    @model_validator(mode="after")
    def _contiguous(self) -> PipelinePlan:
        expected = 0
        for stage in self.stages:
            if stage.layers[0] != expected:
                raise ValueError(f"stages must be contiguous from layer 0; gap or overlap at {expected}")
            expected = stage.layers[1]
        return self

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layers[1]

    @property
    def nodes(self) -> tuple[int, ...]:
        """Distinct nodes of this pipeline in stage order (failed, rerouted nodes excluded)."""
        seen: dict[int, None] = {}
        for stage in self.stages:
            if not stage.rerouted:
                seen.setdefault(stage.node, None)
        return tuple(seen)


class Transfer(_Frozen):
    """Copy one layer's parameters and optimizer state from `src` to `dst` before resuming."""

    layer: int = Field(ge=0)
    src: int = Field(ge=0)
    dst: int = Field(ge=0)
    bytes: int = Field(ge=0)


class Candidate(_Frozen):
    """A plan the search considered, with the numbers that decided it."""

    policy: Policy
    layout: str
    step_time_s: float
    transition_s: float
    score: float = Field(description="Samples/s x effective-time ratio (Odyssey eq. 8); 0 if infeasible.")
    feasible: bool = True
    reason: str = ""


class Plan(_Frozen):
    """A complete execution plan. Pipelines' micro-batches add up to the global batch."""

    policy: Policy
    generation: int = Field(default=0, ge=0)
    microbatch_size: int = Field(ge=1)
    pipelines: tuple[PipelinePlan, ...] = Field(min_length=1)
    step_time_s: float = Field(ge=0, description="Estimated time of one optimizer step.")
    transition_s: float = Field(default=0.0, ge=0, description="Estimated time to switch to this plan.")
    transfers: tuple[Transfer, ...] = ()
    allreduce_rounds: tuple[tuple[tuple[int, int], ...], ...] = Field(
        default=(), description="Gradient all-reduce rounds; each round lists layer ranges reduced together."
    )
    failed_nodes: tuple[int, ...] = ()
    candidates: tuple[Candidate, ...] = ()
    planning_s: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> Plan:
        layers = {pipeline.num_layers for pipeline in self.pipelines}
        if not any(pipeline.microbatches for pipeline in self.pipelines):
            raise ValueError("pipelines: no pipeline runs a micro-batch")
        if len(layers) != 1:
            raise ValueError(f"pipelines cover different layer counts: {sorted(layers)}")
        used: set[tuple[int, int]] = set()
        for pipeline in self.pipelines:
            for stage in pipeline.stages:
                if stage.rerouted:
                    continue
                for gpu in stage.gpus:
                    if (stage.node, gpu) in used:
                        raise ValueError(f"node {stage.node} GPU {gpu} is assigned to two stages")
                    used.add((stage.node, gpu))
        return self

    @property
    def num_layers(self) -> int:
        return self.pipelines[0].num_layers

    @property
    def global_batch(self) -> int:
        return sum(pipeline.microbatches for pipeline in self.pipelines) * self.microbatch_size

    @property
    def nodes(self) -> tuple[int, ...]:
        """Every node that runs a stage, sorted."""
        return tuple(sorted({node for pipeline in self.pipelines for node in pipeline.nodes}))

    @property
    def idle_nodes(self) -> tuple[int, ...]:
        """Nodes that hold stages but compute nothing: their pipelines run no micro-batch (a replica that
        fail-slow mitigation S2 drained) and no working pipeline reroutes a stage to them. Sorted."""
        working: set[int] = set()
        for pipeline in self.pipelines:
            if pipeline.microbatches:
                working.update(pipeline.nodes)
                working.update(node for stage in pipeline.stages for node in stage.rerouted_to)
        return tuple(node for node in self.nodes if node not in working)

    @property
    def layout(self) -> str:
        """Human summary such as `DP3 PP[2,2,3]` (stages per pipeline). Beyond `LAYOUT_LISTED` pipelines it
        counts pipelines per depth instead, `DP2048 PP[2x2000,3x48]`, so that the summary (a status field, a
        printer column) stays short at any scale."""
        depths = [len(pipeline.stages) for pipeline in self.pipelines]
        if len(depths) <= LAYOUT_LISTED:
            return f"DP{len(depths)} PP[{','.join(map(str, depths))}]"
        counts = Counter(depths)
        return f"DP{len(depths)} PP[{','.join(f'{depth}x{counts[depth]}' for depth in sorted(counts))}]"

    @property
    def throughput(self) -> float:
        """Samples per second at the estimated step time."""
        return self.global_batch / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def peak_memory_bytes(self) -> int:
        return max(stage.peak_memory_bytes for pipeline in self.pipelines for stage in pipeline.stages)

    def layers_by_node(self) -> dict[int, set[int]]:
        """Which layers each (non-failed) node holds: the input of weight-transfer matching."""
        holdings: dict[int, set[int]] = {}
        for pipeline in self.pipelines:
            for stage in pipeline.stages:
                if not stage.rerouted:
                    holdings.setdefault(stage.node, set()).update(range(*stage.layers))
        return holdings

    def transfer_bytes(self) -> int:
        return sum(transfer.bytes for transfer in self.transfers)
