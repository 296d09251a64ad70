"""Data rerouting (ReCycle; Odyssey section IV-C, eqs. 12-13): keep the layout, and let the data-parallel
peers of every failed stage run its micro-batches. No weights move and nothing restarts; the price is a
longer step.

Step time. On a symmetric layout (every pipeline split the same way, equal micro-batches) this is exactly
eq. 13: `(N_pp + N_m - 1 + sum_i [F_i > 0] N_m F_i / (N_dp - F_i)) (T_f + T_b)` (eq. 12 when one node
failed), plus the gradient all-reduce. The generalisation used for any layout keeps eq. 13's two
assumptions: a failed stage's micro-batches are spread evenly over the peer pipelines that still hold its
layers on live nodes, and the extra work of different failed stages adds up serially:

    step = max_p T_p  +  sum_f max_{q in peers(f)} (m_f / |peers(f)|) * W_q(f)

where T_p is pipeline p's exact 1F1B time, m_f the micro-batches of the failed stage's pipeline and W_q(f)
the forward + backward time of the failed stage's layers on q's stages. With equal stages T_p is eq. 9 and
W_q(f) is T_f + T_b, so the sum is eq. 13's term by term.

Memory. A peer also keeps activations for the rerouted micro-batches in flight: its share (rounded up) of the
failed stage's in-flight micro-batches, for the layers it runs for them. A layout whose peers would not fit
cannot be rerouted.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from .errors import PlannerError
from .estimator import allreduce_time, estimate_pipeline, in_flight_microbatches, stage_peak_memory
from .plan import PipelinePlan, Plan, Policy
from .profile import ModelProfile
from .restorer import allreduce_rounds
from .spec import ClusterSpec


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    start, end = max(a[0], b[0]), min(a[1], b[1])
    return (start, end) if start < end else None


def lost_layers(current: Plan, failed: Collection[int]) -> list[int]:
    """Layers that no surviving node of `current` holds: only a checkpoint can bring them back."""
    held: set[int] = set()
    for node, layers in current.layers_by_node().items():
        if node not in failed:
            held.update(layers)
    return [layer for layer in range(current.num_layers) if layer not in held]


def reroute(current: Plan, failed: Collection[int], profile: ModelProfile, cluster: ClusterSpec) -> Plan:
    """`current` with every stage on a node in `failed` (all failures so far) rerouted to its peers.

    Raises PlannerError("failed", ...) when some failed stage has no peer pipeline that still holds its
    layers on live nodes (in a symmetric layout: a stage lost every replica).
    """
    dead = set(failed)
    pipelines = current.pipelines
    if profile.num_layers != current.num_layers:
        raise PlannerError("profile", f"has {profile.num_layers} layers, the plan {current.num_layers}")
    profile = profile.at_microbatch(current.microbatch_size)  # S2 may have split the micro-batches finer

    def intact(pipeline: PipelinePlan, layers: tuple[int, int]) -> bool:
        return all(
            stage.node not in dead for stage in pipeline.stages if _overlap(stage.layers, layers) is not None
        )

    # (pipeline index, stage index) -> peer pipeline indices, for every failed stage.
    peers: dict[tuple[int, int], list[int]] = {}
    for p, pipeline in enumerate(pipelines):
        for s, stage in enumerate(pipeline.stages):
            if stage.node not in dead:
                continue
            found = [q for q, other in enumerate(pipelines) if q != p and intact(other, stage.layers)]
            if not found:
                missing = lost_layers(current, dead)
                start, end = stage.layers
                if any(start <= layer < end for layer in missing):
                    raise PlannerError(
                        "failed",
                        f"layers {start}..{end - 1} lost every replica (stage {s} of pipeline {p}); "
                        "rerouting is impossible",
                    )
                raise PlannerError(
                    "failed",
                    f"no pipeline still holds layers {start}..{end - 1} on live nodes only; "
                    "rerouting is impossible",
                )
            peers[(p, s)] = found

    base = max(estimate_pipeline(profile, cluster, pipeline) for pipeline in pipelines)
    extra_time = 0.0
    # Extra activation bytes per (pipeline, stage) that serve rerouted micro-batches.
    extra_memory: dict[tuple[int, int], float] = {}
    for (p, s), group in peers.items():
        failed_stage = pipelines[p].stages[s]
        share = pipelines[p].microbatches / len(group)
        in_flight = in_flight_microbatches(s, len(pipelines[p].stages), pipelines[p].microbatches)
        held = math.ceil(in_flight / len(group))
        worst = 0.0
        activation = profile.prefix("activation")
        for q in group:
            work = 0.0
            for t, stage in enumerate(pipelines[q].stages):
                part = _overlap(stage.layers, failed_stage.layers)
                if part is None:
                    continue
                forward, backward = profile.stage_times(part[0], part[1], len(stage.gpus))
                work += forward + backward
                extra_memory[(q, t)] = extra_memory.get((q, t), 0.0) + held * float(
                    activation[part[1]] - activation[part[0]]
                ) / len(stage.gpus)
            worst = max(worst, share * work)
        extra_time += worst

    new_pipelines = []
    for p, pipeline in enumerate(pipelines):
        stages = []
        depth = len(pipeline.stages)
        for s, stage in enumerate(pipeline.stages):
            forward, backward = profile.stage_times(stage.layers[0], stage.layers[1], len(stage.gpus))
            memory = stage_peak_memory(
                profile, stage.layers[0], stage.layers[1], len(stage.gpus), s, depth, pipeline.microbatches
            )
            rerouted_to: tuple[int, ...] = ()
            if (p, s) in peers:
                holders = {
                    other.node
                    for q in peers[(p, s)]
                    for other in pipelines[q].stages
                    if _overlap(other.layers, stage.layers) is not None
                }
                rerouted_to = tuple(sorted(holders))
                memory = 0  # the failed node holds nothing any more
            else:
                memory += math.ceil(extra_memory.get((p, s), 0.0))
                if memory > cluster.device_memory_bytes:
                    raise PlannerError(
                        "device_memory_bytes",
                        f"rerouted micro-batches would need {memory} bytes on node {stage.node}, more than "
                        f"{cluster.device_memory_bytes}",
                    )
            stages.append(
                stage.model_copy(
                    update={
                        "forward_s": forward,
                        "backward_s": backward,
                        "peak_memory_bytes": memory,
                        "rerouted_to": rerouted_to,
                    }
                )
            )
        new_pipelines.append(pipeline.model_copy(update={"stages": tuple(stages)}))

    rounds = allreduce_rounds(new_pipelines)
    sync = allreduce_time(profile, cluster, rounds, len(new_pipelines))
    return Plan(
        policy=Policy.REROUTE,
        generation=current.generation,
        microbatch_size=current.microbatch_size,
        pipelines=tuple(new_pipelines),
        step_time_s=base + extra_time + sync,
        allreduce_rounds=tuple(tuple(r) for r in rounds),
        failed_nodes=tuple(sorted(dead)),
    )
