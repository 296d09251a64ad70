"""The chaos order: what `rjob chaos slow|break|hang|clear` (and `rjob local chaos`) write and a worker obeys.

The order lives at `JobKeys.chaos(node)` as JSON and expires with it; what a worker does with it is
`agent.chaos`'s (its module doc). It is part of the wire contract so that the commands that write it need
neither torch nor the agent: they start in a fraction of a second. Part of `resilientjob.protocol`: pydantic
and the standard library only (a Redis client is passed in, typed by what is called on it).
"""

from __future__ import annotations

import math
import time
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .keys import JobKeys

ALLOW_ENV = "RJOB_ALLOW_CHAOS"
"""Environment variable that must be "1" for a worker to obey chaos orders."""

MAX_FACTOR = 100.0
"""The largest slowdown an order may ask for."""

EXPIRY_MARGIN_S = 60.0
"""How long the key outlives its order: nothing stale is left behind, and a clock a little behind still
reads the order to its end."""


class ChaosOrder(BaseModel):
    """One slowdown (or fault) order for one node."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    factor: float = Field(ge=1.0, le=MAX_FACTOR)
    """Compute (or the link's transfers) take this many times as long."""
    until: float
    """Unix time at which the order expires."""
    link: int | None = Field(default=None, ge=0)
    """Slow the link to this peer node (traffic with it both ways, collectives whose bytes cross it)
    instead of compute."""
    latency_s: float = Field(default=0.001, ge=0.0, le=10.0)
    """Nominal per-message time of the slowed link."""
    bandwidth_bps: float = Field(default=1e9, gt=0.0)
    """Nominal bytes per second of the slowed link."""
    fault: Literal["break", "hang"] | None = None
    """Instead of a slowdown: `break` the worker's next call once, or `hang` it until `until`
    (`agent.chaos`). `factor` is 1 with a fault."""
    switch: Literal[True] | None = None
    """A `break` that waits for the worker's next switch to a new generation and breaks its first call
    there, as a reset during a reconfiguration would (written only when set, as the other optional
    fields)."""

    @model_validator(mode="after")
    def _finite(self) -> ChaosOrder:
        if not math.isfinite(self.until):
            raise ValueError("until: must be a finite unix time")
        if self.fault is not None and (self.factor != 1.0 or self.link is not None):
            raise ValueError("fault: an order is a slowdown (factor, link) or a fault, not both")
        if self.switch and self.fault != "break":
            raise ValueError("switch: only a break waits for the next switch")
        return self

    def active(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) < self.until

    def link_delay_s(self, nbytes: float, messages: int = 1) -> float:
        """The extra time of `messages` messages carrying `nbytes` in all over the slowed link."""
        return (self.factor - 1.0) * (messages * self.latency_s + nbytes / self.bandwidth_bps)


class OrderStore(Protocol):
    """What the order's writers call on a (synchronous) Redis client."""

    def set(self, name: str, value: str, *, px: int) -> object: ...

    def delete(self, *names: str) -> object: ...


def parse_order(raw: bytes | str | None) -> ChaosOrder | None:
    """The order stored in the control key, or None when absent or malformed (never raises)."""
    if raw is None:
        return None
    try:
        return ChaosOrder.model_validate_json(raw)
    except (ValidationError, ValueError):
        return None


def write_order(client: OrderStore, keys: JobKeys, node: int, order: ChaosOrder) -> None:
    """Publish an order; the key expires with it (plus a margin) so nothing stale is left behind."""
    ttl_ms = max(1, int((order.until - time.time() + EXPIRY_MARGIN_S) * 1000))
    client.set(keys.chaos(node), order.model_dump_json(exclude_none=True), px=ttl_ms)


def clear_order(client: OrderStore, keys: JobKeys, node: int) -> bool:
    """Withdraw a node's order; True if there was one."""
    return bool(client.delete(keys.chaos(node)))
