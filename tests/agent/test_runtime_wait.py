"""Waits abandon a step as soon as a failure is announced (a real gloo pair and a real TCPStore)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from torch._C._distributed_c10d import TCPStore

from resilientjob.agent._runtime_wait import FailureNotice, PeerFailure, Waiter
from resilientjob.protocol.store_keys import FAILURES_KEY, accounted_key

pytestmark = pytest.mark.torch


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


class _PendingWork:
    """Stands in for a gloo receive whose sender is stuck: `wait()` blocks until `deliver()`.

    Two gloo ranks cannot be built reliably inside one test process (each constructor holds the GIL while it
    waits for the other to connect), and the cross-process path is covered by test_runtime.py's kills."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: RuntimeError | None = None

    def deliver(self, error: RuntimeError | None = None) -> None:
        self.error = error
        self._done.set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._done.wait()
        if self.error is not None:
            raise self.error
        return True


def test_wait_returns_when_the_work_completes_and_raises_its_error(store: TCPStore) -> None:
    waiter = Waiter(timeout_s=5)
    work = _PendingWork()
    threading.Timer(0.05, work.deliver).start()
    waiter.wait(work, FailureNotice(store), "receive")  # type: ignore[arg-type]
    failing = _PendingWork()
    failing.deliver(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed"):
        waiter.wait(failing, FailureNotice(store), "receive")  # type: ignore[arg-type]
    waiter.wait(None, FailureNotice(store), "not a member")  # nothing to wait for
    waiter.close()


def test_announced_failure_abandons_a_blocked_receive(store: TCPStore) -> None:
    store.set(accounted_key(3), "0")
    notice = FailureNotice.for_generation(store, 3, check_every_s=0.01)
    assert notice.accounted == 0 and not notice.tripped()
    waiter = Waiter(timeout_s=8)
    blocked = _PendingWork()  # its sender never sends: a peer stuck behind a dead node
    threading.Timer(0.2, lambda: store.add(FAILURES_KEY, 1)).start()
    started = time.monotonic()
    with pytest.raises(PeerFailure, match="a peer failed"):
        waiter.wait(blocked, notice, "receive")  # type: ignore[arg-type]
    assert time.monotonic() - started < 2.0  # bounded by the notice, not by the 8 s timeout
    # The next plan accounts for that failure: its notice is quiet again.
    store.set(accounted_key(4), "1")
    assert not FailureNotice.for_generation(store, 4).tripped()
    blocked.deliver()  # release the helper thread
    waiter.close()


def test_a_rank_that_abandons_its_step_trips_the_notices_of_its_generation_only(store: TCPStore) -> None:
    """A reset connection fails one rank's collective with every rank alive: its peers, waiting for its
    part, abandon the step at its word instead of after their collective timeout."""
    store.set(accounted_key(5), "0")
    broken, peer = FailureNotice.for_generation(store, 5), FailureNotice.for_generation(store, 5, 0.01)
    assert not peer.tripped()
    waiter = Waiter(timeout_s=8)
    blocked = _PendingWork()  # the broken rank's part never comes
    threading.Timer(0.2, broken.abandon).start()
    started = time.monotonic()
    with pytest.raises(PeerFailure, match="a peer failed"):
        waiter.wait(blocked, peer, "all-reduce")  # type: ignore[arg-type]
    assert time.monotonic() - started < 2.0  # the 8 s timeout did not pass
    # The world that re-forms (the next generation) starts quiet; a notice of no generation never trips.
    store.set(accounted_key(6), "0")
    assert not FailureNotice.for_generation(store, 6).tripped()
    assert not FailureNotice(store).tripped()
    blocked.deliver()
    waiter.close()


def test_wait_times_out_without_a_notice(store: TCPStore) -> None:
    waiter = Waiter(timeout_s=0.3)
    blocked = _PendingWork()
    with pytest.raises(PeerFailure, match=r"no progress within 0\.3 s"):
        waiter.wait(blocked, FailureNotice(store, check_every_s=0.05), "receive")  # type: ignore[arg-type]
    blocked.deliver()
    waiter.close()


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        Waiter(timeout_s=0)
    with pytest.raises(ValueError, match="check_every_s"):
        FailureNotice(None, check_every_s=0)


def test_a_poll_on_an_operation_that_never_completes_frees_its_thread_at_the_deadline() -> None:
    """NCCL's wait() returns at once; an operation on a dead peer may never complete, and its poll held
    one of the waiter's threads for good (sixteen such waits and every later one timed out)."""
    import time as clock

    from resilientjob.agent._runtime_wait import until_complete

    class Stuck:
        def wait(self) -> bool:
            return True

        def is_completed(self) -> bool:
            return False

    began = clock.monotonic()
    assert until_complete(Stuck(), give_up_at=began + 0.1) is False  # type: ignore[arg-type]
    assert clock.monotonic() - began < 1.0


def test_an_operation_that_never_completes_is_never_taken_for_completed(store: TCPStore) -> None:
    """The helper gives up at the waiter's own deadline and says so (False). That answer can come back in
    the waiter's last slice, before the waiter sees its deadline pass: it returned then, as if the
    operation (an NCCL receive from a dead peer, say) had completed, and the step went on."""

    class Stuck:
        def wait(self) -> bool:
            return True

        def is_completed(self) -> bool:
            return False

    waiter = Waiter(timeout_s=0.05)
    notice = FailureNotice(store, check_every_s=1.0)  # one slice: the whole wait
    outcomes = []
    for _ in range(20):
        try:
            waiter.wait(Stuck(), notice, "receive")  # type: ignore[arg-type]
            outcomes.append("returned")
        except PeerFailure as exc:
            outcomes.append(str(exc))
    waiter.close()
    assert outcomes == ["receive: no progress within 0.05 s"] * 20


def test_helper_threads_wait_on_the_workers_own_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: torch.cuda.set_device is recorded, not run; what matters is that each helper thread
    makes the worker's device current before it waits (the current device is per thread)."""
    import threading

    import torch

    from resilientjob.agent._runtime_wait import FailureNotice, Waiter

    made: list[tuple[int, str]] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda index: made.append((index, threading.current_thread().name))
    )

    class Done:
        def wait(self) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

    waiter = Waiter(5.0, device="cuda:3")
    try:
        waiter.wait(Done(), FailureNotice(None), "receive")  # type: ignore[arg-type]
    finally:
        waiter.close()
    assert made and all(index == 3 and name.startswith("rjob-wait") for index, name in made), made
