"""The fail-slow path's types: what the tracker asks the reconciler to publish (`Mitigation`, by `Action`)
and to report as Kubernetes Events (`Finding`), shared by `_failslow`, which makes them, and `_mitigation` and
the reconciler, which act on them; and the tracker's pending `Candidate` reports, with their stored form."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from resilientjob.protocol.messages import SlowReport

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
    steps: tuple[int, int] | None = None
    """The episode's (onset step, step at which the operator opened it): the detection delay in iterations
    that the Recovery row records, exact where sampling the status would not be."""
    devices: tuple[int, ...] = ()
    """The slow nodes whose own device is slow (`FailSlowTracker.devices`): S4 parks each of them, also
    one that is a slow link's end as well."""

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


@dataclass(slots=True)
class Candidate:
    """A slow report waiting to be confirmed (or one the operator's sweep made), as the tracker holds it."""

    report: SlowReport
    came_at: float
    confirmed_since: float | None = None
    confirmed_step: int = 0
    """The node's latest step when the current confirmation began."""
    validated: tuple[int, ...] | None = None
    """Communication: the nodes validation named (None: not validated yet; (): the pass timed out)."""
    swept: bool = False
    """Made by the operator's sweep of the job-wide rule, not reported by an agent."""
    devices: tuple[int, ...] = ()
    """Communication: the nodes among `validated` whose device validation timed slow (a link's end may be
    one too)."""
    job_level: bool = False
    """Made by the job-level trigger (`_failslow_job`), which judged the nodes' compute rise itself."""
    decisive_steps: int = 0
    """Compute: the length of the short first window that decided the node a straggler
    (`StragglerGate.decisive`; the second must decide it on as many steps), 0 while none has, -1 once the
    second did not: the full level windows confirm it then."""

    def state(self) -> dict[str, Any]:
        return {
            "report": self.report.model_dump(mode="json"),
            "came_at": self.came_at,
            "confirmed_since": self.confirmed_since,
            "confirmed_step": self.confirmed_step,
            "validated": None if self.validated is None else list(self.validated),
            "swept": self.swept,
            "devices": list(self.devices),
            "decisive_steps": self.decisive_steps,
            "job_level": self.job_level,
        }

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> Candidate:
        validated = raw.get("validated")
        return cls(
            SlowReport.model_validate(raw["report"]),
            float(raw["came_at"]),
            None if raw.get("confirmed_since") is None else float(raw["confirmed_since"]),
            int(raw.get("confirmed_step", 0)),
            None if validated is None else tuple(int(n) for n in validated),
            bool(raw.get("swept", False)),
            tuple(int(n) for n in raw.get("devices", ())),
            bool(raw.get("job_level", False)),
            int(raw.get("decisive_steps", 0)),
        )
