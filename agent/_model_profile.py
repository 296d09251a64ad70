"""The model's per-layer profile when only a pod can make it, and the wait for the first plan.

The planner needs a profile before the first plan. For an `hf:<dir>` model the config lives on a volume of
the pods, which the operator cannot read; with `spec.profile.measure` the layers must be timed on the job's
own devices. So the operator creates the pods without a plan and sets a `ModelProfileRequest` in Redis; node
0's agent, waiting for the first plan, answers with a `ModelProfileReport`: the profile computed from
`<dir>/config.json` or the configuration of `hf:<family>?k=v` (`planner._hf_profile`: FLOPs at the nominal
device speed, exact bytes) or measured
(`profiler.measure_profile`), with the layer count of the model as the runtime builds it, or one line naming
what is wrong (a missing config.json, an unsupported family). The operator validates it, keeps it in a
ConfigMap of the job, and plans.

Every agent waits here, however long that takes: the store host registers only once a plan exists, so
asking for the store earlier would time out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

from redis.exceptions import RedisError

from resilientjob.protocol.models import HF_PREFIX, ModelSource, model_source
from resilientjob.protocol.workload import Workload

from ._redis import JobKeys
from .telemetry import Telemetry
from .telemetry_messages import (
    MAX_PROFILE_BYTES,
    ModelProfileReport,
    ModelProfileRequest,
    PlanAnnouncement,
    decode,
    encode,
)

POLL_S = 0.25
"""How often an agent without a plan looks for the plan (and node 0 for a request)."""

PROFILE_NODE = 0
"""The node whose agent answers profile requests."""


def request_key(keys: JobKeys) -> str:
    """Redis key of the operator's `ModelProfileRequest`."""
    return f"{keys.prefix}model-profile:request"


def report_key(keys: JobKeys) -> str:
    """Redis key of node 0's `ModelProfileReport`."""
    return f"{keys.prefix}model-profile:report"


def make_report(
    request: ModelProfileRequest, workload: Workload, model_options: dict[str, int | float], node: int
) -> ModelProfileReport:
    """Build the model as the runtime does and profile it (blocking: run it in a thread)."""
    from resilientjob.planner._hf_profile import profile_from_hf_config

    from .models import load_model

    try:
        model = load_model(request.model, **{"seq_len": request.seq_len, **model_options})
        if request.measure:
            from .profiler import measure_profile

            device = "cpu" if workload.device == "cpu" else f"{workload.device}:0"
            profile = measure_profile(model, request.microbatch_size, device=device)
        elif model_source(request.model) is ModelSource.HF_DIRECTORY:
            path = Path(request.model.removeprefix(HF_PREFIX)) / "config.json"
            try:
                config = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"model: cannot read {path}: {exc}") from None
            if not isinstance(config, dict):
                raise ValueError(f"model: {path} does not hold a JSON object")
            profile = profile_from_hf_config(
                config, request.seq_len, request.microbatch_size, name=request.model
            )
        elif model.hf is not None:  # hf:<family>?k=v: the configuration the model string spells out
            profile = profile_from_hf_config(
                model.hf.config.to_dict(), request.seq_len, request.microbatch_size, name=request.model
            )
        else:
            raise ValueError(f"model: {request.model} has no Hugging Face config to compute a profile from")
    except (ValueError, OSError, ImportError) as exc:  # PlannerError is a ValueError
        return ModelProfileReport(
            request=request,
            node=node,
            error=" ".join(str(exc).split())[:4096] or repr(exc),
            sent_at=time.time(),
        )
    return ModelProfileReport(
        request=request,
        node=node,
        num_layers=model.num_layers,
        measured=request.measure,
        profile=profile,
        sent_at=time.time(),
    )


class _Answerer:
    """Node 0's side: answer each request once, and again if the report vanished (Redis was emptied)."""

    def __init__(
        self, telemetry: Telemetry, workload: Workload, model_options: dict[str, int | float]
    ) -> None:
        self.telemetry = telemetry
        self.workload = workload
        self.model_options = model_options
        self.answered: ModelProfileReport | None = None

    async def poll(self) -> None:
        client, keys = self.telemetry.client, self.telemetry.keys
        request = decode(ModelProfileRequest, await client.get(request_key(keys)), "agent.profile_request")
        if request is None:
            return
        present = decode(
            ModelProfileReport, await client.get(report_key(keys)), "agent.profile_report", MAX_PROFILE_BYTES
        )
        if present is not None and present.request == request:
            return
        report = self.answered
        if report is None or report.request != request:
            what = "measuring" if request.measure else "computing"
            print(f"profile: {what} the profile of {request.model} for the operator", flush=True)
            report = await asyncio.to_thread(
                make_report, request, self.workload, self.model_options, self.telemetry.node
            )
            print(f"profile: {report.error or f'{report.num_layers} layers'}", flush=True)
            self.answered = report
        await client.set(report_key(keys), encode(report))


async def wait_for_first_plan(
    telemetry: Telemetry,
    stopped: asyncio.Event,
    workload: Workload,
    model_options: dict[str, int | float],
) -> PlanAnnouncement | None:
    """The published plan, once there is one (None when `stopped` first); node 0 answers the operator's
    profile requests meanwhile."""
    answerer = _Answerer(telemetry, workload, model_options) if telemetry.node == PROFILE_NODE else None
    announced = False
    while not stopped.is_set():
        with contextlib.suppress(RedisError, OSError):  # Redis away: keep waiting, as the heartbeats do
            published = await telemetry.current_plan()
            if published is not None:
                return published
            if not announced:
                print("waiting for the job's first plan", flush=True)
                announced = True
            if answerer is not None:
                await answerer.poll()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopped.wait(), POLL_S)
    return None
