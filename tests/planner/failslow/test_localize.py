"""Profiling suspects, O(1)-pass validation schedules (property tests over sizes), naming the culprit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilientjob.planner import PlannerError
from resilientjob.planner.failslow import (
    GroupProfile,
    Link,
    RootCause,
    binary_tree_parents,
    ring_schedule,
    slow_gpus,
    slow_links,
    suspicious_groups,
    tree_schedule,
)


def _assert_disjoint_cover(passes: list[list[Link]], links: set[Link]) -> None:
    covered = [link for links_in_pass in passes for link in links_in_pass]
    assert sorted(covered) == sorted(links)  # every link exactly once
    for links_in_pass in passes:
        ranks = [rank for link in links_in_pass for rank in link]
        assert len(ranks) == len(set(ranks))  # no rank sends or receives twice in a pass


@given(size=st.integers(2, 400))
@settings(max_examples=120, deadline=None)
def test_ring_is_covered_in_two_or_three_passes(size: int) -> None:
    passes = ring_schedule(size)
    _assert_disjoint_cover(passes, {(rank, (rank + 1) % size) for rank in range(size)})
    assert len(passes) == (2 if size % 2 == 0 else 3)


def test_single_rank_ring_has_nothing_to_validate() -> None:
    assert ring_schedule(1) == []
    with pytest.raises(PlannerError):
        ring_schedule(0)


@given(size=st.integers(1, 400))
@settings(max_examples=120, deadline=None)
def test_heap_tree_is_covered_in_four_passes(size: int) -> None:
    parents = binary_tree_parents(size)
    passes = tree_schedule(parents)
    _assert_disjoint_cover(
        passes, {(child, parent) for child, parent in enumerate(parents) if parent is not None}
    )
    assert len(passes) <= 4
    if size >= 7:
        assert len(passes) == 4


@st.composite
def _binary_trees(draw: st.DrawFn) -> list[int | None]:
    """Random binary trees: each new rank hangs under an earlier rank that has fewer than two children."""
    size = draw(st.integers(1, 120))
    parents: list[int | None] = [None]
    children = [0]
    for _ in range(1, size):
        open_ranks = [rank for rank, count in enumerate(children) if count < 2]
        parent = draw(st.sampled_from(open_ranks))
        parents.append(parent)
        children[parent] += 1
        children.append(0)
    order = draw(st.permutations(range(size)))  # arbitrary rank numbering
    relabelled: list[int | None] = [None] * size
    for rank, parent in enumerate(parents):
        relabelled[order[rank]] = None if parent is None else order[parent]
    return relabelled


@given(parents=_binary_trees())
@settings(max_examples=150, deadline=None)
def test_any_binary_tree_is_covered_in_at_most_four_passes(parents: list[int | None]) -> None:
    passes = tree_schedule(parents)
    _assert_disjoint_cover(
        passes, {(child, parent) for child, parent in enumerate(parents) if parent is not None}
    )
    assert len(passes) <= 4


def test_malformed_trees_are_rejected() -> None:
    with pytest.raises(PlannerError, match="3 children"):
        tree_schedule([None, 0, 0, 0])
    with pytest.raises(PlannerError, match="one root"):
        tree_schedule([None, None, 0])
    with pytest.raises(PlannerError, match="loops"):
        tree_schedule([None, 2, 1])


def test_profiling_flags_groups_over_one_point_one_times_the_median() -> None:
    profiles = [GroupProfile(g, compute_s=1.0, transfer_s=0.5) for g in range(8)]
    profiles[3] = GroupProfile(3, compute_s=1.0, transfer_s=0.56)  # 12% over: suspicious
    profiles[5] = GroupProfile(5, compute_s=1.3, transfer_s=0.54)  # 8% over on transfer: fine
    suspects = suspicious_groups(profiles)
    assert suspects.communication == (3,)
    assert suspects.compute == (5,)
    assert suspects.causes == (RootCause.COMPUTE, RootCause.COMMUNICATION)
    with pytest.raises(PlannerError) as info:
        GroupProfile(0, compute_s=-1.0, transfer_s=0.0)
    assert info.value.field == "compute_s"


@pytest.mark.parametrize("size", [5, 8, 33])
def test_validation_names_the_injected_slow_link(size: int) -> None:
    rng = np.random.default_rng(size)
    bandwidth = {link: 25e9 * rng.uniform(0.97, 1.03) for link in [(r, (r + 1) % size) for r in range(size)]}
    slow = (size // 2, size // 2 + 1)
    bandwidth[slow] = 25e9 * 0.6  # congested
    payload = 256e6
    durations = {}
    for links in ring_schedule(size):
        for link in links:  # one pass: the links run at once, disjoint, so each is timed on its own
            durations[link] = payload / bandwidth[link]
    assert slow_links(durations) == [slow]


def test_validation_names_the_slow_gpu_in_a_tree() -> None:
    parents = binary_tree_parents(15)
    assert tree_schedule(parents)
    gemm = {gpu: 0.010 * (1 + 0.01 * np.sin(gpu)) for gpu in range(15)}
    gemm[9] = 0.0125  # thermally throttled, 25% slower
    assert slow_gpus(gemm) == [9]
    assert slow_gpus({}) == []
    with pytest.raises(PlannerError):
        slow_gpus(gemm, factor=0.9)
