"""The store host's part of validation (Falcon 4.3): the operator's `ValidationRequest` (a Redis key) becomes
a request in the job's TCPStore with an iteration boundary every worker will reach, and world rank 0's
`ValidationResult` goes back to the Redis stream, exactly once per request id.

The boundary is the newest committed step (`committed`, written by world rank 0 after each step) plus
`BOUNDARY_MARGIN`: a worker cannot start that step before rank 0 has committed the ones in between, and the
request is in the store long before that, so every worker sees it at the same step and all of them run the
pass together (a worker that ran it alone would wait in its collectives for peers that never come).
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from pydantic import ValidationError

from resilientjob.protocol.keys import STREAM_MAXLEN, JobKeys
from resilientjob.protocol.messages import ValidationRequest, ValidationResult, decode, encode
from resilientjob.protocol.store_keys import COMMITTED_KEY, VALIDATION_REQUEST_KEY, validation_result_key

from ._worker_probe import BoundaryRequest

BOUNDARY_MARGIN = 3
"""Steps between the newest committed step and the validation boundary."""


class ValidationRelay:
    """Mirrors requests of the current generation into the store and forwards their results."""

    def __init__(self, client: aioredis.Redis, keys: JobKeys, store: Any) -> None:
        self.client = client
        self.keys = keys
        self.store = store
        self.seen = 0
        """Newest request id mirrored or ignored (ids only grow)."""
        self.pending: BoundaryRequest | None = None
        self.forwarded: list[int] = []

    async def poll(self, generation: int | None) -> None:
        """One look at the request key and at the pending result; `generation` is the mirrored plan's."""
        request = decode(
            ValidationRequest, await self.client.get(self.keys.validation_request), "bridge.validate"
        )
        if request is not None and request.id > self.seen and generation is not None:
            if request.generation < generation:
                self.seen = request.id  # asked of a world that no longer exists: ignored
                print(
                    f"store host: validation {request.id} is for generation {request.generation}; ignored",
                    flush=True,
                )
            elif request.generation == generation:
                self.seen = request.id
                self.pending = self.mirror(request)
            # a newer generation than the store has: mirrored once the host has published that plan
        if self.pending is not None and self.store.check([validation_result_key(self.pending.id)]):
            await self.forward(self.pending)

    def mirror(self, request: ValidationRequest) -> BoundaryRequest:
        committed = int(self.store.get(COMMITTED_KEY)) if self.store.check([COMMITTED_KEY]) else 0
        boundary = BoundaryRequest(
            request.id, request.generation, committed + BOUNDARY_MARGIN, request.topology
        )
        self.store.set(VALIDATION_REQUEST_KEY, boundary.encode())
        print(
            f"store host: validation {request.id} at step {boundary.step} of generation {request.generation}",
            flush=True,
        )
        return boundary

    async def forward(self, boundary: BoundaryRequest) -> None:
        raw = self.store.get(validation_result_key(boundary.id))
        try:
            result = ValidationResult.model_validate_json(raw)
        except ValidationError as exc:
            print(f"store host: validation {boundary.id} left an unreadable result: {exc}", flush=True)
            self.pending = None
            return
        await self.client.xadd(
            self.keys.validation_results, {"m": encode(result)}, maxlen=STREAM_MAXLEN, approximate=True
        )
        self.forwarded.append(boundary.id)
        self.pending = None
        print(
            f"store host: validation {boundary.id}: slow nodes {result.slow_nodes} links {result.slow_links}",
            flush=True,
        )
