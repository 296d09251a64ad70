"""The validation pass in real gloo processes: a slow link injected with `agent.chaos` is named among the
ring's and the tree's links, a compute slowdown names its device, and a healthy group names nothing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from test_tracing import run_gloo

from resilientjob.agent import chaos, tracing, validation
from resilientjob.agent.chaos import ChaosInjector
from resilientjob.agent.validation import (
    GemmResult,
    LinkResult,
    Topology,
    gemm_benchmark,
    merge_views,
    schedule,
    validate,
)
from resilientjob.protocol.chaos import ChaosOrder

# serial: the validation pass compares ranks' GEMM and link timings
pytestmark = [pytest.mark.serial, pytest.mark.torch]

ALLOW = {"RJOB_ALLOW_CHAOS": "1"}


def test_gemm_benchmark_reports_flops_of_its_products() -> None:
    result = gemm_benchmark(size=64, repeats=3, rank=5)
    assert result.rank == 5 and result.seconds > 0
    assert result.flops_per_s == pytest.approx(2 * 64**3 / result.seconds)
    with pytest.raises(ValueError, match="size"):
        gemm_benchmark(size=0)


def test_merge_keeps_the_slower_view_of_each_link() -> None:
    sender = {(0, 1): (0.005, 0.006), (2, 3): (0.001, 0.002)}
    receiver = {(0, 1): (0.002, 0.007), (3, 0): (0.001, 0.001)}
    assert merge_views([sender, receiver]) == {
        (0, 1): (0.005, 0.007),
        (2, 3): (0.001, 0.002),
        (3, 0): (0.001, 0.001),
    }


def test_schedules_are_the_planners_o1_passes() -> None:
    assert schedule(Topology.RING, 4) == [[(0, 1), (2, 3)], [(1, 2), (3, 0)]]
    assert len(schedule(Topology.RING, 5)) == 3
    tree = schedule(Topology.TREE, 7)
    assert sorted(link for links in tree for link in links) == [
        (1, 0),
        (2, 0),
        (3, 1),
        (4, 1),
        (5, 2),
        (6, 2),
    ]
    assert len(tree) <= 4
    for links in tree:  # no rank sends or receives twice in one pass
        ranks = [rank for link in links for rank in link]
        assert len(ranks) == len(set(ranks))


def _validate_under_chaos(rank: int, world: int) -> dict[str, Any]:
    tracer = tracing.install(capacity=64)
    injector = ChaosInjector()
    chaos.activate(injector, tracer, ALLOW)
    until = time.time() + 60
    if rank == 1:
        injector.order = ChaosOrder(factor=6.0, until=until, link=2)  # ring link 1 -> 2
    if rank == 3:
        injector.order = ChaosOrder(factor=6.0, until=until, link=1)  # tree link 3 -> 1
    if rank == 2:
        injector.order = ChaosOrder(factor=3.0, until=until)  # a slow device
    ring = validate(Topology.RING, gemm_size=192, link_bytes=1 << 14, repeats=7)
    tree = validate(Topology.TREE, gemm_size=192, link_bytes=1 << 14, repeats=7, gpus=False)
    injector.order = None
    healthy = validate(Topology.RING, gemm_size=192, link_bytes=1 << 14, repeats=7)
    # On a loaded 2-core host one healthy GEMM or link can time slow by chance (a CI run named GPU 1 once):
    # a healthy job must come back clean within three passes. Every rank sees the same merged result, so
    # all of them take the same number of passes.
    for _ in range(2):
        if not (healthy.slow_links or healthy.slow_gpus):
            break
        healthy = validate(Topology.RING, gemm_size=192, link_bytes=1 << 14, repeats=7)
    traced = len(tracer.ring.records())
    chaos.activate(None, tracer)
    tracing.uninstall()
    return {"ring": ring, "tree": tree, "healthy": healthy, "traced": traced}


def test_validation_names_the_slow_link_and_the_slow_device(tmp_path: Path) -> None:
    results = run_gloo(tmp_path, 4, _validate_under_chaos)
    for result in results:
        ring, tree, healthy = result["ring"], result["tree"], result["healthy"]
        assert result["traced"] == 0  # the pass's own traffic stays out of the trace
        assert set(ring.links) == {(0, 1), (1, 2), (2, 3), (3, 0)}
        assert ring.slow_links == ((1, 2),)
        # The slowed device is named and the slowest (a full suite on 2 cores can name a healthy one
        # beside it; the operator's job-wide compute rule dismisses those).
        assert 2 in ring.slow_gpus and max(ring.gemm, key=lambda r: ring.gemm[r].seconds) == 2
        assert set(tree.links) == {(1, 0), (2, 0), (3, 1)}
        assert tree.slow_links == ((3, 1),)
        assert tree.gemm == {}
        assert healthy.slow_links == () and healthy.slow_gpus == ()
        # the slowed link's latency carries the injected (F - 1) x 1 ms per message
        assert ring.links[(1, 2)].latency_s >= 0.005 > healthy.links[(1, 2)].latency_s
    assert all(r["ring"].slow_links == results[0]["ring"].slow_links for r in results)


def _link_slower_than_the_payload_shows(rank: int, world: int) -> dict[str, Any]:
    tracer = tracing.install(capacity=64)
    injector = ChaosInjector()
    chaos.activate(injector, tracer, ALLOW)
    # Link 1 -> 2 moves its bytes at a third of a 1 GB/s fabric's speed: 16 KiB is 33 us late there, lost
    # under the 1 ms floor, as 64 KiB is on a real 200 Gb/s fabric.
    if rank == 1:
        injector.order = ChaosOrder(factor=3.0, until=time.time() + 60, link=2, latency_s=0.0)
    fixed = validate(Topology.RING, link_bytes=1 << 14, repeats=3, gpus=False)
    sized = validate(Topology.RING, link_bytes=1 << 14, repeats=3, gpus=False, link_target_s=0.01)
    chaos.activate(None, tracer)
    tracing.uninstall()
    return {"fixed": fixed, "sized": sized}


def test_the_link_payload_grows_until_a_link_slower_than_the_floor_can_show_is_named(tmp_path: Path) -> None:
    # Three ranks: one link per pass (the ring's passes of four pair two transfers on this host's two
    # cores, and megabytes moved side by side time up to 1.3x apart, a noise the CPU's fixed size avoids).
    for result in run_gloo(tmp_path, 3, _link_slower_than_the_payload_shows):
        fixed, sized = result["fixed"], result["sized"]
        assert fixed.slow_links == () and {r.nbytes for r in fixed.links.values()} == {1 << 14}
        # Named, and the slowest by far. (Whether a healthy pass stays clean at this size is a question
        # for a real fabric: on two shared cores, megabytes moved by different ranks time up to 1.3x apart,
        # which is why a CPU keeps its fixed 64 KiB.)
        assert (1, 2) in sized.slow_links, sized.links
        assert max(sized.links, key=lambda link: sized.links[link].seconds) == (1, 2)
        (grown,) = {r.nbytes for r in sized.links.values()}  # one size for every link of the pass
        assert grown > 1 << 14


def test_a_payload_grows_in_powers_of_two_until_the_median_link_takes_the_target() -> None:
    """The sizing's arithmetic on a modelled fabric (0.1 ms a message, 10 GB/s): each round scales the
    payload by the shortfall, a latency-bound round undershoots and takes another, the cap holds."""
    sizes: list[int] = []

    def modelled_round(nbytes: int) -> dict[tuple[int, int], LinkResult]:
        sizes.append(nbytes)
        seconds = 1e-4 + nbytes / 1e10
        return {link: LinkResult(link, 1e-4, seconds, nbytes) for link in [(0, 1), (1, 2), (2, 0)]}

    measured, nbytes = validation._grown(modelled_round, 1 << 16, 5e-3, validation.LINK_MAX_BYTES, power=1)
    # 64 KiB takes 0.11 ms: the shortfall asks for 2.9 MB, rounded up to 4 MiB (0.52 ms: the latency had
    # hidden the bandwidth), then 64 MiB (6.8 ms).
    assert sizes == [1 << 16, 1 << 22, 1 << 26] and nbytes == 1 << 26
    assert {result.nbytes for result in measured.values()} == {1 << 26}
    sizes.clear()
    assert validation._grown(modelled_round, 1 << 16, 5e-3, 1 << 24, power=1)[1] == 1 << 24
    assert sizes == [1 << 16, 1 << 22, 1 << 24]  # the cap, short of the target
    sizes.clear()
    validation._grown(modelled_round, 1 << 16, 0.0, validation.LINK_MAX_BYTES, power=1)
    assert sizes == [1 << 16]  # no target (a CPU's): the size asked


def _device_slower_than_a_small_gemm_shows(rank: int, world: int) -> dict[str, Any]:
    tracer = tracing.install(capacity=64)
    injector = ChaosInjector()
    chaos.activate(injector, tracer, ALLOW)
    # Device 2 computes at a third of its speed. (Whether 8 x 8 would hide it cannot be shown here: the
    # chaos sleep of a few microseconds takes the kernel's ~50 us timer slack, over the floor by itself.)
    if rank == 2:
        injector.order = ChaosOrder(factor=3.0, until=time.time() + 60)
    sized = validate(Topology.RING, gemm_size=8, repeats=3, links=False, gemm_target_s=2e-3)
    chaos.activate(None, tracer)
    tracing.uninstall()
    return {"sized": sized}


def test_a_grown_gemm_names_the_slow_device_in_real_processes(tmp_path: Path) -> None:
    for result in run_gloo(tmp_path, 3, _device_slower_than_a_small_gemm_shows):
        sized = result["sized"]
        assert sized.slow_gpus == (2,), sized.gemm
        # Grown past 8: the products' FLOP rate says their size (2 n^3 per product).
        sizes = {round((r.flops_per_s * r.seconds / 2) ** (1 / 3)) for r in sized.gemm.values()}
        assert len(sizes) == 1 and sizes.pop() > 8


def test_a_gemm_grows_in_powers_of_two_until_the_median_device_takes_the_target() -> None:
    """On a modelled accelerator (10 us a launch, 50 TFLOP/s): the cube root of the shortfall, rounded up to
    a power of two, a launch-bound round undershooting, the cap."""
    sizes: list[int] = []

    def modelled_round(size: int) -> dict[int, GemmResult]:
        sizes.append(size)
        seconds = 1e-5 + 2 * size**3 / 5e13
        return {rank: GemmResult(rank, seconds, 2 * size**3 / seconds) for rank in range(3)}

    gemm, size = validation._grown(modelled_round, 256, 1e-3, validation.GEMM_MAX_SIZE, power=3)
    # 256 takes 11 us: x4.5 in size asks for 1,162, rounded up to 2,048 (0.35 ms), then 4,096 (2.8 ms).
    assert sizes == [256, 2048, 4096] and size == 4096
    assert {round((r.flops_per_s * r.seconds / 2) ** (1 / 3)) for r in gemm.values()} == {4096}
    sizes.clear()
    assert validation._grown(modelled_round, 256, 1e-3, 1024, power=3)[1] == 1024
    assert sizes == [256, 1024]


def _not_in_group(rank: int, world: int) -> list[int]:
    group = dist.new_group([0, 1])
    if rank == 2:
        return []
    report = validate(Topology.RING, group=group, gemm_size=32, link_bytes=64, repeats=2)
    return sorted(report.gemm)


def test_validation_runs_on_a_subgroup(tmp_path: Path) -> None:
    assert run_gloo(tmp_path, 3, _not_in_group) == [[0, 1], [0, 1], []]


def _one_stalled_turn(rank: int, world: int) -> dict[str, Any]:
    from resilientjob.agent import validation

    tracer = tracing.install(capacity=64)
    injector = ChaosInjector()
    chaos.activate(injector, tracer, ALLOW)
    if rank == 2:
        injector.order = ChaosOrder(factor=4.0, until=time.time() + 60)  # a slow device
    if rank == 3:
        # A core of the shared host stalled during rank 3's first turn only (what a CI run timed at 1.2x).
        real, calls = validation.gemm_benchmark, []

        def stalled_once(*args: Any, **kwargs: Any) -> validation.GemmResult:
            result = real(*args, **kwargs)
            calls.append(result)
            if len(calls) > 1:
                return result
            return validation.GemmResult(result.rank, result.seconds * 3, result.flops_per_s / 3)

        validation.gemm_benchmark = stalled_once
    # What is tested is the second round: rank 3's stall (3x) and rank 2's slow device (4x) both pass a
    # factor of 1.5, and only rank 2 stays past it. Falcon's 1.1 would also name a healthy rank of this
    # host now and then: four ranks' best-of-10 GEMMs of ~0.25 ms differ by up to 30% here, in both rounds.
    report = validate(Topology.RING, gemm_size=192, repeats=10, factor=1.5, links=False)
    chaos.activate(None, tracer)
    tracing.uninstall()
    return {"slow": report.slow_gpus, "ranks": sorted(report.gemm)}


def test_a_device_named_slow_is_timed_again_and_a_one_off_stall_is_not_named(tmp_path: Path) -> None:
    for result in run_gloo(tmp_path, 4, _one_stalled_turn):
        assert result == {"slow": (2,), "ranks": [0, 1, 2, 3]}


def _stall_first_round(link: tuple[int, int], late_s: float = 0.005) -> None:
    """This rank's next call of `validation.link_tests` sees `link` `late_s` late (a stall of the host
    during that round), the calls after it as they are."""
    from resilientjob.agent import validation

    real, calls = validation.link_tests, []

    def stalled_once(*args: Any, **kwargs: Any) -> dict[Any, tuple[float, float]]:
        view = real(*args, **kwargs)
        calls.append(view)
        if len(calls) == 1:
            latency, seconds = view[link]
            view[link] = (latency, seconds + late_s)
        return view

    validation.link_tests = stalled_once


def _one_stalled_link_round(rank: int, world: int) -> dict[str, Any]:

    tracer = tracing.install(capacity=64)
    injector = ChaosInjector()
    chaos.activate(injector, tracer, ALLOW)
    if rank == 1:
        injector.order = ChaosOrder(factor=6.0, until=time.time() + 60, link=2)  # ring link 1 -> 2
    if rank == 3:
        # The host stalled rank 3 in its first round of link tests only: its view of link 2 -> 3 5 ms
        # late, what a healthy run of the demo named once.
        _stall_first_round((2, 3))
    report = validate(Topology.RING, link_bytes=1 << 14, repeats=5, gpus=False)
    chaos.activate(None, tracer)
    tracing.uninstall()
    return {"slow": report.slow_links, "links": sorted(report.links)}


def test_a_link_named_slow_is_timed_again_and_a_one_off_stall_is_not_named(tmp_path: Path) -> None:
    for result in run_gloo(tmp_path, 4, _one_stalled_link_round):
        assert result == {"slow": ((1, 2),), "links": [(0, 1), (1, 2), (2, 3), (3, 0)]}


def _ring_links_with_one_stalled_round(rank: int, world: int) -> dict[str, Any]:
    from resilientjob.agent._worker_probe import ring_passes
    from resilientjob.agent.validation import time_more_links

    tracer = tracing.install(capacity=64)
    injector = ChaosInjector()
    chaos.activate(injector, tracer, ALLOW)
    world_pass = validate(Topology.RING, link_bytes=1 << 14, repeats=5, gpus=False)
    if rank == 1:
        injector.order = ChaosOrder(factor=6.0, until=time.time() + 60, link=3)  # the pair 1 - 3, both ways
    if rank == 2:
        # The host stalled rank 2 in its first round of the data-parallel rings' tests only: its view of
        # link 0 -> 2 5 ms late, as a healthy run of the demo timed (and named) 0 -> 2 once.
        _stall_first_round((0, 2))
    # Two data-parallel rings of two ranks each (as a DP2 x PP2 plan has), none of their links in the world's.
    report = time_more_links(world_pass, ring_passes([[0, 2], [1, 3]]), link_bytes=1 << 14)
    chaos.activate(None, tracer)
    tracing.uninstall()
    return {"slow": report.slow_links, "links": sorted(report.links)}


def test_a_data_parallel_ring_link_named_slow_is_timed_again_and_a_one_off_stall_is_not_named(
    tmp_path: Path,
) -> None:
    for result in run_gloo(tmp_path, 4, _ring_links_with_one_stalled_round):
        assert result["slow"] == ((1, 3), (3, 1)), result
        assert result["links"] == [(0, 1), (0, 2), (1, 2), (1, 3), (2, 0), (2, 3), (3, 0), (3, 1)]
