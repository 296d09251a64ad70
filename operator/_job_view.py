"""What the controller's helpers (`_capacity`, `_profile_source`) see of a job's controller: a narrow,
typed view (`JobView`), so that they do not import `reconciler`, which imports them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from . import _decide, api
from ._redis_state import JobRedis
from ._redis_watch import RedisWatch
from .kube import KubeApi
from .planning import PlannerInputs
from .settings import OperatorSettings


class JobView(Protocol):
    """One job's controller (`reconciler.JobController`), as its helpers use it."""

    status: api.ResilientJobStatus
    """The job's status as the operator means to write it (`write_status` patches it)."""

    @property
    def namespace(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def kube(self) -> KubeApi: ...

    @property
    def settings(self) -> OperatorSettings: ...

    @property
    def body(self) -> Mapping[str, Any]:
        """The job object as last seen."""

    @property
    def pods(self) -> dict[int, _decide.PodView]:
        """The job's worker pods by node, as the watch last saw them."""

    @property
    def inputs(self) -> PlannerInputs | None: ...

    @property
    def redis(self) -> JobRedis | None: ...

    @property
    def watch(self) -> RedisWatch: ...

    @property
    def wakeup(self) -> asyncio.Event:
        """Set by pod events: the job's loop runs at once."""

    def require_spec(self) -> api.ResilientJobSpec: ...

    def event(self, kind: str, reason: api.Reason, message: str) -> None: ...

    async def write_status(self, force: bool) -> None: ...

    async def create_pods(
        self, nodes: Iterable[int], generation: int, layout: str, strikes: Mapping[int, int] | None = None
    ) -> None: ...
