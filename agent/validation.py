"""The validation pass (Falcon 4.3, "Validation"): with training held at an iteration boundary, benchmark
every device of a group with a GEMM and every link of its ring or tree communicator with equal-size
point-to-point transfers in the planner's O(1) pass schedules, then name the slow GPUs and links.

All ranks of the group call `validate` at the same iteration boundary (the runtime's step loop is the natural
place: nothing is in flight there, so the training's own collectives are "held" simply by not being issued).
Every rank returns the same report. The pass's own traffic is kept out of the trace (`Tracer.quiet`) but
still passes the tracer's hook, so an injected slow link (`agent.chaos`) slows the validation's transfers
exactly as it slows training's.

Each measurement is the best of `repeats` runs: interference from other processes on a shared host only ever
adds time, so the minimum is the device's or link's own speed. Within a pass no rank sends or receives twice
(the schedules guarantee it). Both ends time each transfer from the barrier that starts it and the link is
charged the larger of the two, so a delay on either side of the link is charged to that link.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeVar

import torch
import torch.distributed as dist

from resilientjob.planner.failslow import (
    Link,
    binary_tree_parents,
    ring_schedule,
    slow_gpus,
    slow_links,
    tree_schedule,
)

from . import chaos, tracing
from ._device_sync import synchronize

SUSPICION_FACTOR = 1.1
LINK_FLOOR_S = 1e-3
"""A link is named only if it is also this much slower than the median link: below it, differences are
scheduling noise of a shared host (measured: up to ~0.3 ms on a loaded 2-core machine). Size `link_bytes`
so that a healthy transfer takes well over it on real networks."""
LINK_TARGET_S = 5e-3
"""On an accelerator the pass grows its link payload until the median link takes at least this long: 64 KiB
crosses a 200 Gb/s fabric in a few microseconds, where only a link ~100x slower would clear `LINK_FLOOR_S`.
At 5 ms a link 1.2x slower than the median clears both the factor and the floor. Not sized on a GPU yet (no
lease has run it); a CPU host's 64 KiB already takes a good part of a millisecond, so it keeps its size."""
LINK_MAX_BYTES = 1 << 26
"""The largest payload the sizing grows to: 64 MiB, small beside a training job's device memory (the pass
runs between steps, with the model and optimizer resident). A 400 Gb/s link moves it in ~1.3 ms, so a link
there is named from ~1.8x slower; NVLink links stay well under the target and are named only when several
times slower."""
_MAX_SIZINGS = 4
"""Rounds at most that grow a payload or a GEMM towards its target (each scales it by the shortfall)."""
GEMM_FLOOR_S = 5e-5
"""The same for devices; the best of several GEMMs is steadier than a transfer (a few microseconds)."""
GEMM_TARGET_S = 1e-3
"""On an accelerator the pass grows its GEMM until the median device takes at least this long: a 256 x 256
product is a kernel launch there (~10 us whatever the clock), so a throttled device timed the same as a
healthy one and no device cleared `GEMM_FLOOR_S`. Not sized on a GPU yet (no lease has run it)."""
GEMM_MAX_SIZE = 4096
"""The largest GEMM the sizing grows to: three 64 MiB float32 matrices beside the resident model, ~2.7 ms
of an H100's float32 products."""

TINY_BYTES = 4

Key = TypeVar("Key", int, Link)


class Topology(StrEnum):
    """The communicator shape whose links are validated."""

    RING = "ring"
    TREE = "tree"


@dataclass(frozen=True, slots=True)
class GemmResult:
    """One device's GEMM benchmark."""

    rank: int
    seconds: float
    flops_per_s: float


@dataclass(frozen=True, slots=True)
class LinkResult:
    """One directed link (global ranks): time of a tiny message and of the `nbytes` transfer."""

    link: Link
    latency_s: float
    seconds: float
    nbytes: int

    @property
    def bandwidth_bps(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else float("inf")


@dataclass(frozen=True, slots=True)
class ValidationReport:
    """What the pass measured and whom it names."""

    gemm: dict[int, GemmResult] = field(default_factory=dict)
    links: dict[Link, LinkResult] = field(default_factory=dict)
    slow_gpus: tuple[int, ...] = ()
    slow_links: tuple[Link, ...] = ()
    seconds: float = 0.0
    """Wall time of the whole pass (how long training was held)."""


def gemm_benchmark(
    size: int = 256,
    repeats: int = 5,
    device: str = "cpu",
    rank: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    stretched: bool = True,
) -> GemmResult:
    """Time `size` x `size` matrix products on `device` (best of `repeats` after a warm-up); 2 n^3 FLOPs each.

    A compute slowdown injected by `agent.chaos` stretches each timed product, as a throttled device would
    (`stretched=False`: the caller applies the order, as `_parked.measure`'s probes do; the sleeps between
    products also slowed the products themselves by 20-30% in CPU time, cold caches after each).
    `clock`: wall time by default; `time.thread_time` times a CPU product by the thread's own CPU time."""
    if size < 1 or repeats < 1:
        raise ValueError(f"size and repeats: must be >= 1, got {size} and {repeats}")
    target = torch.device(device)
    a = torch.randn(size, size, device=target)
    b = torch.randn(size, size, device=target)
    torch.matmul(a, b)  # warm-up: allocator, kernels, thread pool
    synchronize(target)
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        torch.matmul(a, b)
        synchronize(target)
        if stretched:
            chaos.after_compute(clock() - start)
        best = min(best, clock() - start)
    return GemmResult(rank=rank, seconds=best, flops_per_s=2.0 * size**3 / best)


@contextmanager
def _untraced() -> Iterator[None]:
    tracer = tracing.current()
    if tracer is None:
        yield
        return
    with tracer.quiet():
        yield


def schedule(topology: Topology, size: int) -> list[list[Link]]:
    """The planner's O(1) pass schedule for a communicator of `size` ranks (group-local rank numbers)."""
    if topology is Topology.RING:
        return ring_schedule(size)
    return tree_schedule(binary_tree_parents(size))


def link_tests(
    passes: Sequence[Sequence[Link]],
    nbytes: int = 1 << 16,
    repeats: int = 3,
    group: dist.ProcessGroup | None = None,
    device: str = "cpu",
) -> dict[Link, tuple[float, float]]:
    """Run the passes; return this rank's own view of its links: {global link: (latency_s, seconds)}.

    Both ends time each transfer on their own clock, from leaving the barrier to the end of their call; the
    caller keeps the larger of the two views (`merge_views`). Either alone can miss a delay: the receiver may
    leave the barrier late, after the data was already on its way, and a small send returns once buffered.
    `passes` use group-local ranks; every rank of the group must call this with the same arguments."""
    if nbytes < 1 or repeats < 1:
        raise ValueError(f"nbytes and repeats: must be >= 1, got {nbytes} and {repeats}")
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    me = ranks.index(dist.get_rank())
    # On the group's device: NCCL and HCCL send device tensors only.
    payloads = {
        size: torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        for size in (TINY_BYTES, nbytes)
    }
    measured: dict[Link, tuple[float, float]] = {}
    for links in passes:
        sends_to = dict(links)
        receives_from = {dst: src for src, dst in links}
        best = {TINY_BYTES: float("inf"), nbytes: float("inf")}
        for _ in range(repeats):
            for size, payload in payloads.items():
                dist.barrier(group=group)
                start = time.perf_counter()
                if me in sends_to:
                    dist.send(payload, dst=ranks[sends_to[me]], group=group)
                elif me in receives_from:
                    dist.recv(payload, src=ranks[receives_from[me]], group=group)
                best[size] = min(best[size], time.perf_counter() - start)
        if me in sends_to:
            measured[(ranks[me], ranks[sends_to[me]])] = (best[TINY_BYTES], best[nbytes])
        elif me in receives_from:
            measured[(ranks[receives_from[me]], ranks[me])] = (best[TINY_BYTES], best[nbytes])
    return measured


def merge_views(views: Sequence[Mapping[Link, tuple[float, float]]]) -> dict[Link, tuple[float, float]]:
    """Per link, the larger of its sender's and its receiver's measurements."""
    merged: dict[Link, tuple[float, float]] = {}
    for view in views:
        for link, (latency, seconds) in view.items():
            previous = merged.get(link, (0.0, 0.0))
            merged[link] = (max(previous[0], latency), max(previous[1], seconds))
    return merged


def _name(values: Mapping[Key, float], slow: Sequence[Key], floor_s: float) -> list[Key]:
    """Of the keys the planner flagged, those also at least `floor_s` slower than the median."""
    median = statistics.median(values.values())
    return [key for key in slow if values[key] - median >= floor_s]


def _gemm_round(
    ranks: Sequence[int],
    me: int,
    group: dist.ProcessGroup | None,
    device: str,
    gemm_size: int,
    repeats: int,
) -> dict[int, GemmResult]:
    """Every rank's GEMM benchmark, gathered to every rank."""
    mine: GemmResult | None = None
    if device == "cpu":
        # Everyone idle first: ranks reach the pass as they finish their last step, and the first turn,
        # timed while the others still computed beside it on the same cores, measured world rank 0 at 3.8x
        # the median in the demo (named a slow device with the really slow one).
        dist.barrier(group=group)
        for turn in ranks:
            if turn == me:
                mine = gemm_benchmark(gemm_size, repeats, device, me)
            dist.barrier(group=group)
    else:
        mine = gemm_benchmark(gemm_size, repeats, device, me)
    gathered: list[GemmResult | None] = [None] * len(ranks)
    dist.all_gather_object(gathered, mine, group=group)
    return {result.rank: result for result in gathered if result is not None}


def _slow_devices(gemm: Mapping[int, GemmResult], factor: float, floor_s: float) -> list[int]:
    """The ranks whose GEMM is `factor` x the median and at least `floor_s` slower than it."""
    seconds = {rank: result.seconds for rank, result in gemm.items()}
    return _name(seconds, slow_gpus(seconds, factor), floor_s) if seconds else []


def _link_round(
    passes: Sequence[Sequence[Link]],
    link_bytes: int,
    repeats: int,
    group: dist.ProcessGroup | None,
    size: int,
    device: str = "cpu",
) -> dict[Link, LinkResult]:
    """Every link of `passes` timed, both ends' views merged, gathered to every rank."""
    own = link_tests(passes, link_bytes, repeats, group, device)
    parts: list[dict[Link, tuple[float, float]] | None] = [None] * size
    dist.all_gather_object(parts, own, group=group)
    return {
        link: LinkResult(link, latency, seconds, link_bytes)
        for link, (latency, seconds) in merge_views([part or {} for part in parts]).items()
    }


Timed = TypeVar("Timed", GemmResult, LinkResult)


def _grown(
    timed_at: Callable[[int], dict[Key, Timed]], size: int, target_s: float, max_size: int, power: int
) -> tuple[dict[Key, Timed], int]:
    """`timed_at(size)`, then again with `size` grown (powers of two, at most `max_size`) until the median
    time reaches `target_s`: a fast device's or fabric's differences are otherwise lost under the floors. The
    last round and the size it ran at. `power`: how the work grows with the size (1 for a payload, 3 for a
    GEMM's side); while a fixed cost (a launch, a message's latency) dominates, the root of the shortfall
    undershoots and the loop takes another step. Every rank sees the same gathered times, so all of them
    grow alike."""
    timed = timed_at(size)
    for _ in range(_MAX_SIZINGS):
        median = statistics.median(result.seconds for result in timed.values()) if timed else target_s
        if median >= target_s or size >= max_size:
            break
        wanted = size * (target_s / max(median, 1e-9)) ** (1 / power)
        size = min(max_size, 1 << max(0, math.ceil(math.log2(wanted))))
        timed = timed_at(size)
    return timed, size


def _payload(measured: Mapping[Link, LinkResult], default: int) -> int:
    """The payload the links of `measured` were timed with (one size per round)."""
    return next((result.nbytes for result in measured.values()), default)


def _better_round(first: Mapping[Key, Timed], second: Mapping[Key, Timed]) -> dict[Key, Timed]:
    """Each device's or link's faster timing of two rounds (a stall does not come back; slowness does)."""
    return {
        key: min(result, second.get(key, result), key=lambda r: r.seconds) for key, result in first.items()
    }


def _slow_links(measured: Mapping[Link, LinkResult], factor: float, floor_s: float) -> list[Link]:
    """The links whose transfer is `factor` x the median and at least `floor_s` slower than it."""
    seconds = {link: result.seconds for link, result in measured.items()}
    return _name(seconds, slow_links(seconds, factor), floor_s) if seconds else []


def validate(
    topology: Topology = Topology.RING,
    group: dist.ProcessGroup | None = None,
    *,
    device: str = "cpu",
    gemm_size: int = 256,
    link_bytes: int = 1 << 16,
    repeats: int = 5,
    factor: float = SUSPICION_FACTOR,
    link_floor_s: float = LINK_FLOOR_S,
    gemm_floor_s: float = GEMM_FLOOR_S,
    gpus: bool = True,
    links: bool = True,
    link_target_s: float | None = None,
    gemm_target_s: float | None = None,
) -> ValidationReport:
    """The whole pass on `group` (default: the world); every member calls it and gets the same report.

    On a CPU the ranks of one host share cores, so they take turns at the GEMM; on accelerators they run it
    in parallel, as Falcon does. `link_target_s`: grow `link_bytes` until the median link takes this long
    (default `LINK_TARGET_S` on an accelerator, none on a CPU; 0 keeps `link_bytes`); `gemm_target_s` the
    same for `gemm_size` (`GEMM_TARGET_S`)."""
    accelerator = device != "cpu"
    if link_target_s is None:
        link_target_s = LINK_TARGET_S if accelerator else 0.0
    if gemm_target_s is None:
        gemm_target_s = GEMM_TARGET_S if accelerator else 0.0
    began = time.perf_counter()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    me = dist.get_rank()
    gemm: dict[int, GemmResult] = {}
    measured: dict[Link, LinkResult] = {}
    with _untraced():
        if gpus:
            gemm, gemm_size = _grown(
                lambda size: _gemm_round(ranks, me, group, device, size, repeats),
                gemm_size,
                gemm_target_s,
                GEMM_MAX_SIZE,
                power=3,
            )
            if _slow_devices(gemm, factor, gemm_floor_s):
                # A device named slow is timed again, with every other (the median must stay comparable),
                # turns in reverse order (interference tied to a moment of the pass hits another rank), and
                # each keeps its better round: a stall of a shared host's core during one turn does not
                # come back in the next, a slow device does. Every rank sees the same gathered times, so
                # all of them decide alike.
                gemm = _better_round(gemm, _gemm_round(ranks[::-1], me, group, device, gemm_size, repeats))
        if links:
            passes = schedule(topology, len(ranks))
            measured, link_bytes = _grown(
                lambda nbytes: _link_round(passes, nbytes, repeats, group, len(ranks), device),
                link_bytes,
                link_target_s,
                LINK_MAX_BYTES,
                power=1,
            )
            if _slow_links(measured, factor, link_floor_s):
                # As for a device: every link timed again, the passes in reverse order, each keeping its
                # better round. In a healthy 30-minute run of the demo on two cores, one round named link
                # 1 -> 3 (the best of its transfers late while the host was busy) and opened a
                # communication episode on it; a slow link delays every byte, in both rounds.
                retimed = _link_round(passes[::-1], link_bytes, repeats, group, len(ranks), device)
                measured = _better_round(measured, retimed)
    named_gpus = _slow_devices(gemm, factor, gemm_floor_s)
    named_links = _slow_links(measured, factor, link_floor_s)
    return ValidationReport(
        gemm=gemm,
        links=measured,
        slow_gpus=tuple(named_gpus),
        slow_links=tuple(named_links),
        seconds=time.perf_counter() - began,
    )


def with_links(
    report: ValidationReport,
    measured: Mapping[Link, LinkResult],
    factor: float = SUSPICION_FACTOR,
    floor_s: float = LINK_FLOOR_S,
) -> ValidationReport:
    """`report` with more measured links and the slow links named again over all of them (flagged by the
    planner's rule and at least `floor_s` slower than the median link)."""
    links = {**report.links, **measured}
    return dataclasses.replace(report, links=links, slow_links=tuple(_slow_links(links, factor, floor_s)))


def time_more_links(
    report: ValidationReport,
    passes: Sequence[Sequence[Link]],
    link_bytes: int | None = None,
    repeats: int = 5,
    device: str = "cpu",
) -> ValidationReport:
    """`report` (the world's pass) with the links of `passes` (world ranks: the data-parallel rings'
    `_worker_probe.ring_passes`) timed too and the slow links named over all of them; every rank of the
    world calls it. As `validate` does for its own links, a round that names one of these is followed by a
    second with the passes reversed, each link keeping its better round: a stall of a shared host does not
    come back, a slow link does. Timed once, the demo's data-parallel links 0->2, 2->0 and 7->4 were named
    in a healthy 30-minute run (2.3x to 8.2x the median, a few milliseconds) and opened communication
    episodes. `link_bytes` defaults to the payload the world's links were timed with (sized on an
    accelerator), so that every link is compared with the same median."""
    size = dist.get_world_size()
    link_bytes = link_bytes or _payload(report.links, 1 << 16)
    measured = _link_round(passes, link_bytes, repeats, None, size, device)
    if set(with_links(report, measured).slow_links) & set(measured):
        retimed = _link_round(list(passes)[::-1], link_bytes, repeats, None, size, device)
        measured = _better_round(measured, retimed)
    return with_links(report, measured)
