"""`rjob demo`: the whole system on this machine in one command. Brings up the local stack (`rjob local`),
applies `examples/demo.yaml` (a small GPT trained for real by 8 one-CPU workers), kills a worker, slows
another (chaos, factor 3), and shows a live table of the workers, the plan generation and layout, the step,
loss and throughput, the fail-slow episode (order, detection, mitigation, throughput healthy / slowed /
mitigated) and the events. At the end it prints the recovery summary (each decision: trigger, policy or
mitigation strategy, detect / plan / transfer time and the time from the injected fault to the decision),
the detection delay in iterations and the share of the slowdown the mitigation removed, writes a PNG of
throughput and active workers over time, and tears everything down, also on Ctrl-C or SIGTERM. `--no-live`
prints log lines instead."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from resilientjob.protocol.store_keys import COMMITTED_KEY, event_key, loss_key

from ._common import CliError, guarded, make_directory
from ._demo_failslow import BASELINE_S, FailSlowWatch
from ._manifest_files import load_documents

DEFAULT_MANIFEST = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"
SLOW_FACTOR = 4.0
"""How many times slower the slowed worker computes (`--slow-factor`). A sleep-based slow device is partly
absorbed on a CPU-oversubscribed host: the other workers get the cores while it sleeps. Since the order
stretches the worker's own compute only, not its waits between steps (2026-11-27), x3 cost the demo job
1.15-1.96x in three runs on two cores (once under its 1.5x threshold, and nothing was mitigated), x4 1.92x
and 2.66x; S2 can at best take its step from 4x to 2x the healthy compute (two micro-batches per replica,
one left on the slowed worker): two thirds of the slowdown."""
SAMPLE_S = 0.5
STARTUP_LIMIT_S = 300.0
"""How long the demo waits for the job's first committed step before it ends (`Observed.running`)."""
WINDOW_S = 2.0
"""Throughput is the samples reported in the last WINDOW_S seconds, divided by it."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo", help="run the local demo: real training through a kill and a slowdown"
    )
    # Start-up (stack, first plan, first step) took 30-90 s on a loaded 2-core host; the slowdown needs
    # about a minute after it for detection, S2 and a settled mitigated throughput.
    parser.add_argument(
        "--duration", type=float, default=180.0, help="seconds of training, from its first step (default 180)"
    )
    parser.add_argument("--out", default="demo-out", help="directory for demo.png and the stack's files")
    parser.add_argument(
        "--no-live", action="store_true", help="log lines instead of the live table (as with no terminal)"
    )
    parser.add_argument("-f", "--filename", default=str(DEFAULT_MANIFEST), help="the job manifest")
    parser.add_argument(
        "--slow-factor",
        type=float,
        default=SLOW_FACTOR,
        help=f"how many times slower the slowed worker computes (default {SLOW_FACTOR:g})",
    )
    parser.set_defaults(handler=guarded(_run))


# ---- what the demo observes ------------------------------------------------------------------------------
@dataclass(slots=True)
class Worker:
    node: int
    alive: bool = False
    generation: int = -1
    step: int = 0
    compute_s: float = 0.0
    rate: float = 0.0


@dataclass(slots=True)
class Observed:
    """Everything sampled so far; the live table, the summary and the PNG are drawn from it."""

    started: float = field(default_factory=time.monotonic)
    generation: int = -1
    layout: str = ""
    policy: str = ""
    plan_nodes: tuple[int, ...] = ()
    phase: str = ""
    committed: int = 0
    loss: float | None = None
    first_loss: float | None = None
    throughput: float = 0.0
    workers: dict[int, Worker] = field(default_factory=dict)
    events: list[tuple[float, str]] = field(default_factory=list)
    timeline: list[tuple[float, float, int]] = field(default_factory=list)
    """(seconds since start, samples/s, active workers)."""
    samples: list[tuple[float, int]] = field(default_factory=list)
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    switches: dict[int, tuple[float, float, int]] = field(default_factory=dict)
    """Generation -> (rendezvous s, copy s, bytes) measured by the workers, read before teardown."""
    copies: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Generation -> (layers to copy peer to peer, their bytes), as the plan lists its transfers."""
    training_since: float | None = None
    killed_at: float | None = None
    published: dict[int, float] = field(default_factory=dict)
    """Generation -> seconds since start when the demo saw it published."""
    failslow: FailSlowWatch = field(default_factory=FailSlowWatch)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def trained_s(self) -> float:
        """Seconds since the job's first committed step (0 before it)."""
        return 0.0 if self.training_since is None else self.elapsed() - self.training_since

    def running(self, duration: float) -> bool:
        """Whether the demo goes on: `duration` seconds of training from the first committed step, so that
        a slow start (nine interpreters importing torch on a busy host: 20-40 s) leaves the kill, the
        slowdown and its mitigation their time; at most `STARTUP_LIMIT_S` without a first step."""
        if self.training_since is None:
            return self.elapsed() < STARTUP_LIMIT_S
        return self.trained_s() < duration

    def event(self, text: str) -> str:
        self.events.append((self.elapsed(), text))
        return text


class Probe:
    """Reads the stack: Redis (plan, heartbeats, iterations), the job's TCPStore (commits, loss), the API."""

    def __init__(self, job: str, nodes: int, redis_url: str) -> None:
        import redis

        from resilientjob.protocol.keys import JobKeys

        self.keys = JobKeys("default", job)
        self.job = job
        self.nodes = nodes
        self.client = redis.Redis.from_url(redis_url)
        self.store: Any = None
        self.cursor = "0-0"
        self.clock_offset = time.time() - time.monotonic()

    def close(self) -> None:
        self.client.close()

    def committed_step(self) -> int | None:
        """The job's committed steps now, read from its TCPStore (None before it has one)."""
        store = self._store()
        return None if store is None else int(store.add(COMMITTED_KEY, 0))

    def _store(self) -> Any:
        if self.store is None:
            raw: Any = self.client.get(self.keys.store)
            if raw:
                from torch._C._distributed_c10d import TCPStore

                host, _, port = bytes(raw).decode().rpartition(":")
                self.store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
        return self.store

    def sample(self, seen: Observed) -> list[str]:
        """Update `seen`; return the new events."""
        from resilientjob.protocol.messages import (
            MAX_PLAN_BYTES,
            Heartbeat,
            IterationRecord,
            PlanAnnouncement,
            decode,
        )

        from ._local import _call

        new: list[str] = []
        plan = decode(PlanAnnouncement, self.client.get(self.keys.plan), "demo.plan", MAX_PLAN_BYTES)
        if plan is not None and plan.generation > seen.generation:
            seen.generation, seen.layout, seen.policy = plan.generation, plan.layout, plan.policy
            seen.plan_nodes = plan.plan.nodes
            transfers = plan.plan.transfers
            seen.copies[plan.generation] = (len(transfers), sum(t.bytes for t in transfers))
            why = plan.trigger or "Planned"
            what = f"{plan.strategy} mitigation" if plan.strategy else f"policy {plan.policy}"
            moved = f", {len(transfers)} layer copies" if transfers else ""
            seen.published[plan.generation] = seen.elapsed()
            seen.failslow.mitigated(plan.strategy, seen.elapsed(), seen.committed, plan.generation)
            new.append(
                seen.event(
                    f"generation {plan.generation}: {why} {plan.nodes} -> {plan.layout} ({what}{moved})"
                )
            )
            if plan.strategy and plan.reason:
                # A fail-slow rung says what it measured and what it expects: the user sees why it acted.
                new.append(seen.event(f"decision: {plan.reason[:600]}"))
        beats = self.client.mget([self.keys.heartbeat(n) for n in range(self.nodes)])
        for node, raw in enumerate(beats):
            worker = seen.workers.setdefault(node, Worker(node))
            beat = decode(Heartbeat, raw, "demo.heartbeat")
            worker.alive = beat is not None
            if beat is not None:
                worker.generation, worker.step = beat.generation, beat.step
        streams: Any = self.client.xread({self.keys.iterations: self.cursor}, count=10_000)
        for _, entries in streams or []:
            for entry_id, fields in entries:
                self.cursor = entry_id.decode()
                record = decode(IterationRecord, fields.get(b"m"), "demo.iteration")
                if record is None:
                    continue
                worker = seen.workers.setdefault(record.node, Worker(record.node))
                worker.compute_s = record.seconds
                seen.failslow.took_effect(record.node, record.step, record.chaos_s)
                seen.samples.append((record.sent_at - self.clock_offset - seen.started, record.samples))
        now = seen.elapsed()
        recent = [count for at, count in seen.samples if at > now - WINDOW_S]
        seen.throughput = sum(recent) / WINDOW_S
        active = sum(1 for n in seen.plan_nodes if n in seen.workers and seen.workers[n].alive)
        seen.timeline.append((now, seen.throughput, active))
        store = self._store()
        committed = self.committed_step()
        if store is not None and committed is not None:
            seen.committed = committed
            if seen.committed > 0:
                seen.loss = float(store.get(loss_key(seen.committed - 1)).decode().split(":")[1])
                if seen.first_loss is None:
                    seen.first_loss = float(store.get(loss_key(0)).decode().split(":")[1])
                    seen.training_since = now
                    new.append(seen.event("training: first step committed"))
        try:
            status, body = _call(
                "GET", f"/apis/resilientjob.io/v1alpha1/namespaces/default/resilientjobs/{self.job}"
            )
        except OSError:  # a timeout on a host too loaded to answer in time: read the status next sample
            return new
        if status == 200 and isinstance(body, dict):
            job_status = body.get("status") or {}
            seen.phase = job_status.get("phase", "")
            seen.recoveries = list(job_status.get("recoveries") or [])
            slow = seen.failslow.detected(
                list(job_status.get("slowNodes") or []), seen.elapsed(), seen.committed
            )
            if slow is not None:
                new.append(seen.event(slow))
            seen.failslow.dated(seen.recoveries, seen.elapsed())
        return new

    def transfers(self, generation: int) -> tuple[float, float, int]:
        """(rendezvous s, copy s, bytes) of a generation's switch: the slowest node's times, all bytes."""
        store = self._store()
        rendezvous = copy = 0.0
        moved = 0
        for node in range(self.nodes) if store is not None else ():
            key = event_key("applied", generation, node)
            if store.check([key]):
                applied = json.loads(store.get(key))
                rendezvous = max(rendezvous, applied["rendezvous_s"])
                copy = max(copy, applied["copy_s"])
                moved += int(applied["bytes"])
        return rendezvous, copy, moved


# ---- rendering ---------------------------------------------------------------------------------------------
def _render(seen: Observed, duration: float, job: str) -> Any:
    from rich.console import Group
    from rich.panel import Panel
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    loss = f"{seen.loss:.4f}" if seen.loss is not None else "-"
    header = (
        f"[bold]{job}[/]  phase {seen.phase or '-'}  generation {seen.generation}  "
        f"layout {seen.layout or '-'}  policy {seen.policy or '-'}\n"
        f"step {seen.committed}  loss {loss}  throughput {seen.throughput:.1f} samples/s\n"
        f"{seen.failslow.live(seen.samples, seen.elapsed())}"
    )
    workers = Table(title="workers", expand=True)
    for column in ("node", "state", "generation", "step", "compute s/step"):
        workers.add_column(column, justify="right")
    for node, worker in sorted(seen.workers.items()):
        used = node in seen.plan_nodes
        state = ("[green]training" if used else "[yellow]idle") if worker.alive else "[red]dead"
        workers.add_row(str(node), state, str(worker.generation), str(worker.step), f"{worker.compute_s:.3f}")
    events = Table(title="events", expand=True, show_header=False)
    events.add_column("t", justify="right", width=7)
    events.add_column("event")
    for at, text in seen.events[-8:]:
        events.add_row(f"{at:5.1f}s", text)
    progress = ProgressBar(total=duration, completed=min(duration, seen.trained_s()))
    return Group(Panel(header), workers, events, progress)


def _summary(seen: Observed) -> Any:
    from rich.table import Table

    table = Table(title="recoveries")
    for column in (
        "gen",
        "trigger",
        "nodes",
        "policy / strategy",
        "layout",
        "detect s",
        "detect steps",
        "plan s",
        "after fault s",
        "rendezvous s",
        "layers",
        "copy s",
        "bytes copied",
    ):
        table.add_column(column)
    for recovery in seen.recoveries:
        generation = int(recovery.get("generation", 0))
        rendezvous, copy, moved = seen.switches.get(generation, (0.0, 0.0, 0))
        layers, _ = seen.copies.get(generation, (0, 0))
        strategy = recovery.get("strategy") or ""
        table.add_row(
            str(generation),
            str(recovery.get("trigger", "")),
            ",".join(map(str, recovery.get("nodes", []))),
            f"{recovery.get('policy', '')}" + (f" / {strategy}" if strategy else ""),
            str(recovery.get("layout", "")),
            f"{float(recovery.get('detectS', 0.0)):.3f}",
            _detect_steps(recovery),
            f"{float(recovery.get('planS', 0.0)):.4f}",
            _after_fault(seen, generation, str(recovery.get("trigger", ""))),
            f"{rendezvous:.3f}",
            str(layers),
            f"{copy:.3f}",
            str(moved),
        )
    return table


def _detect_steps(recovery: dict[str, Any]) -> str:
    """A fail-slow row's steps from the slowdown's onset to the operator opening the episode."""
    onset, detected = recovery.get("onsetStep"), recovery.get("detectedStep")
    if not isinstance(onset, int) or not isinstance(detected, int):
        return "-"
    return str(detected - onset)


def _after_fault(seen: Observed, generation: int, trigger: str) -> str:
    """Seconds from the fault the demo injected (the kill, the slowdown order) to the generation answering
    it being published, as the demo saw them: a fail-slow row's detection and mitigation time together."""
    at = seen.published.get(generation)
    fault = {"NodeFailed": seen.killed_at, "NodeSlow": seen.failslow.slowed_at}.get(trigger)
    if at is None or fault is None or at < fault:
        return "-"
    return f"{at - fault:.1f}"


LABEL_WIDTH_PT = 9
"""Width of one rotated event label (7-point text) on the picture."""


def _label_columns(times: Sequence[float], span: float) -> list[int]:
    """For each event line (in time order), the column its label takes to the right of it: 0, or one more
    than the label before when the lines are closer than a label's width (the slowdown, its detection and
    the mitigation come within a few seconds and their labels were written over each other)."""
    crowded = span / 60  # a label's width in seconds on the ~9-inch axis
    columns: list[int] = []
    for index, at in enumerate(times):
        near = index > 0 and at - times[index - 1] < crowded * (columns[-1] + 1)
        columns.append(columns[-1] + 1 if near else 0)
    return columns


def _plot(seen: Observed, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [t for t, _, _ in seen.timeline]
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 5.5))
    top.plot(times, [rate for _, rate, _ in seen.timeline], color="tab:blue")
    top.set_ylabel("samples / s")
    top.set_title(f"rjob demo: throughput and active workers ({seen.layout})")
    bottom.step(times, [active for _, _, active in seen.timeline], where="post", color="tab:green")
    bottom.set_ylabel("active workers")
    bottom.set_xlabel("seconds since start")
    bottom.set_ylim(bottom=0)
    shown = ("kill", "slow", "generation", "fail-slow")
    first = "generation 0"
    marked = [(at, text) for at, text in seen.events if text.startswith(shown) and not text.startswith(first)]
    span = max(times, default=1.0) - min(times, default=0.0)
    for (at, text), column in zip(marked, _label_columns([at for at, _ in marked], span), strict=True):
        colour = "tab:red" if text.startswith(("kill", "slow")) else "grey"
        for axis in (top, bottom):
            axis.axvline(at, color=colour, ls="--", lw=0.8)
        mitigation = re.search(r"\((\w+) mitigation", text)
        top.annotate(
            text.split(":")[0] + (f" ({mitigation[1]})" if mitigation else ""),
            (at, 0),
            xytext=(3 + LABEL_WIDTH_PT * column, 3),
            textcoords="offset points",
            fontsize=7,
            rotation=90,
        )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---- the run ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet() -> Iterator[io.StringIO]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        yield buffer


@dataclass(slots=True)
class Chaos:
    """When to kill and slow which worker: a kill once training runs, a slowdown once it has recovered."""

    job: str
    nodes: int
    duration: float
    kill_node: int
    factor: float = SLOW_FACTOR
    killed_at: float | None = None
    killed: int | None = None
    slowed: bool = False
    refused: set[int] = field(default_factory=set)
    """Workers whose pod could not take an order (gone already): chosen no more."""

    def _live(self, seen: Observed) -> list[int]:
        """The plan's workers that beat and could still take an order."""
        return [
            n
            for n in seen.plan_nodes
            if n in seen.workers and seen.workers[n].alive and n not in self.refused and n != self.killed
        ]

    def step(self, seen: Observed, committed_step: Callable[[], int | None]) -> list[str]:
        """Kill or slow a worker when it is time. `committed_step` reads the job's step at once: the
        slowdown is dated by the step and time right after its order is written, not by the last sample
        (up to `SAMPLE_S` and the order's own round trip earlier, a few steps of a fast job)."""
        from ._local import _kill, _slow

        if seen.training_since is None:
            return []
        now = seen.elapsed()
        kill_after = min(15.0, max(5.0, 0.1 * self.duration))
        if self.killed_at is None and now >= seen.training_since + kill_after:
            live = self._live(seen)
            if not live:
                return []
            # Worker 2 (its pipeline's partner must take its layers); on a host so loaded that a heartbeat
            # expiry already replanned it away, another worker of the plan.
            victim = self.kill_node if self.kill_node in live else live[len(live) // 2]
            try:
                with _quiet():
                    _kill(f"{self.job}-node-{victim}")
            except (CliError, OSError) as exc:
                self.refused.add(victim)
                return [seen.event(f"chaos: worker {victim} not killed ({exc}); trying another")]
            self.killed_at = seen.killed_at = now
            self.killed = victim
            return [seen.event(f"kill: worker {victim} (SIGKILL)")]
        # The kill's recovery takes about a second; 12-15 s after it leave a settled healthy baseline
        # (`BASELINE_S` before the order, none of it before the kill, also in a short run) and most of
        # the run for detecting and mitigating the slowdown.
        slow_after = max(BASELINE_S + 2.0, min(15.0, 0.1 * self.duration))
        remaining = self.duration - seen.trained_s()
        if (
            self.killed_at is not None
            and not self.slowed
            and now >= self.killed_at + slow_after
            and remaining > 5
        ):
            candidates = self._live(seen)
            if len(candidates) < 2:
                # One worker left (a loaded host's heartbeat expiries took the others): no replica could
                # take its work, a slowdown would show nothing to mitigate.
                self.slowed = True
                return [seen.event(f"chaos: no slowdown ({len(candidates)} worker(s) left training)")]
            node = max(candidates)
            try:
                with _quiet():
                    _slow(f"{self.job}-node-{node}", self.factor, f"{remaining:.0f}s")
            except (CliError, OSError) as exc:
                self.refused.add(node)
                return [seen.event(f"chaos: worker {node} not slowed ({exc}); trying another")]
            self.slowed = True
            written = committed_step()
            seen.failslow.slowed(node, seen.elapsed(), seen.committed if written is None else written)
            return [seen.event(f"slow: worker {node} x{self.factor:g} for {remaining:.0f}s")]
        return []


def _run(args: argparse.Namespace) -> int:
    if args.duration < 20:
        raise CliError(f"duration: at least 20 seconds, got {args.duration:g}")
    if not 1.0 < args.slow_factor <= 100.0:
        raise CliError(f"slow-factor: must be in (1, 100], got {args.slow_factor:g}")
    manifest = Path(args.filename)
    document = next((d for d in load_documents(manifest) if d.body["kind"] == "ResilientJob"), None)
    if document is None:
        raise CliError(f"{manifest}: no ResilientJob in the file")
    job = str(document.body["metadata"]["name"])
    try:
        nodes = int((document.body.get("spec") or {})["nodes"])
    except (KeyError, TypeError, ValueError):
        raise CliError(f"{document.where}: spec.nodes: required (an integer)") from None
    out = Path(args.out)
    make_directory(out, "out")
    os.environ["RJOB_LOCAL_DIR"] = str((out / "stack").resolve())

    from rich.console import Console

    from . import _local

    # Logs and CI have no terminal: rich would wrap the summary at 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=150)

    stopped_by: list[int] = []

    def interrupted(signum: int, frame: object) -> None:
        stopped_by.append(signum)
        # The teardown runs to its end: a second Ctrl-C or SIGTERM (an impatient user, a CI timeout's
        # escalation) in the middle of it left the whole stack running, its workers training on.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupted)
    previous_int = signal.signal(signal.SIGINT, interrupted)
    seen = Observed()
    probe: Probe | None = None
    try:
        with _quiet():
            _local._down()  # a stack left over by a demo that was killed hard
            _local._up()
            _local._apply(manifest)
        state = json.loads((Path(os.environ["RJOB_LOCAL_DIR"]) / "state.json").read_text())
        console.print(
            f"local stack up; {job}: {nodes} workers training a small GPT for {args.duration:g} s "
            "from its first step"
        )
        seen.event(f"applied {manifest.name}: {nodes} workers")
        probe = Probe(job, nodes, state["redis_url"])
        chaos = Chaos(job, nodes, args.duration, kill_node=min(2, nodes - 1), factor=args.slow_factor)
        _watch(seen, probe, chaos, args, console, job)
    except KeyboardInterrupt:
        console.print("interrupted: tearing down")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # also after a normal end: the teardown runs whole
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if probe is not None:
                with contextlib.suppress(Exception):
                    probe.sample(seen)
                    for recovery in seen.recoveries:
                        generation = int(recovery.get("generation", 0))
                        seen.switches[generation] = probe.transfers(generation)
                probe.close()
            with _quiet():
                _local._down()
        finally:
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGTERM, previous)
    if probe is None:
        return 128 + stopped_by[0] if stopped_by else 1
    reported = _report(seen, out, console)
    # What it measured until then is reported; the exit status still says it was stopped, as a shell's does.
    return 128 + stopped_by[0] if stopped_by else reported


def _watch(
    seen: Observed, probe: Probe, chaos: Chaos, args: argparse.Namespace, console: Any, job: str
) -> None:
    from rich.live import Live

    def tick() -> list[str]:
        return probe.sample(seen) + chaos.step(seen, probe.committed_step)

    if args.no_live or not console.is_terminal:  # redirected: a live table shows only its last frame
        last_line = 0.0
        while seen.running(args.duration):
            for text in tick():
                console.print(f"[{seen.elapsed():6.1f}s] {text}")
            if seen.elapsed() - last_line >= 5:
                last_line = seen.elapsed()
                alive = sum(1 for w in seen.workers.values() if w.alive)
                console.print(
                    f"[{seen.elapsed():6.1f}s] gen {seen.generation} {seen.layout} step {seen.committed} "
                    f"loss {seen.loss if seen.loss is None else round(seen.loss, 4)} "
                    f"{seen.throughput:.1f} samples/s, {alive} workers alive"
                )
            time.sleep(SAMPLE_S)
        return
    with Live(_render(seen, args.duration, job), console=console, refresh_per_second=4) as live:
        while seen.running(args.duration):
            tick()
            live.update(_render(seen, args.duration, job))
            time.sleep(SAMPLE_S)
        probe.sample(seen)  # the last frame shows what the summary below it reports
        live.update(_render(seen, args.duration, job))


def _report(seen: Observed, out: Path, console: Any) -> int:
    console.print(_summary(seen))
    layers = sum(count for count, _ in seen.copies.values())
    copied = sum(moved for _, _, moved in seen.switches.values())
    console.print(f"peer-to-peer: {layers} layer copies planned, {copied} bytes copied by the workers")
    if seen.first_loss is not None and seen.loss is not None:
        console.print(f"loss {seen.first_loss:.4f} at step 0 -> {seen.loss:.4f} at step {seen.committed - 1}")
    console.print(seen.failslow.summary(seen.samples, seen.elapsed()))
    path = out / "demo.png"
    _plot(seen, path)
    console.print(f"wrote {path}")
    return 0
