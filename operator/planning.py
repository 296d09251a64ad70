"""The operator's one seam to the planner: turn a ResilientJob spec into planner inputs and call the plan
search (`resilientjob.planner.search.initial_plan` / `replan`). Pure: no I/O; the ConfigMap holding a
referenced profile is read by the caller and passed in, and what node 0 is asked to compute or time is a
`ModelProfileRequest`. Public, as `rjob plan -f` plans a manifest with it exactly as the operator does."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from resilientjob.planner.errors import PlannerError
from resilientjob.planner.plan import Plan
from resilientjob.planner.profile import ModelProfile
from resilientjob.planner.search import initial_plan, replan, warm_up
from resilientjob.planner.spec import CheckpointState, ClusterSpec, JobSpec, TransitionCosts
from resilientjob.protocol.messages import ModelProfileRequest
from resilientjob.protocol.models import ModelSource, model_source, profile_name

from . import _manifests
from .api import ConfigMapKeyRef, ResilientJobSpec, inline_profile


@dataclass(frozen=True, slots=True)
class PlannerInputs:
    """Everything the plan search needs, derived once per job."""

    profile: ModelProfile
    cluster: ClusterSpec
    job: JobSpec
    costs: TransitionCosts


def profile_from_pod(spec: ResilientJobSpec) -> bool:
    """Whether node 0's agent makes the job's profile before the first plan: a Hugging Face model without a
    given profile (an `hf:<dir>` config.json is on a volume of the pods; an `hf:<family>?k=v` configuration
    is completed by transformers, as the runtime builds it) or `spec.profile.measure`."""
    if spec.profile is not None:
        return spec.profile.measure
    return model_source(spec.model) in (ModelSource.HF_DIRECTORY, ModelSource.HF_CONFIG)


def checked_by_node0(spec: ResilientJobSpec) -> bool:
    """Whether node 0's agent checks the workload before the first plan: every job the runtime trains (its
    model's checkpoint and its data are on volumes of the pods, which the operator cannot read); not the
    synthetic loop, which reads neither."""
    return model_source(spec.model) is not ModelSource.SYNTHETIC


def profile_request(spec: ResilientJobSpec, has_inputs: bool) -> ModelProfileRequest:
    """What node 0 must do: check the model as the pods build it (their sequence length) and the data, and
    profile it per micro-batch when the planner has no profile yet (`has_inputs` False)."""
    return ModelProfileRequest(
        model=spec.model,
        seq_len=_manifests.workload(spec).data.seq_len,
        microbatch_size=spec.micro_batch_size,
        measure=not has_inputs and spec.profile is not None and spec.profile.measure,
        profile=not has_inputs and profile_from_pod(spec),
        devices_per_stage=spec.gpus_per_node,
        global_batch=spec.global_batch_size,
    )


def configmap_profile(configmap: Mapping[str, Any] | None, ref: ConfigMapKeyRef) -> dict[str, Any]:
    """The decoded profile under `ref.key` of a ConfigMap object (None: not found); PlannerError naming
    `spec.profile.configMapRef` for a missing key or text that is no mapping."""
    text = ((configmap or {}).get("data") or {}).get(ref.key)
    if not isinstance(text, str):
        raise PlannerError("spec.profile.configMapRef", f"ConfigMap {ref.name!r} has no key {ref.key!r}")
    try:
        decoded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PlannerError("spec.profile.configMapRef", f"not valid JSON/YAML: {exc}") from None
    if not isinstance(decoded, dict):
        raise PlannerError("spec.profile.configMapRef", "must hold a mapping with a 'layers' list")
    return decoded


def resolve_profile(spec: ResilientJobSpec, referenced: Mapping[str, Any] | None = None) -> ModelProfile:
    """The job's layer profile: inline, from a referenced ConfigMap (decoded), the one node 0's agent made
    (`profile_from_pod`: decoded from the job's profile ConfigMap), or a built-in by model name."""
    source = spec.profile
    if source is not None and source.inline is not None:
        return inline_profile(source.inline, spec.model)
    if source is not None and source.config_map_ref is not None:
        if referenced is None:
            raise PlannerError("spec.profile.configMapRef", "the referenced ConfigMap key was not found")
        return ModelProfile.from_mapping(referenced, source="spec.profile.configMapRef")
    if profile_from_pod(spec):
        if referenced is None:
            raise PlannerError("spec.profile", "node 0's agent has not reported the profile yet")
        return ModelProfile.from_mapping(referenced, source="profile")
    name = profile_name(spec.model)
    if name is None:
        raise PlannerError(
            "spec.profile",
            f"model {spec.model!r} has no built-in profile: give one (`rjob profile` measures one) or set "
            "measure: true",
        )
    return ModelProfile.load(name)


def planner_inputs(
    spec: ResilientJobSpec, referenced: Mapping[str, Any] | None = None, profile: ModelProfile | None = None
) -> PlannerInputs:
    """The planner's inputs for the job; `profile`, when given, in place of the spec's (`rjob plan
    --profile`)."""
    profile = profile if profile is not None else resolve_profile(spec, referenced)
    cluster = ClusterSpec(
        nodes=spec.nodes, gpus_per_node=spec.gpus_per_node, device_memory_bytes=spec.device_memory_bytes
    )
    job = JobSpec(
        global_batch=spec.global_batch_size,
        microbatch_size=spec.micro_batch_size,
        fault_tolerance=spec.fault_tolerance,
    )
    overheads = spec.fail_slow.overheads
    # The spec's strategy overheads are the user's measured costs of this job: a layout change costs what
    # moving stages does (topology), a checkpoint restart what the restart does.
    costs = TransitionCosts(
        checkpoint_interval_s=float(spec.checkpoint.interval_s),
        restart_s=overheads.topology_s,
        checkpoint_load_s=overheads.restart_s,
    )
    # The profile's figures are per micro-batch of the spec's size; saying so lets S2's finer splits be priced
    return PlannerInputs(
        profile=profile.measured_at(spec.micro_batch_size), cluster=cluster, job=job, costs=costs
    )


def warm_planner(inputs: PlannerInputs) -> int:
    """Precompute the planner's per-depth tables for this job (run in a thread at controller set-up), so a
    failure right after an operator restart is planned as fast as any later one."""
    return warm_up(inputs.profile, inputs.cluster, inputs.job)


_SPEC_FIELDS = {
    "device_memory_bytes": "spec.deviceMemory",
    "fault_tolerance": "spec.faultTolerance",
    "global_batch": "spec.globalBatchSize",
    "microbatch_size": "spec.microBatchSize",
    "gpus_per_node": "spec.gpusPerNode",
    "nodes": "spec.nodes",
}
"""The spec field behind each planner input a PlannerError can name: what the user must change."""


def plan_initial(spec: ResilientJobSpec, inputs: PlannerInputs) -> Plan:
    """Generation 0; PlannerError naming the spec field (`spec.deviceMemory: the model does not fit ...`)
    when no layout can run the job."""
    started = time.perf_counter()
    try:
        plan: Plan = initial_plan(
            inputs.profile, inputs.cluster, inputs.job, policy=spec.policy, costs=inputs.costs
        )
    except PlannerError as exc:
        if exc.field not in _SPEC_FIELDS:
            raise
        raise PlannerError(_SPEC_FIELDS[exc.field], exc.message) from None
    updated: Plan = plan.model_copy(update={"planning_s": time.perf_counter() - started})
    return updated


NODE_LOCAL_CHECKPOINTS = (
    "spec.checkpoint.volume is unset: each pod writes its checkpoints to its own emptyDir, which goes with "
    "the pod, so a restart (a failure that leaves some layers on no survivor, or a slow node replaced) is "
    "planned as starting over from the initial weights; name a shared (ReadWriteMany) claim there to restart "
    "from the last checkpoint"
)
"""The Warning Event (`CheckpointNodeLocal`) with a job's first plan when it has no checkpoint volume: why its
restarts are priced as they are (`checkpoint_state`)."""


def warn_node_local_checkpoints(spec: ResilientJobSpec) -> bool:
    """Whether the job's first plan comes with the `CheckpointNodeLocal` warning: it trains a model (the
    synthetic loop writes no checkpoint, so there is nothing to lose) and names no checkpoint volume."""
    return not spec.checkpoint.volume and model_source(spec.model) is not ModelSource.SYNTHETIC


def checkpoint_state(spec: ResilientJobSpec, current: Plan, step: int | None) -> CheckpointState | None:
    """What a checkpoint restart could start from at global step `step`. The agents write checkpoints into
    `spec.checkpoint.path` (the claim `spec.checkpoint.volume`, else a directory of the pod) on their
    schedule: every `interval_steps`, or for a time interval every `interval_s / step time` steps as the
    current plan estimates it; the last one due is taken as written. None when the step is unknown: the
    planner then charges half an interval, the expected loss. (`checkpoint.path` is required, so every job
    the operator runs writes checkpoints.)

    Without a volume the path is an emptyDir of each pod: every node keeps only the layers it wrote, no
    restart finds a complete checkpoint, and a restart starts over from the initial weights. It is priced
    so: every step so far redone."""
    if step is None:
        return None
    if not spec.checkpoint.volume:
        return CheckpointState(configured=True, step=step, last_step=None)
    every = spec.checkpoint.interval_steps
    if not every and current.step_time_s > 0:
        every = max(1, int(spec.checkpoint.interval_s / current.step_time_s))
    last = step - step % every if every else 0
    return CheckpointState(configured=True, step=step, last_step=last or None)


def plan_next(
    spec: ResilientJobSpec,
    inputs: PlannerInputs,
    current: Plan,
    *,
    failed: Collection[int] = (),
    joined: Collection[int] = (),
    emptied: Collection[int] = (),
    step: int | None = None,
    failure_rate_per_node_hour: float = 0.01,
) -> Plan:
    """Generation current+1 for the given changes at global step `step` (None: unknown), its candidates
    scored over the time between failures at the failure rate (the planner's default; `rjob plan` may ask
    another); PlannerError when no plan can run the job."""
    started = time.perf_counter()
    plan: Plan = replan(
        current,
        inputs.profile,
        inputs.cluster,
        inputs.job,
        failed=sorted(failed),
        joined=sorted(joined),
        emptied=sorted(emptied),
        standby=(),  # every ready idle node is in `joined`; an idle id without a running pod is not alive
        policy=spec.policy,
        costs=inputs.costs,
        checkpoint=checkpoint_state(spec, current, step),
        failure_rate_per_node_hour=failure_rate_per_node_hour,
    )
    updated: Plan = plan.model_copy(update={"planning_s": time.perf_counter() - started})
    return updated
