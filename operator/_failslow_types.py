"""The fail-slow path's results: what the tracker asks the reconciler to publish (`Mitigation`, by
`Action`) and to report as Kubernetes Events (`Finding`). Shared by `_failslow`, which makes them, and
`_mitigation` and the reconciler, which act on them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

Link = tuple[int, int]
"""A slow link, (sender, receiver) as validation names it."""


class Action(StrEnum):
    """What the reconciler publishes for a mitigation (the strategy names of the status)."""

    MICROBATCH = "microbatch"
    TOPOLOGY = "topology"
    REPLACE = "replace"
    RESTORE = "restore"
    REVERT = "revert"  # the episode's first rung made the job slower: its plan is undone, the episode goes on


@dataclass(frozen=True, slots=True)
class Mitigation:
    """Publish `action` for `nodes` (slow node -> slowdown factor), and for slow `links`, now."""

    action: Action
    factors: dict[int, float]
    reason: str
    loss_s: float
    detect_s: float
    links: tuple[Link, ...] = ()
    measured: str = ""
    """What the tracker measured: the step time now against the healthy one, and what each earlier rung of
    the episode changed (its step time when decided -> now)."""

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(sorted(self.factors))


class FindingKind(StrEnum):
    SLOW = "slow"  # an episode took these nodes in (NodeSlow)
    RECOVERED = "recovered"  # a slow node's recovery report (NodeRecovered)
    DISMISSED = "dismissed"  # a report the job-wide rule or a validation pass did not confirm
    SLOW_LINK = "slow-link"  # validation named slow links
    SLOW_DEVICE = "slow-device"  # validation named slow devices


@dataclass(frozen=True, slots=True)
class Finding:
    """Something the reconciler reports as a Kubernetes Event."""

    kind: FindingKind
    nodes: tuple[int, ...]
    message: str
    links: tuple[Link, ...] = ()
