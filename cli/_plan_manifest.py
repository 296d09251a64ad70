"""The planner inputs of a ResilientJob manifest, for `rjob plan -f`: the spec validated as the API server
and the operator validate it, with the command line's flags as edits of it, and the profile the operator
would plan with:

- `spec.profile.inline`, or a built-in profile named by the model (`llama2-7b`, `synthetic:bert-large`);
- `spec.profile.configMapRef`: the ConfigMap of that name in the same file;
- a Hugging Face model without a profile (`hf:<dir>`, `hf:<family>?k=v`): computed from its config as node
  0's agent computes it (`agent.profiler.computed_profile`; `hf:<dir>` must be readable here);
- `--profile` in place of any of these (and the only way for `spec.profile.measure`, which times node 0's
  device)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resilientjob.operator import api
from resilientjob.operator.planning import (
    PlannerInputs,
    configmap_profile,
    planner_inputs,
    profile_from_pod,
    profile_request,
)
from resilientjob.planner import PlannerError
from resilientjob.planner.profile import ModelProfile

from ._common import CliError
from ._manifest_files import Document, load_documents

SPEC_FLAGS = {
    "nodes": "nodes",
    "gpus_per_node": "gpusPerNode",
    "global_batch": "globalBatchSize",
    "microbatch_size": "microBatchSize",
    "ft": "faultTolerance",
    "device_memory": "deviceMemory",
    "policy": "policy",
}
"""`rjob plan` flag (argparse dest) -> the spec field it edits when a manifest is given."""


@dataclass(frozen=True, slots=True)
class ManifestJob:
    """A manifest's job as the operator would plan it."""

    name: str
    spec: api.ResilientJobSpec
    inputs: PlannerInputs
    profile_source: str
    """Where the profile came from, in words, for the human output."""


def manifest_job(path: Path, edits: Mapping[str, Any], profile: str | None) -> ManifestJob:
    """The one ResilientJob of the file at `path`, its spec fields in `edits` (camelCase) replaced, planned
    with the profile file or built-in name `profile` if given. CliError naming the file and field."""
    documents = load_documents(path)
    jobs = [d for d in documents if d.body.get("kind") == api.KIND]
    if not jobs:
        raise CliError(f"{path}: no {api.KIND} in the file")
    if len(jobs) > 1:
        names = ", ".join(str(d.body["metadata"]["name"]) for d in jobs)
        raise CliError(f"{path}: holds {len(jobs)} {api.KIND}s ({names}); plan one file per job")
    job = jobs[0]
    raw = job.body.get("spec")
    try:
        spec = api.parse_spec({**raw, **edits} if isinstance(raw, Mapping) else raw, as_served=True)
        referenced: dict[str, Any] | None
        given: ModelProfile | None
        if profile is not None:
            referenced, given, source = None, ModelProfile.load(profile), f"--profile {profile}"
        else:
            referenced, given, source = _profile(spec, documents)
        inputs = planner_inputs(spec, referenced, given)
    except PlannerError as exc:
        raise CliError(f"{job.where}: {exc}") from None
    return ManifestJob(str(job.body["metadata"]["name"]), spec, inputs, source)


def _profile(
    spec: api.ResilientJobSpec, documents: list[Document]
) -> tuple[dict[str, Any] | None, ModelProfile | None, str]:
    """What `planner_inputs` takes: the decoded profile of a ConfigMap (`referenced`), or the one computed
    as node 0 computes it (in place of the spec's); neither where the spec or a built-in gives it. And
    where it came from."""
    source = spec.profile
    if source is not None and source.inline is not None:
        return None, None, f"spec.profile.inline ({len(source.inline)} layers)"
    if source is not None and source.config_map_ref is not None:
        ref = source.config_map_ref
        found = [
            d
            for d in documents
            if d.body.get("kind") == "ConfigMap" and d.body["metadata"]["name"] == ref.name
        ]
        if not found:
            raise PlannerError(
                "spec.profile.configMapRef",
                f"ConfigMap {ref.name!r} is not in this file (the operator reads it from the cluster); "
                "add it or give --profile",
            )
        return configmap_profile(found[0].body, ref), None, f"ConfigMap {ref.name} key {ref.key}"
    if source is not None and source.measure:
        raise PlannerError(
            "spec.profile.measure",
            "the layers are timed on node 0's device when the job starts; give --profile (`rjob profile` "
            "times a model on this machine)",
        )
    if profile_from_pod(spec):
        from resilientjob.agent.profiler import computed_profile
        from resilientjob.planner.hf_profile import NOMINAL_FLOPS

        request = profile_request(spec, has_inputs=False)
        device = spec.device_resource.device_kind
        try:
            computed = computed_profile(request.model, request.seq_len, request.microbatch_size, device)
        except (ValueError, OSError, ImportError) as exc:  # PlannerError, bad config, no transformers
            line = " ".join(str(exc).split())
            if line.startswith("seq_len: "):  # the data's length is what the model cannot take
                raise PlannerError("spec.data.seqLen", line.removeprefix("seq_len: ")) from None
            raise PlannerError(
                "spec.model",
                f"{line.removeprefix('model: ')} (node 0 reads it in its pod; here, give --profile instead)",
            ) from None
        speed = (
            "at this machine's CPU speed"
            if device == "cpu"
            else f"at an accelerator's nominal {NOMINAL_FLOPS / 1e12:.0f} TFLOP/s"
        )
        return None, computed, f"computed from the model's config, as node 0 does ({speed})"
    return None, None, f"built-in profile of {spec.model}"
