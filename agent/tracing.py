"""Non-intrusive tracing of `torch.distributed` in a worker process (Falcon 4.2, "Monitor"); `trace_reader`
turns the trace into iteration times and per-group profiles (Falcon 4.3, "Profiling").

`install()` replaces the collective and point-to-point functions (`all_reduce`, `all_gather`, `broadcast`,
`barrier`, `send`, `isend`, `batch_isend_irecv`, ...) in both `torch.distributed` and
`torch.distributed.distributed_c10d` with thin wrappers and `uninstall()` puts the very same function objects
back. Both namespaces are patched because torch itself resolves `isend`/`irecv` through the module globals
(`P2POp` checks `op in [isend, irecv]`, `send` calls `isend`): patching one side only would break
`dist.P2POp(dist.isend, ...)`. Nothing in the training loop changes, provided the loop looks the functions up
at call time (`dist.all_reduce(...)`, the usual style); a reference taken with
`from torch.distributed import all_reduce` before `install()` bypasses the tracer, so install first.

Each call is recorded as (operation, group ranks, peer, bytes, start, end) into a `TraceRing`: a fixed number
of preallocated slots written round-robin, so an append is O(1) and memory never grows. A call made from
inside a traced call (`send` is `isend` + `wait` in torch) is not recorded twice. Asynchronous calls return a
`TracedWork` (a real `dist.Work` subclass, so `isinstance` checks and every `Work` method keep working) that
stamps the end time when `wait()` first returns: the moment the caller saw the operation complete. On an
accelerator the host runs ahead of the device, so a call on device tensors also records an event on the
caller's stream, and its wait counts as communication only once the device has run what was issued before
it (`TracedWork`; tested against a modelled device, not yet run on a GPU).

A hook (`Tracer.hook`, used by `agent.chaos`) runs before each call with the operation, peer, bytes, the
time since the process's previous traced call ended (the compute interval before it; 0 while `quiet`) and the
global ranks of the call's group (so that a slowed link can slow the collectives that cross it).
"""

from __future__ import annotations

import inspect
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ._device_sync import ComputeMark, compute_mark

DEFAULT_CAPACITY = 1 << 16
"""Ring slots: at ~100 calls per iteration, the last ~650 iterations; ~10 MB of small tuples."""

NO_PEER = -1
"""Peer of a collective without a root, or of a receive from any source."""


@dataclass(frozen=True, slots=True)
class CallSpec:
    """Where a function's arguments say what it moves: parameter names, resolved to positions on install."""

    data: str | None
    """The tensor (or tensor list) this rank contributes or receives; its bytes are recorded."""
    peer: str | None = None
    """The global rank of the other side or of the root (`dst`/`src`)."""
    group_peer: str | None = None
    """The same as a rank inside `group` (`group_dst`/`group_src`), converted to a global rank."""


TRACED: Mapping[str, CallSpec] = {
    "all_reduce": CallSpec("tensor"),
    "all_reduce_coalesced": CallSpec("tensors"),
    "all_gather": CallSpec("tensor"),
    "all_gather_into_tensor": CallSpec("input_tensor"),
    "reduce_scatter": CallSpec("input_list"),
    "reduce_scatter_tensor": CallSpec("input"),
    "all_to_all": CallSpec("input_tensor_list"),
    "all_to_all_single": CallSpec("input"),
    "broadcast": CallSpec("tensor", "src", "group_src"),
    "reduce": CallSpec("tensor", "dst", "group_dst"),
    "gather": CallSpec("tensor", "dst", "group_dst"),
    "scatter": CallSpec("tensor", "src", "group_src"),
    "barrier": CallSpec(None),
    "monitored_barrier": CallSpec(None),
    "send": CallSpec("tensor", "dst", "group_dst"),
    "recv": CallSpec("tensor", "src", "group_src"),
    "isend": CallSpec("tensor", "dst", "group_dst"),
    "irecv": CallSpec("tensor", "src", "group_src"),
    "batch_isend_irecv": CallSpec("p2p_op_list"),
}
"""Every function the tracer wraps (those missing from the installed torch are skipped)."""

SENDS = frozenset({"send", "isend"})


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One traced call. `end_s` is NaN for an asynchronous call nobody has waited on yet."""

    seq: int
    op: str
    group: tuple[int, ...]
    peer: int
    nbytes: int
    start_s: float
    end_s: float
    wait_from_s: float = math.nan
    """When the caller began waiting for an asynchronous call (NaN for a synchronous one or before it)."""

    @property
    def blocked(self) -> tuple[float, float] | None:
        """The span the caller was held by this call: the call itself if synchronous, from the first
        `wait()` to the end if asynchronous (an `isend` still in flight while the caller computes does not
        hold it); None while pending."""
        if not self.end_s >= self.start_s:
            return None
        began = self.wait_from_s if self.wait_from_s >= self.start_s else self.start_s
        return (min(began, self.end_s), self.end_s)

    @property
    def duration_s(self) -> float:
        """Time inside the call (0 when the end is unknown)."""
        return self.end_s - self.start_s if self.end_s >= self.start_s else 0.0

    @property
    def label(self) -> str:
        """The call's communication group as text: its ranks, and `@peer` for point-to-point calls."""
        ranks = ",".join(map(str, self.group))
        return f"{ranks}@{self.peer}" if self.peer != NO_PEER and self.op not in _ROOTED else ranks


_ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})


class TraceRing:
    """A fixed-capacity ring of call records; the newest `capacity` survive.

    Appends are O(1) list stores (thread-safe under the GIL: the sequence number comes from an atomic
    counter, and a reader skips slots whose sequence does not match the one it expects)."""

    __slots__ = ("_counter", "_ends", "_mask", "_slots", "_waits", "capacity", "head")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 2 or capacity & (capacity - 1):
            raise ValueError(f"capacity: must be a power of two >= 2, got {capacity}")
        self.capacity = capacity
        self._mask = capacity - 1
        self._slots: list[tuple[int, str, tuple[int, ...], int, int, float] | None] = [None] * capacity
        self._ends: list[float] = [math.nan] * capacity
        self._waits: list[float] = [math.nan] * capacity
        self._counter = itertools.count()
        self.head = 0
        """One past the newest sequence number written."""

    def append(
        self,
        op: str,
        group: tuple[int, ...],
        peer: int,
        nbytes: int,
        start_s: float,
        end_s: float,
        wait_from_s: float = math.nan,
    ) -> int:
        """Store one record (end NaN while pending; `wait_from_s` when the caller was already held) and
        return its sequence number."""
        seq = next(self._counter)
        slot = seq & self._mask
        self._slots[slot] = (seq, op, group, peer, nbytes, start_s)
        self._ends[slot] = end_s
        self._waits[slot] = wait_from_s
        if seq >= self.head:
            self.head = seq + 1
        return seq

    def finish(self, seq: int, end_s: float, wait_from_s: float = math.nan) -> None:
        """Stamp the end of record `seq`, or move it later (a batch ends with its last request), and when
        its caller began waiting (the earliest wait counts); a record already overwritten is left alone."""
        slot = seq & self._mask
        record = self._slots[slot]
        if record is None or record[0] != seq:
            return
        if not self._ends[slot] >= end_s:
            self._ends[slot] = end_s
        if not self._waits[slot] <= wait_from_s:
            self._waits[slot] = wait_from_s

    def records(self, since: int = 0) -> list[TraceRecord]:
        """Records with sequence >= `since` still in the ring, oldest first."""
        head = self.head
        found = []
        for seq in range(max(since, head - self.capacity, 0), head):
            slot = seq & self._mask
            record = self._slots[slot]
            end, wait_from = self._ends[slot], self._waits[slot]
            if record is None or record[0] != seq:
                continue  # overwritten meanwhile, or a concurrent append not finished yet
            found.append(TraceRecord(*record, end_s=end, wait_from_s=wait_from))
        return found

    def __len__(self) -> int:
        return min(self.head, self.capacity)


class CallHook(Protocol):
    """Runs before each traced call (the chaos injector implements it). It may sleep itself (time that
    counts as compute, before the call) and returns seconds the call itself must take longer (time that
    counts as communication: a congested link; spent inside the call, before the data leaves), or 0."""

    def __call__(self, op: str, peer: int, nbytes: int, gap_s: float, group: tuple[int, ...]) -> float: ...


class TracedWork(dist.Work):
    """An asynchronous operation's `Work`, forwarding everything to it and stamping the operation's end when
    the host first sees it complete: when `wait()` returns on gloo, whose wait blocks until the data is in;
    on NCCL and HCCL, whose `wait()` only orders the current stream after the operation and returns at once,
    at the first `is_completed()` that is true (the runtime's waits poll it, `_runtime_wait`). Stamped at
    `wait()`'s return there, every receive read as instant: no communication, every step all compute.

    On those devices the host also runs ahead of the device: the operation starts only after the compute
    issued before it (the backend orders its stream after the caller's), so part of a wait is the device
    still computing. `ready` marks that compute's end on the caller's stream (`compute_mark`); the wait counts
    as communication only from when the host first sees the mark passed, else a slow device's compute read
    as its own communication, and its peers' (Falcon's split would blame nobody's compute)."""

    def __init__(self, inner: dist.Work, tracer: Tracer, seq: int, ready: ComputeMark | None = None) -> None:
        super().__init__()
        self._inner = inner
        self._tracer = tracer
        self._seq = seq
        self._waited = False
        self._wait_from = math.nan
        self._ready = ready
        self._ready_at = math.nan
        """When the host first saw the compute before the operation done, once it waited (NaN before)."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        began = time.perf_counter()
        if not self._wait_from <= began:
            self._wait_from = began  # the caller waits from the first wait() on
        self._look_at_compute(began)
        done: bool = self._inner.wait(*args, **kwargs)
        if not self._waited and self._inner.is_completed():
            self._stamp()
        return done

    def is_completed(self) -> bool:
        waiting = not self._waited and not math.isnan(self._wait_from)
        if waiting:
            self._look_at_compute(time.perf_counter())
        done: bool = self._inner.is_completed()
        if done and waiting:  # waited on, now done
            self._stamp()
        return done

    def _look_at_compute(self, now: float) -> None:
        if self._ready is not None and math.isnan(self._ready_at) and self._ready.query():
            self._ready_at = now

    def _stamp(self) -> None:
        """Once: a later wait() on finished work says nothing about the operation."""
        self._waited = True
        end = time.perf_counter()
        held_from = self._wait_from
        if self._ready is not None:
            # Seen done only with the operation: the device computed until about now (within one poll).
            held_from = max(held_from, end if math.isnan(self._ready_at) else self._ready_at)
        self._tracer.ring.finish(self._seq, end, held_from)
        # Compute resumes when the wait returns (often on a helper thread that waits for the caller).
        self._tracer.last_end = max(self._tracer.last_end, end)


def _forwarder(name: str) -> Callable[..., Any]:
    def forward(self: TracedWork, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._inner, name)(*args, **kwargs)

    forward.__name__ = name
    return forward


for _name in dir(dist.Work):
    if (
        not _name.startswith("__")
        and _name not in ("wait", "is_completed")
        and callable(getattr(dist.Work, _name))
    ):
        setattr(TracedWork, _name, _forwarder(_name))


def _nbytes(data: object) -> int:
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    if isinstance(data, list | tuple):
        return sum(_nbytes(item) for item in data)
    if isinstance(data, dist.P2POp):
        return _nbytes(data.tensor)
    return 0


def _accelerator(data: object) -> torch.device | None:
    """The accelerator holding the call's first tensor (None on the CPU or without a tensor). Per call, so
    cheap: `is_cpu` is a flag, `device` builds an object."""
    if isinstance(data, torch.Tensor):
        return None if data.is_cpu or data.is_meta else data.device
    if isinstance(data, list | tuple):
        return _accelerator(data[0]) if data else None
    if isinstance(data, dist.P2POp):
        return _accelerator(data.tensor)
    return None


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str | None, position: int) -> Any:
    if name is None:
        return None
    if name in kwargs:
        return kwargs[name]
    return args[position] if 0 <= position < len(args) else None


class Tracer:
    """Owns the patched functions, the ring and the group table of one process."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.ring = TraceRing(capacity)
        self.hook: CallHook | None = None
        """Called before every traced call (also while recording is off)."""
        self.recording = True
        """Off during `quiet()`: calls still run the hook but leave no record (validation traffic)."""
        self.last_end = -math.inf
        """When the process last came out of communication (a call returned or a wait on one ended): the
        compute interval before the next call starts here. Process-wide, not per thread, since runtimes
        wait on work from helper threads (`agent._runtime_wait.Waiter`)."""
        self._local = threading.local()
        self._originals: dict[str, Callable[..., Any]] = {}
        self._group_cache: dict[object, tuple[int, ...]] = {}

    def compute_begins(self) -> None:
        """The caller starts computing now (a training step begins): what came before since the last call
        (waiting between steps for the commit or the peers) was not compute, so the next call's compute
        interval counts from here. Without it a worker that waits long between steps (the fast one after a
        re-balance) would have that wait stretched by a chaos order as if it were compute."""
        self.last_end = max(self.last_end, time.perf_counter())

    # ---- install / uninstall ----------------------------------------------------------------------------
    @property
    def installed(self) -> bool:
        return bool(self._originals)

    def install(self) -> None:
        """Patch `torch.distributed` and `distributed_c10d`; idempotent."""
        if self._originals:
            return
        for name, spec in TRACED.items():
            original = getattr(c10d, name, None)
            if getattr(dist, name, None) is not original:
                continue  # already patched by somebody else: leave it
            if not callable(original):
                continue  # absent from this torch
            wrapper = self._wrap(name, original, spec)
            self._originals[name] = original
            setattr(c10d, name, wrapper)
            setattr(dist, name, wrapper)

    def uninstall(self) -> None:
        """Put back exactly the function objects `install` replaced."""
        for name, original in self._originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)
        self._originals.clear()
        self._group_cache.clear()

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """Run calls without recording them (validation traffic must not look like training)."""
        previous, self.recording = self.recording, False
        try:
            yield
        finally:
            self.recording = previous

    # ---- the wrapper ------------------------------------------------------------------------------------
    def _group_ranks(self, group: object) -> tuple[int, ...]:
        process_group = group if group is not None else c10d.GroupMember.WORLD
        ranks = self._group_cache.get(process_group)
        if ranks is None:
            if process_group is None:
                return ()
            ranks = tuple(dist.get_process_group_ranks(process_group))  # type: ignore[arg-type]
            if len(self._group_cache) > 1024:  # reconfigurations create groups; keep the cache bounded
                self._group_cache.clear()
            self._group_cache[process_group] = ranks
        return ranks

    def _describe(
        self,
        name: str,
        spec: CallSpec,
        positions: Mapping[str, int],
        args: tuple[Any, ...],
        kw: dict[str, Any],
    ) -> tuple[tuple[int, ...], int, int, torch.device | None]:
        """(group ranks, global peer, bytes, accelerator of the data) of one call; never raises (the real
        call reports bad input)."""
        try:
            if name == "batch_isend_irecv":
                ops = _argument(args, kw, "p2p_op_list", 0) or []
                peers = {op.peer for op in ops}
                group = ops[0].group if ops else None
                peer = peers.pop() if len(peers) == 1 else NO_PEER
                return self._group_ranks(group), peer, _nbytes(ops), _accelerator(ops)
            group = _argument(args, kw, "group", positions.get("group", -1))
            ranks = self._group_ranks(group)
            peer = _argument(args, kw, spec.peer, positions.get(spec.peer or "", -1))
            if peer is None and spec.group_peer is not None and kw.get(spec.group_peer) is not None:
                peer = c10d.get_global_rank(group or c10d.GroupMember.WORLD, kw[spec.group_peer])  # type: ignore[arg-type]
            data = _argument(args, kw, spec.data, positions.get(spec.data or "", -1))
            return ranks, NO_PEER if peer is None else int(peer), _nbytes(data), _accelerator(data)
        except (RuntimeError, ValueError, TypeError, IndexError, AttributeError):
            return (), NO_PEER, 0, None

    def _wrap(self, name: str, original: Callable[..., Any], spec: CallSpec) -> Callable[..., Any]:
        parameters = list(inspect.signature(original).parameters)
        positions = {param: index for index, param in enumerate(parameters)}
        local = self._local
        ring = self.ring
        clock = time.perf_counter

        def traced(*args: Any, **kwargs: Any) -> Any:
            if getattr(local, "inside", False):  # torch calling itself (send -> isend): the outer call counts
                return original(*args, **kwargs)
            group, peer, nbytes, device = self._describe(name, spec, positions, args, kwargs)
            hook = self.hook
            delay = 0.0
            if hook is not None:
                # The time since this thread's previous call is the compute before this one; a quiet
                # (validation) call follows no training compute.
                last_end = self.last_end
                gap = 0.0 if last_end == -math.inf or not self.recording else max(0.0, clock() - last_end)
                delay = hook(name, peer, nbytes, gap, group) or 0.0
            local.inside = True
            try:
                start = clock()
                if delay > 0:
                    # A congested link: the data leaves this end that much later, so the peers wait for it
                    # too (a collective's members inside the call, a receiver in its recv/wait).
                    time.sleep(delay)
                ready = compute_mark(device) if device is not None and self.recording else None
                result = original(*args, **kwargs)
                end = clock()
            finally:
                local.inside = False
            self.last_end = max(self.last_end, end)
            if not self.recording:
                return result
            # The caller was held from the start of a delayed asynchronous call, not only from its wait().
            held_from = start if delay > 0 else math.nan
            if isinstance(result, dist.Work):
                seq = ring.append(name, group, peer, nbytes, start, math.nan, held_from)
                return TracedWork(result, self, seq, ready)
            if isinstance(result, list) and result and isinstance(result[0], dist.Work):
                # batch_isend_irecv: one record, ended by the last of its requests to be waited on
                seq = ring.append(name, group, peer, nbytes, start, math.nan, held_from)
                return [TracedWork(work, self, seq, ready) for work in result]
            ring.append(name, group, peer, nbytes, start, end)
            return result

        traced.__name__ = name
        traced.__qualname__ = name
        traced.__doc__ = original.__doc__
        traced.__wrapped__ = original  # type: ignore[attr-defined]
        return traced


class _Process:
    """The process's tracer (one per worker process)."""

    tracer: Tracer | None = None


def install(capacity: int = DEFAULT_CAPACITY) -> Tracer:
    """Trace this process's `torch.distributed` calls (one tracer per process; a second call returns it)."""
    if _Process.tracer is None:
        _Process.tracer = Tracer(capacity)
    _Process.tracer.install()
    return _Process.tracer


def uninstall() -> None:
    """Restore the original functions and drop the process's tracer."""
    if _Process.tracer is not None:
        _Process.tracer.uninstall()
        _Process.tracer = None


def current() -> Tracer | None:
    """The process's installed tracer, if any."""
    return _Process.tracer
