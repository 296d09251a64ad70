"""Shared fixtures."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _support import session_servers

from resilientjob.planner import ClusterSpec, JobSpec, ModelProfile, uniform_profile


@pytest.fixture
def profile9() -> ModelProfile:
    """The nine equal layers of Odyssey's Fig. 3."""
    return uniform_profile(9)


@pytest.fixture
def cluster9() -> ClusterSpec:
    return ClusterSpec(nodes=9, gpus_per_node=1)


@pytest.fixture
def job() -> JobSpec:
    return JobSpec(global_batch=48, microbatch_size=1, fault_tolerance=1)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Torch writes TORCHINDUCTOR_CACHE_DIR into this process's environment the first time anything here
    asks for its compile cache (a test that reaches dynamo): every process the suite started after that had
    another environment than the session's warm interpreters, which imported under the first one they saw,
    and started cold (`WarmStarter.cold_reason` said so). So it is set before the first test, to the value
    torch would write, wherever the tests collected import torch (the others never reach it)."""
    if "torch" in sys.modules:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())


PART_ENV = "RJOB_TEST_PART"
"""`parallel` or `serial`: run only the tests without, or only those with, the `serial` mark (scripts/check
runs the suite in these two parts); unset, all of them."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    part = os.environ.get(PART_ENV)
    if part not in ("parallel", "serial"):
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        serial = item.get_closest_marker("serial") is not None
        (keep if serial == (part == "serial") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# Processes a test module left running. A leftover worker or server keeps taking CPU from every later test,
# and timing-sensitive tests (validation's GEMMs on two shared cores) then fail far from the cause. The
# summary names the module that left each one.
_LEFTOVERS: list[str] = []


def _processes() -> dict[tuple[int, int], tuple[int, str]]:
    """(pid, start time) -> (parent pid, command line) of every process visible now: a reused pid is
    another process."""
    found: dict[tuple[int, int], tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            parent, started = int(fields[1]), int(fields[19])
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue  # exited while being read
        # multiprocessing's forkserver and resource tracker serve pytest itself for the rest of the session.
        if command and "from multiprocessing." not in command:
            found[(int(entry.name), started)] = (parent, command)
    return found


_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
"""This process's name among the suite's parallel processes (scripts/check runs two), None when alone."""


def _from_the_tests(pid: int, parents: dict[int, int]) -> bool:
    """Whether a process is this pytest process's descendant, or an orphan of its (its parent is init: a
    test's daemon, or a child whose parent exited). Processes that other programs on the machine start
    meanwhile are neither; nor are the other parallel pytest process's orphans (each process of the suite
    inherits its pytest's PYTEST_XDIST_WORKER)."""
    if parents.get(pid) == 1:
        return _WORKER is None or _started_by(pid) == _WORKER
    seen: set[int] = set()
    while pid in parents and pid not in seen:
        if pid == os.getpid():
            return True
        seen.add(pid)
        pid = parents[pid]
    return False


def _started_by(pid: int) -> str | None:
    """The PYTEST_XDIST_WORKER a process started with (None when unreadable or unset)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"PYTEST_XDIST_WORKER="):
            return entry.split(b"=", 1)[1].decode(errors="replace")
    return None


@pytest.fixture(scope="module", autouse=True)
def _no_leftover_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    if not Path("/proc/self/stat").exists():
        yield
        return
    before = _processes()
    yield
    deadline = time.monotonic() + 3.0  # a process sent SIGTERM at teardown may take a moment to go
    while True:
        now = _processes()
        parents = {pid: parent for (pid, _), (parent, _) in now.items()}
        left = {
            key: command
            for key, (_, command) in now.items()
            if key not in before and _from_the_tests(key[0], parents) and key[0] not in session_servers()
        }
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    for (pid, _), command in sorted(left.items()):
        _LEFTOVERS.append(f"{request.module.__name__}: pid {pid}: {command[:160]}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a parallel process: its controller prints the summary
        workeroutput["leftovers"] = list(_LEFTOVERS)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent when the suite runs in one process
def pytest_testnodedown(node: Any, error: object) -> None:
    """A parallel process ended: keep what its modules left running, for the summary."""
    _LEFTOVERS.extend(getattr(node, "workeroutput", {}).get("leftovers", []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _LEFTOVERS:
        terminalreporter.section("processes left running by a test module")
        for line in _LEFTOVERS:
            terminalreporter.write_line(line)
