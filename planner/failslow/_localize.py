"""Localisation (Falcon 4.3): suspicious groups from profiles, O(1)-pass link validation, naming the culprit.

1. Profiling: communication groups whose data-transfer time exceeds 1.1x the median are suspicious (slow
   links make a group transfer for longer, while healthy groups idle waiting for it); the same test on compute
   time flags groups with a slow GPU.
2. Validation schedules: every link of a ring or tree communicator is benchmarked with peer-to-peer sends in a
   constant number of passes, whatever the group size. In one pass no rank sends or receives twice, so the
   transfers do not contend and a slow one is the link's fault. A ring needs 2 passes (even size) or 3 (odd);
   a binary tree needs 4 (left then right children at even depths, then at odd depths).
3. Naming: transfers of equal size that take longer than 1.1x the median name the slow links; GEMM tests that
   take longer than 1.1x the median name the slow GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

import numpy as np

from ..errors import PlannerError

SUSPICION_FACTOR = 1.1  # Falcon: "longer than 1.1x median value are classified as suspicious"

Link = tuple[int, int]
"""A directed link (sender rank, receiver rank)."""

Key = TypeVar("Key", int, tuple[int, int])


class RootCause(StrEnum):
    """What slowed training down: it decides which mitigations can help (Falcon Table 3)."""

    COMPUTE = "compute"
    COMMUNICATION = "communication"


@dataclass(frozen=True, slots=True)
class GroupProfile:
    """Profiled time per iteration of one worker group: computing, and transferring data (not waiting)."""

    group: int
    compute_s: float
    transfer_s: float

    def __post_init__(self) -> None:
        for name in ("compute_s", "transfer_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise PlannerError(name, f"group {self.group}: must be finite and >= 0, got {value}")


@dataclass(frozen=True, slots=True)
class Suspects:
    """Groups to validate, by the kind of time that is too long."""

    compute: tuple[int, ...]
    communication: tuple[int, ...]

    @property
    def causes(self) -> tuple[RootCause, ...]:
        found = []
        if self.compute:
            found.append(RootCause.COMPUTE)
        if self.communication:
            found.append(RootCause.COMMUNICATION)
        return tuple(found)


def _above_median(values: Mapping[Key, float], factor: float) -> list[Key]:
    if factor < 1:
        raise PlannerError("factor", f"must be >= 1, got {factor}")
    if not values:
        return []
    median = float(np.median(list(values.values())))
    return [key for key, value in values.items() if value > factor * median]


def suspicious_groups(profiles: Sequence[GroupProfile], factor: float = SUSPICION_FACTOR) -> Suspects:
    """Groups whose compute or transfer time exceeds `factor` x the median over all groups."""
    groups = [p.group for p in profiles]
    if len(set(groups)) != len(groups):
        raise PlannerError("profiles", "each group must be profiled once")
    compute = _above_median({p.group: p.compute_s for p in profiles}, factor)
    transfer = _above_median({p.group: p.transfer_s for p in profiles}, factor)
    return Suspects(compute=tuple(sorted(compute)), communication=tuple(sorted(transfer)))


def ring_schedule(size: int) -> list[list[Link]]:
    """Passes covering every link i -> i+1 (mod size) of a ring: 2 for an even size, 3 for an odd one."""
    if size < 1:
        raise PlannerError("size", f"a ring needs at least one rank, got {size}")
    if size == 1:
        return []
    links = [(rank, (rank + 1) % size) for rank in range(size)]
    if size % 2 == 0:
        return [links[0::2], links[1::2]]
    # Odd: the closing link (size-1 -> 0) would reuse rank 0, already sending in the first pass.
    return [links[0 : size - 1 : 2], links[1 : size - 1 : 2], [links[-1]]]


def binary_tree_parents(size: int) -> list[int | None]:
    """Parent of each rank in the heap-ordered binary tree NCCL-style trees use (rank 0 is the root)."""
    if size < 1:
        raise PlannerError("size", f"a tree needs at least one rank, got {size}")
    return [None] + [(rank - 1) // 2 for rank in range(1, size)]


def _depths(parents: Sequence[int | None]) -> list[int]:
    size = len(parents)
    roots = [rank for rank, parent in enumerate(parents) if parent is None]
    if len(roots) != 1:
        raise PlannerError("parents", f"a tree has exactly one root, got {len(roots)}")
    depth: dict[int, int] = {}
    for rank in range(size):
        path: list[int] = []
        on_path: set[int] = set()
        node: int | None = rank
        while node is not None and node not in depth:
            if node in on_path or not 0 <= node < size:
                raise PlannerError("parents", f"rank {rank}: parent chain loops or leaves the group")
            path.append(node)
            on_path.add(node)
            node = parents[node]
        base = -1 if node is None else depth[node]
        for offset, member in enumerate(reversed(path), start=1):
            depth[member] = base + offset
    return [depth[rank] for rank in range(size)]


def tree_schedule(parents: Sequence[int | None]) -> list[list[Link]]:
    """Four passes covering every child -> parent link of a binary tree.

    Pass 1: left children at even depths; pass 2: right children at even depths; passes 3-4: the same at odd
    depths. Senders in a pass share a depth parity and receivers have the other, and a parent has one left
    and one right child, so no rank appears twice in a pass. Passes with no links (tiny trees) are omitted.
    """
    depths = _depths(parents)
    children: dict[int, list[int]] = {}
    for rank, parent in enumerate(parents):
        if parent is not None:
            children.setdefault(parent, []).append(rank)
    for parent, kids in children.items():
        if len(kids) > 2:
            raise PlannerError("parents", f"rank {parent} has {len(kids)} children; a binary tree has <= 2")
    passes: list[list[Link]] = [[], [], [], []]
    for parent, kids in sorted(children.items()):
        for side, child in enumerate(sorted(kids)):
            passes[2 * (depths[child] % 2) + side].append((child, parent))
    return [sorted(links) for links in passes if links]


def slow_links(durations: Mapping[Link, float], factor: float = SUSPICION_FACTOR) -> list[Link]:
    """Links whose equal-size transfer took longer than `factor` x the median transfer."""
    return sorted(_above_median(durations, factor))


def slow_gpus(gemm_s: Mapping[int, float], factor: float = SUSPICION_FACTOR) -> list[int]:
    """GPUs whose standard GEMM test took longer than `factor` x the median GPU."""
    return sorted(_above_median(gemm_s, factor))
