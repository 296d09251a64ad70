"""Node 0's pre-flight before the first plan: the workload checked, and the model's per-layer profile when
only a pod can make it; and the wait for the first plan.

The model's checkpoint and the data live on volumes of the pods, which the operator cannot read, so the
operator creates the pods without a plan and sets a `ModelProfileRequest` in Redis; node 0's agent, waiting
for the first plan, answers with a `ModelProfileReport`. Node 0 builds the model as the runtime does and
checks what every worker would otherwise find only at its start: the checkpoint's tensors and shapes (the
safetensors headers), the data (missing, shorter than one sample, an odd dtype, token ids beyond the
vocabulary on a sample), bf16 on a GPU without it. When asked, it also makes the profile: computed from
`<dir>/config.json` or the configuration of `hf:<family>?k=v` (`planner.hf_profile`: FLOPs at an
accelerator's nominal speed or a CPU's timed matrix-product rate, exact bytes) or measured
(`profiler.measure_profile`), with the layer count of the model as the runtime builds it. A failure is one
line and the spec field it names. The operator validates the report, keeps a profile in a ConfigMap of the
job, and plans, or fails the job naming the field before any worker trains.

Every agent waits here, however long that takes: the store host registers only once a plan exists, so
asking for the store earlier would time out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resilientjob.protocol.messages import (
    MAX_PROFILE_BYTES,
    PROFILE_NODE,
    ModelProfileReport,
    ModelProfileRequest,
    PlanAnnouncement,
    decode,
    encode,
)
from resilientjob.protocol.workload import Precision, Workload

from ._device_work import DeviceWork
from ._redis import REDIS_DOWN
from .telemetry import Telemetry

if TYPE_CHECKING:
    from resilientjob.planner.profile import ModelProfile

    from .models import ModelSpec

POLL_S = 0.25
"""How often an agent without a plan looks for the plan (and node 0 for a request)."""


def _check_workload(
    model: ModelSpec, workload: Workload, cache_dir: Path | None, global_batch: int = 0, job: str = ""
) -> None:
    """What every worker would find at its start, found once, before any plan: the checkpoint's tensors
    (headers only), the data (a file shorter than one sample, an odd dtype, token ids beyond the model's
    vocabulary on a sample), the output and checkpoint directories (the latter claimed for `job`,
    `namespace/name`), and bf16 where the device has none. Raises ValueError naming the field."""
    from .data import open_dataset

    if model.hf is not None:
        model.hf.check_checkpoint()
    cache = cache_dir if cache_dir is not None else Path(tempfile.gettempdir()) / "rjob-data"
    dataset = open_dataset(workload.data, vocab=model.vocab, cache_dir=cache)
    if dataset.num_samples < global_batch:
        # A step draws its samples without repeats: a smaller data set trains some twice in every step.
        raise _FieldError(
            "spec.data.path",
            f"{workload.data.path or 'the synthetic data'} holds {dataset.num_samples} samples of "
            f"seqLen {workload.data.seq_len}, fewer than one global batch ({global_batch})",
        )
    if workload.output is not None:
        _check_output(Path(workload.output.path))
    if workload.checkpoint.path and job:
        _claim_checkpoints(Path(workload.checkpoint.path), job)
    if workload.training.precision is Precision.BF16 and workload.device == "cuda":
        import torch

        if torch.cuda.is_available() and not _native_bf16(torch):
            raise _FieldError("spec.training.precision", "bf16: this job's GPUs do not support it; use fp32")


def _check_output(directory: Path) -> None:
    """That the trained model can be written where `spec.output.path` says, found before any step: a job
    that trained to its end and then could not write its model had lost the training (and its workers'
    failure read as node failures). The directory is created, and a file written and removed in it."""
    probe = directory / f".rjob-write-check-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise _FieldError(
            "spec.output.path", f"{directory}: cannot write the trained model there: {reason}"
        ) from None


def _claim_checkpoints(directory: Path, job: str) -> None:
    """The checkpoint directory claimed for this job (`checkpoint.claim`): one that another job's
    checkpoints fill fails the job before it trains, not at its first restart, nor by deleting them."""
    from .checkpoint import CheckpointTaken, claim

    try:
        claim(directory, job)
    except CheckpointTaken as exc:
        raise _FieldError(
            "spec.checkpoint.path",
            f"{exc}: give this job a path of its own (steps are named by number, so each job would restore "
            "the other's weights and delete the other's steps)",
        ) from None
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise _FieldError(
            "spec.checkpoint.path", f"{directory}: cannot write checkpoints there: {reason}"
        ) from None


def _check_splits(model: ModelSpec, devices: int) -> None:
    """Whether a Hugging Face model's blocks split over a stage's `devices` (tensor parallelism,
    `_tensor_parallel`): found here from the configuration, not by a worker that would fail on every start."""
    if devices < 2 or model.hf is None:
        return
    from ._hf_models import HFFamily

    if model.hf.family is HFFamily.GPT2:
        raise _FieldError(
            "spec.gpusPerNode",
            f"{devices}: GPT-2 blocks have no tensor-parallel split (their q, k and v are one fused Conv1D); "
            "use gpusPerNode: 1, or a Llama, Qwen2 or Mistral model",
        )
    from ._tensor_parallel import config_heads

    for name, count in zip(("attention", "key/value"), config_heads(model.hf.config), strict=True):
        if count % devices:
            raise _FieldError(
                "spec.gpusPerNode",
                f"{devices}: the model's {count} {name} heads do not split evenly over them",
            )


def _native_bf16(torch: Any) -> bool:
    """Whether the GPU computes bf16 itself: emulated bf16 (V100, T4) runs many times slower than fp32."""
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch before the keyword: Ampere (8.0) and later compute bf16
        return bool(torch.cuda.get_device_capability() >= (8, 0))


class _FieldError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _failed_field(error: Exception) -> str:
    """The spec field an error is charged to: the one it names (DataError, _FieldError), else the model."""
    named = getattr(error, "field", None)
    return named if isinstance(named, str) and named.startswith("spec.") else "spec.model"


def make_report(
    request: ModelProfileRequest,
    workload: Workload,
    model_options: Mapping[str, object],
    node: int,
    cache_dir: Path | None = None,
    job: str = "",
) -> ModelProfileReport:
    """Build the model as the runtime does, check the workload (its checkpoint directory claimed for `job`,
    `namespace/name`) and, when asked, profile the model (blocking: run it in a thread)."""
    from .models import load_model

    try:
        try:
            model = load_model(request.model, **{"seq_len": request.seq_len, **model_options})
        except ValueError as exc:
            if not str(exc).startswith("seq_len: "):
                raise
            # What the model cannot take is the data's sequence length: that is the field to change.
            raise _FieldError("spec.data.seqLen", str(exc).removeprefix("seq_len: ")) from None
        _check_splits(model, request.devices_per_stage)
        _check_workload(model, workload, cache_dir, request.global_batch, job)
        profile = _profile(request, workload, model) if request.profile else None
    except Exception as exc:  # the user's model code may raise anything: one line naming a field, no crash
        line = " ".join(str(exc).split())
        if not isinstance(exc, ValueError | OSError | ImportError):  # PlannerError, DataError are ValueErrors
            line = f"{type(exc).__name__}: {line}"
        field = _failed_field(exc)
        # Errors of the model say "model: ..."; the operator's line names the spec field once.
        line = line.removeprefix(f"{field}: ").removeprefix("model: ")
        return ModelProfileReport(
            request=request,
            node=node,
            error=line[:4096] or repr(exc),
            error_field=field,
            sent_at=time.time(),
        )
    return ModelProfileReport(
        request=request,
        node=node,
        num_layers=model.num_layers,
        measured=request.measure and profile is not None,
        profile=profile,
        sent_at=time.time(),
    )


def _profile(request: ModelProfileRequest, workload: Workload, model: ModelSpec) -> ModelProfile:
    """The per-layer profile the request asks for: timed on the device, or computed from the model's
    Hugging Face config (`profiler.computed_profile`)."""
    from .profiler import computed_profile

    if not request.measure:
        return computed_profile(
            request.model, request.seq_len, request.microbatch_size, workload.device, built=model
        )
    from .profiler import measure_profile
    from .worker import worker_device

    # The first device made current (torch_npu loaded for an NPU): this runs in the agent's device child.
    device = worker_device(workload.device, 0)
    # Timed as it will train: bf16 layers run several times faster than fp32 on a tensor-core GPU.
    bf16 = workload.training.precision is Precision.BF16
    try:
        return measure_profile(model, request.microbatch_size, device=device, bf16=bf16)
    except (ValueError, RuntimeError) as exc:  # out of device memory, a layer that cannot run
        raise _FieldError("spec.profile.measure", f"timing the layers failed: {exc}") from None


class _Answerer:
    """Node 0's side: answer each request once, and again if the report vanished (Redis was emptied)."""

    def __init__(self, telemetry: Telemetry, workload: Workload, model_options: Mapping[str, object]) -> None:
        self.telemetry = telemetry
        self.workload = workload
        self.model_options = model_options
        self.answered: ModelProfileReport | None = None
        self.device_work = DeviceWork(workload.device)
        """Builds, checks and times the model off the agent's process on an accelerator (`_device_work`)."""

    async def poll(self) -> None:
        client, keys = self.telemetry.client, self.telemetry.keys
        request = decode(ModelProfileRequest, await client.get(keys.profile_request), "agent.profile_request")
        if request is None:
            return
        present = decode(
            ModelProfileReport,
            await client.get(keys.profile_report),
            "agent.profile_report",
            MAX_PROFILE_BYTES,
        )
        if present is not None and present.request == request:
            return
        report = self.answered
        if report is None or report.request != request:
            what = "measuring" if request.measure else "computing"
            task = f"{what} the profile of" if request.profile else "checking"
            print(f"pre-flight: {task} {request.model} and the data for the operator", flush=True)
            job = f"{keys.namespace}/{keys.job}"
            report = await self.device_work.run(
                make_report, request, self.workload, dict(self.model_options), self.telemetry.node, None, job
            )
            failed = f"{report.error_field}: {report.error}"
            outcome = failed if report.error else f"{report.num_layers} layers, workload checked"
            print(f"pre-flight: {outcome}", flush=True)
            self.answered = report
        await client.set(keys.profile_report, encode(report))


async def wait_for_first_plan(
    telemetry: Telemetry,
    stopped: asyncio.Event,
    workload: Workload,
    model_options: Mapping[str, object],
) -> PlanAnnouncement | None:
    """The published plan, once there is one (None when `stopped` first); node 0 answers the operator's
    profile requests meanwhile."""
    answerer = _Answerer(telemetry, workload, model_options) if telemetry.node == PROFILE_NODE else None
    try:
        return await _first_plan(telemetry, stopped, answerer)
    finally:
        if answerer is not None:
            answerer.device_work.close()


async def _first_plan(
    telemetry: Telemetry, stopped: asyncio.Event, answerer: _Answerer | None
) -> PlanAnnouncement | None:
    announced = False
    while not stopped.is_set():
        wait_s = POLL_S
        try:
            published = await telemetry.current_plan()
            if published is not None:
                return published
            if not announced:
                print("waiting for the job's first plan", flush=True)
                announced = True
            if answerer is not None:
                await answerer.poll()
        except REDIS_DOWN as exc:  # Redis away: keep waiting with backoff, as the heartbeats do
            wait_s = max(POLL_S, telemetry.outage.failed(exc))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopped.wait(), wait_s)
    return None
