"""Chaos injection inside a worker: a slow GPU (duty-cycle compute delay) or a slow link (delay on sends to
one peer) for a while, ordered through a Redis control key. A user feature (`rjob chaos slow`,
`rjob local chaos slow`), also what the tests and the demo use to create fail-slows on purpose.

The order (`protocol.chaos.ChaosOrder`: the commands that write it import no torch) lives at
`JobKeys.chaos(node)` (`rjob:{namespace}:{job}:chaos:{node}`) as JSON: `{"factor": F,
"until": <unix time>, "link": PEER?, "latency_s": ..., "bandwidth_bps": ...}`; `factor` and `until` are the
format the synthetic loop of the local stack already reads. Without `link` the worker's compute slows down:
after every compute interval (the time between two traced `torch.distributed` calls, or a span the runtime
passes to `after_compute`), the worker sleeps (F - 1) x that interval, so compute takes F times as long. A
step's first interval counts from the step's start (`Tracer.compute_begins`): the wait between steps is not
compute, and stretching it slowed a worker more the less work S2 left it.
A worker that reports committed steps (the runtime's, through `_worker_probe`) is topped up per step as
well (`stretch_step`): at the end of each step it sleeps what is missing for the step's compute, as its
own trace measures it (wall time less the time held by communication), to be F times the compute without
the injected delay, so the factor the worker reports is the factor ordered. Stretching the gaps between
calls alone undershoots there: waits that return on helper threads move the "previous call ended" mark
into the middle of the compute, and the demo's x2 order measured only ~1.3x.
With `link`, the link between this node and the peer node is congested, in both directions: a call that
moves bytes over it is preceded by a delay of (F - 1) x (messages x latency_s + bytes / bandwidth_bps) for the
messages and bytes that cross the link, as behind a link whose nominal latency and bandwidth the order names
(1 ms and 1 GB/s unless given). The link is a property of the pair of nodes, whichever end sends:
- point-to-point traffic with the peer, sent or received (pipeline activations one way, their gradients
  the other; the validation's link tests; a batch of requests with that peer only);
- ring collectives (all-reduce, reduce-scatter, all-gather: gloo's ring, in group-rank order) of a group in
  which the two ends are ring neighbours, for the bytes of the hop between them: an all-reduce moves
  2 (n - 1) / n of the tensor over every hop in 2 (n - 1) messages, an all-gather (n - 1) contributions,
  a reduce-scatter (n - 1) / n of its input. Every member waits for the slowest hop, so the delay on this
  end slows the whole group, as the real link would; a ring in which the two are not neighbours sends
  nothing over the link;
- other collectives (broadcast, reduce, gather, scatter, all-to-all, barrier) of a group holding both ends:
  their trees and stars may put any pair on a step, so the call's bytes are counted as crossing once.
Only the node holding the order sleeps (before its own call, so the data it sends or waits for moves that
much later): the other end's waits come from the collective or the receive itself.

Two faults that leave the worker alive, for what a slowdown cannot show (`rjob chaos break`, `rjob chaos
hang`), as `"fault"` in the order:
- `break`: the worker's next `torch.distributed` call raises a `RuntimeError` once, as a connection reset
  under it would (the peers then time out in the same collective, as behind a real reset): the whole world
  abandons its step while every node stays alive. With `switch`, the first call of the worker's next switch
  to a new generation (its rendezvous's step agreement) instead: the world abandons the switch.
- `hang`: the worker's next call blocks until the order expires or is cleared, as a stuck kernel or a
  deadlock would; its agent keeps beating.

Off by default: `start` does nothing unless `RJOB_ALLOW_CHAOS=1` is in the worker's environment (the
operator sets it only for jobs whose spec allows chaos), so a stray key cannot slow a production job.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping

import redis
import torch.distributed as dist
from redis.exceptions import RedisError

from resilientjob.protocol.chaos import ALLOW_ENV, ChaosOrder, parse_order
from resilientjob.protocol.keys import JobKeys

from .tracing import Tracer

POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv"})
"""Calls that move data between two named ranks (the others are collectives of a group); a link order
slows them when their peer is the order's, in either direction."""
RING_ALL_REDUCE = frozenset({"all_reduce", "all_reduce_coalesced"})
RING_ALL_GATHER = frozenset({"all_gather", "all_gather_into_tensor"})
RING_REDUCE_SCATTER = frozenset({"reduce_scatter", "reduce_scatter_tensor"})
RING = RING_ALL_REDUCE | RING_ALL_GATHER | RING_REDUCE_SCATTER
"""Collectives gloo runs as a ring in group-rank order: only neighbours exchange bytes."""

MAX_GAP_S = 10.0
"""Longest compute interval stretched: a worker idle between phases (waiting for a plan) is not compute."""

POLL_INTERVAL_S = 0.25


class ChaosNotAllowed(PermissionError):
    """Chaos was requested where the job does not allow it."""


class BrokenOnOrder(RuntimeError):
    """A `break` order's fault: a communication error, as the worker takes any RuntimeError of a step."""


def crossing(
    op: str, group: tuple[int, ...], me: int | None, peer: int, target: int, nbytes: int
) -> tuple[float, int] | None:
    """(bytes, messages) that call `op` of `me` (a global rank; None: unknown) moves over the link
    me-`target`, or None when none of its traffic crosses it. `peer` is a point-to-point call's other side;
    `group` the global ranks of a collective's group in group-rank order; `nbytes` this rank's tensor."""
    if op in POINT_TO_POINT:
        return (float(nbytes), 1) if peer == target else None
    if target not in group or (me is not None and me not in group):
        return None
    n = len(group)
    if op in RING:
        if not ring_neighbours(group, me, target) or n < 2:
            return None
        if op in RING_ALL_REDUCE:
            return 2 * (n - 1) / n * nbytes, 2 * (n - 1)
        if op in RING_ALL_GATHER:
            return float((n - 1) * nbytes), n - 1
        return (n - 1) / n * nbytes, n - 1
    return float(nbytes), 1


def ring_neighbours(group: tuple[int, ...], me: int | None, peer: int) -> bool:
    """Whether a ring collective of `group` (global ranks in group-rank order, the order gloo's and NCCL's
    rings follow) sends over the link me-peer: the two are adjacent in the ring, the closing link included.
    Without a known own rank, any group holding the peer counts."""
    if peer not in group:
        return False
    if me is None or me not in group:
        return me is None
    distance = abs(group.index(me) - group.index(peer))
    return distance == 1 or (distance == len(group) - 1 and distance > 0)


def allowed(environ: Mapping[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(ALLOW_ENV) == "1"


class ChaosInjector:
    """Applies the current order: the tracer's hook for calls, `after_compute` for explicit compute spans."""

    def __init__(
        self,
        rank_of: Callable[[int], int | None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        node: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.order: ChaosOrder | None = None
        """Replaced as a whole by the watcher (an atomic attribute store), read on every call."""
        self.rank_of = rank_of or (lambda node: node)
        """Maps the order's peer node to its current global rank (a new plan may renumber the ranks)."""
        self._sleep = sleep
        self._clock = clock
        self._late_s = 0.0
        """How much longer than asked the last compute delay slept: owed back by the next (`_delay`)."""
        self.node = node
        """This worker's node (its rank via `rank_of`); None: the process's rank in the default group."""
        self.injected_s = 0.0
        """Total delay injected so far, as slept (for the step's stretch, tests and logs)."""
        self._broken: set[float] = set()
        """The `break` orders (by their `until`) already carried out: each breaks one call."""
        self.switching = False
        """The worker is switching to a new generation (`switch_begins`), until its first step."""

    def _current(self) -> ChaosOrder | None:
        order = self.order
        return order if order is not None and order.active() else None

    def _me(self) -> int | None:
        if self.node is not None:
            return self.rank_of(self.node)
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else None

    def _delay(self, seconds: float) -> float:
        """Sleep `seconds` of compute delay; returns the time slept. A sleep wakes late (60-130 us on a busy
        host), and the lateness is compute time like the delay: one late wake-up per traced call, over a
        step of many short compute intervals, slowed a worker 5-9% more than ordered (bench_chaos_factor.py).
        So each delay owes the last one's lateness back, and many short delays sum to what was asked, to one
        late wake-up."""
        if seconds <= 0:
            return 0.0
        wanted = seconds - self._late_s
        if wanted <= 0:
            self._late_s = -wanted
            return 0.0
        began = self._clock()
        self._sleep(wanted)
        slept = max(self._clock() - began, wanted)  # a sleep that came back early owes nothing
        self._late_s = slept - wanted
        self.injected_s += slept
        return slept

    def __call__(self, op: str, peer: int, nbytes: int, gap_s: float, group: tuple[int, ...] = ()) -> float:
        """The tracer hook: runs before each traced call with the compute interval that preceded it and the
        global ranks of the call's group. A compute order sleeps here (the time counts as compute); a link
        order returns the delay for the tracer to spend inside the call, before the data leaves (it counts
        as communication, and the peers wait for it as behind a congested link)."""
        order = self._current()
        if order is None:
            return 0.0
        if order.fault is not None:
            self._fault(order, op)
            return 0.0
        if order.link is None:
            self._delay((order.factor - 1.0) * min(max(gap_s, 0.0), MAX_GAP_S))
            return 0.0
        target = self.rank_of(order.link)
        if target is None:
            return 0.0  # the peer node is not in the current plan: no traffic crosses the link
        crossed = crossing(op, group, self._me(), peer, target, nbytes)
        if crossed is None:
            return 0.0
        delay = order.link_delay_s(*crossed)
        self.injected_s += delay
        return delay

    def switch_begins(self) -> None:
        """The worker applies a new plan: a `switch` break order may act now."""
        self.switching = True

    def switch_ends(self) -> None:
        """The worker's first step under the new plan begins."""
        self.switching = False

    def _fault(self, order: ChaosOrder, op: str) -> None:
        if order.fault == "break":
            if order.switch and not self.switching:
                return  # it waits for the worker's next switch
            if order.until not in self._broken:
                self._broken.add(order.until)
                raise BrokenOnOrder(f"chaos: {op} broken on order, as by a reset connection")
            return
        # `hang`: blocked until the order expires or is withdrawn (the watcher polls a fresh copy of it, or
        # None once it is cleared).
        while (current := self._current()) is not None and current == order:
            self._sleep(min(0.1, max(0.0, order.until - time.time())))

    def compute_factor(self) -> float:
        """The live compute order's factor; 1.0 without one (a link order slows no compute)."""
        order = self._current()
        return order.factor if order is not None and order.link is None else 1.0

    def after_compute(self, seconds: float) -> None:
        """Stretch an explicit compute span (a GEMM benchmark's product) when compute is slowed: each span by
        itself, owing nothing to an earlier delay's late wake-up. The benchmark keeps the best of its
        products, and a product whose delay the lateness had paid came back unslowed: under load, the
        validation measured a x1.5 worker at 1.04x its peers and named no one."""
        order = self._current()
        if order is not None and order.link is None:
            owed, self._late_s = self._late_s, 0.0
            self._delay((order.factor - 1.0) * min(max(seconds, 0.0), MAX_GAP_S))
            self._late_s = owed  # the traced calls' delays go on settling their own lateness

    def stretch_step(self, compute_s: float, injected_s: float = 0.0) -> float:
        """End of a committed step whose compute (wall less communication, from the trace) was `compute_s`,
        `injected_s` of it delays this injector already slept in the step (`injected_s` as it grew over the
        step): under a compute order, sleep what is missing for the step's compute to be F x (compute_s -
        injected_s). Returns the seconds slept.
        At most `MAX_GAP_S` of compute per step is stretched."""
        order = self._current()
        if order is None or order.link is not None:
            return 0.0
        own = min(max(compute_s - injected_s, 0.0), MAX_GAP_S)
        # Measured, not asked: the lateness of the step's delays is in `injected_s` already.
        self._late_s = 0.0
        return self._delay((order.factor - 1.0) * own - injected_s)


class ChaosWatcher:
    """Polls the node's control key on a daemon thread and hands each order to the injector."""

    def __init__(
        self,
        client: redis.Redis,
        keys: JobKeys,
        node: int,
        injector: ChaosInjector,
        poll_interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s: must be > 0, got {poll_interval_s}")
        self.client = client
        self.key = keys.chaos(node)
        self.injector = injector
        self.poll_interval_s = poll_interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rjob-chaos", daemon=True)

    def poll(self) -> ChaosOrder | None:
        """Read the key once; a Redis hiccup keeps the previous order until the next poll."""
        with contextlib.suppress(RedisError, OSError):
            self.injector.order = parse_order(self.client.get(self.key))
        return self.injector.order

    def _run(self) -> None:
        while not self._stopped.is_set():
            self.poll()
            self._stopped.wait(self.poll_interval_s)

    def start(self) -> ChaosWatcher:
        self.poll()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.injector.order = None


class _Process:
    """The process's active injector (one per worker process)."""

    injector: ChaosInjector | None = None


def start(
    tracer: Tracer,
    client: redis.Redis,
    keys: JobKeys,
    node: int,
    *,
    rank_of: Callable[[int], int | None] | None = None,
    environ: Mapping[str, str] | None = None,
    poll_interval_s: float = POLL_INTERVAL_S,
) -> ChaosWatcher | None:
    """Obey this node's chaos orders from now on, if the environment allows chaos; None otherwise."""
    if not allowed(environ):
        return None
    injector = ChaosInjector(rank_of, node=node)
    tracer.hook = injector
    _Process.injector = injector
    return ChaosWatcher(client, keys, node, injector, poll_interval_s).start()


def stop(tracer: Tracer, watcher: ChaosWatcher | None) -> None:
    """Stop obeying orders and detach the hook."""
    if watcher is not None:
        watcher.stop()
    if tracer.hook is _Process.injector:
        tracer.hook = None
    _Process.injector = None


def activate(
    injector: ChaosInjector | None, tracer: Tracer | None = None, environ: Mapping[str, str] | None = None
) -> None:
    """Make `injector` the process's active one, for embedders that set orders themselves (the same guard
    as `start` applies); `None` deactivates."""
    if injector is not None and not allowed(environ):
        raise ChaosNotAllowed(f"{ALLOW_ENV}: chaos is not allowed in this process (set {ALLOW_ENV}=1)")
    _Process.injector = injector
    if tracer is not None:
        tracer.hook = injector


def after_compute(seconds: float) -> None:
    """Stretch an explicit compute span by the active compute order, if any (a no-op without chaos)."""
    if _Process.injector is not None:
        _Process.injector.after_compute(seconds)
