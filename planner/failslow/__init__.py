"""Fail-slow detection and mitigation (Falcon sections 4-5): pure algorithms, no I/O.

Detection: `iteration_times` (period of the collective-call stream by ACF), `ChangeDetector` and
`BatchDetector` (BOCD + verification, one stream or many workers), `SlidingWindowDetector` (the baseline).
Localisation: `suspicious_groups`, `ring_schedule`, `tree_schedule`, `slow_links`, `slow_gpus`.
Mitigation: `redistribute` (S2), `reroute_slow_links` (S3 a, scored by `link_load`), `consolidate_stragglers`
(S3 b), `MitigationController` (Algorithm 1, which names the nodes S4 hands to the fail-stop path);
`slowdown_removed` measures what a mitigation won back.
Labelled synthetic traces for tests and benchmarks live in `resilientjob.planner.failslow.tracegen`.
"""

from ._acf import CollectiveCall, IterationTimes, acf, encode, iteration_times, recurring_period
from ._bocd import BatchDetector, ChangeDetector, DetectorConfig
from ._events import ChangeEvent, ChangeKind
from ._links import LinkReroute, link_load, reroute_slow_links
from ._localize import (
    GroupProfile,
    Link,
    RootCause,
    Suspects,
    binary_tree_parents,
    ring_schedule,
    slow_gpus,
    slow_links,
    suspicious_groups,
    tree_schedule,
)
from ._mitigate import (
    NodeGrid,
    Redistribution,
    TopologyChange,
    consolidate_stragglers,
    redistribute,
    slowdown_removed,
)
from ._skirental import EFFECTIVE, Decision, MitigationController, MitigationCosts, Strategy
from ._window import SlidingWindowDetector, WindowConfig

__all__ = [
    "EFFECTIVE",
    "BatchDetector",
    "ChangeDetector",
    "ChangeEvent",
    "ChangeKind",
    "CollectiveCall",
    "Decision",
    "DetectorConfig",
    "GroupProfile",
    "IterationTimes",
    "Link",
    "LinkReroute",
    "MitigationController",
    "MitigationCosts",
    "NodeGrid",
    "Redistribution",
    "RootCause",
    "SlidingWindowDetector",
    "Strategy",
    "Suspects",
    "TopologyChange",
    "WindowConfig",
    "acf",
    "binary_tree_parents",
    "consolidate_stragglers",
    "encode",
    "iteration_times",
    "link_load",
    "recurring_period",
    "redistribute",
    "reroute_slow_links",
    "ring_schedule",
    "slow_gpus",
    "slow_links",
    "slowdown_removed",
    "suspicious_groups",
    "tree_schedule",
]
