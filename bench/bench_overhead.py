"""Healthy-path overhead: our runtime's steps/s vs plain PyTorch on the same model, devices and layout.

Both sides train the same small GPT (`models.builtin_model`, same per-layer seeds) on the same synthetic
samples in the same order (`data.SampleOrder`), with the same global batch, micro-batch size and plain
AdamW (constant lr, no decay, no clipping), on CPU with gloo, one thread per process:
- DP2: our runtime on two workers, one stage each holding the whole model, vs
  `torch.nn.parallel.DistributedDataParallel` on two processes (gradient accumulation under `no_sync`, the
  all-reduce overlapped with the last micro-batch's backward, one AdamW over the model).
- DP2 x PP2: our runtime on four workers vs `torch.distributed.pipelining` (`PipelineStage` +
  `Schedule1F1B`) with each stage wrapped in DDP over the two pipelines' copies of that stage.
Ours is driven as the tests drive it (`Launcher(config, plan, planner, log_dir).run()`) and timed by its
own rank 0 (`JobResult.step_times`); the reference's rank 0 times its steps the same way (start of the step
to the end of the optimizer step). Warm-up steps are dropped on both sides. Runs alternate ours, theirs,
ours, theirs... (the order rotates every round); the table gives each side's median over runs of each
run's median steps/s, and the ratio as the median of the per-round ratios (each round's runs are
neighbours in time, so a load change on the shared machine hits both), with the spreads. The losses of
every step are compared too: both sides train the same thing.

`--what-if` adds a third side: our workers with two fixes patched in, in the child processes only
(`_apply_fixes`; agent/ is not touched). `--profile` then runs our workers `--profile-runs` more times per
side with perf counters around the step's phases (the launcher's `worker_main`, phases wrapped in the child
only) and prints where each step goes, next to the reference's phases; plus a micro-benchmark of the
optimizer step (per-layer AdamW, foreach=False, as `LayerState` builds it, vs one AdamW over the model).
Results: docs/benchmarks/overhead.md.
Usage: .venv/bin/python bench/bench_overhead.py [--quick] [--rounds N] [--steps N] [--profile] [--what-if]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import socket
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch._C._distributed_c10d import TCPStore
from torch.nn.parallel import DistributedDataParallel

from resilientjob.agent.data import SampleOrder
from resilientjob.agent.models import lm_loss
from resilientjob.agent.profiler import measure_profile
from resilientjob.agent.worker import JobConfig, publish_plan
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan
from resilientjob.protocol.store_keys import loss_key, steptime_key
from resilientjob.testing.launcher import Launcher
from resilientjob.testing.plans import RuntimePlanner

MODEL: dict[str, object] = {"layers": 6, "hidden": 160, "heads": 4, "seq_len": 64, "vocab": 256}
GLOBAL_BATCH, MICRO = 16, 2
LR = 3e-3
LAYOUTS = {"DP2": (2, 1), "DP2xPP2": (2, 2)}
GOAL = 0.95


# ---- shared set-up ---------------------------------------------------------------------------------------
def job_config(steps: int) -> JobConfig:
    return JobConfig.plain(
        model="gpt", model_options=dict(MODEL), steps=steps, lr=LR, num_samples=512, collective_timeout_s=60.0
    )


def stage_bounds(pp: int) -> list[tuple[int, int]]:
    """Layer ranges of the pp stages: blocks split evenly, the embedding with the first, the head with the
    last (the split both sides use)."""
    layers = int(MODEL["layers"])  # type: ignore[call-overload]
    cuts = [round(layers * s / pp) for s in range(pp + 1)]
    return [(cuts[s], cuts[s + 1]) for s in range(pp)]


def make_plan(dp: int, pp: int) -> Plan:
    """DP dp x PP pp, pipeline p on nodes p*pp .. p*pp+pp-1, consecutive micro-batch ranges per pipeline."""
    pipelines = tuple(
        PipelinePlan(
            stages=tuple(StagePlan(layers=b, node=p * pp + s) for s, b in enumerate(stage_bounds(pp))),
            microbatches=GLOBAL_BATCH // MICRO // dp,
        )
        for p in range(dp)
    )
    return Plan(policy=Policy.DYNAMIC, microbatch_size=MICRO, step_time_s=1.0, pipelines=pipelines)


def make_planner(config: JobConfig, nodes: int) -> RuntimePlanner:
    profile = measure_profile(config.load_model(), timed=False)
    return RuntimePlanner.for_job(
        profile, nodes=nodes, global_batch=GLOBAL_BATCH, microbatch_size=MICRO, fault_tolerance=0
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---- ours ------------------------------------------------------------------------------------------------
def run_ours(dp: int, pp: int, steps: int) -> tuple[list[float], list[float]]:
    """(rank 0's seconds per committed step, losses per step) of our runtime on DP dp x PP pp."""
    config = job_config(steps)
    plan = make_plan(dp, pp)
    with tempfile.TemporaryDirectory() as tmp:
        result = Launcher(config, plan, make_planner(config, dp * pp), Path(tmp)).run(timeout_s=300)
    losses = [result.losses[step] for step in sorted(result.losses)]
    return result.step_times[0], losses


# ---- theirs: plain PyTorch -------------------------------------------------------------------------------
def _reference_worker(rank: int, dp: int, pp: int, port: int, steps: int, out: str) -> None:
    """One process of the plain PyTorch job: DDP (pp == 1) or pipelining 1F1B stages under DDP."""
    torch.set_num_threads(1)
    world = dp * pp
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(60)
    )
    pipeline, stage_index = divmod(rank, pp)
    config = job_config(steps)
    model = config.load_model()
    dataset = config.open_dataset(model)
    order = SampleOrder(dataset.num_samples, GLOBAL_BATCH, seed=dataset.seed)
    start, end = stage_bounds(pp)[stage_index]
    module = nn.Sequential(*(model.layer(index) for index in range(start, end)))
    dp_group = pp_group = None
    for s in range(pp):  # every rank creates every group, in the same order
        group = dist.new_group([p * pp + s for p in range(dp)])
        dp_group = group if s == stage_index else dp_group
    for p in range(dp):
        group = dist.new_group([p * pp + s for s in range(pp)])
        pp_group = group if p == pipeline else pp_group
    ddp = DistributedDataParallel(module, process_group=dp_group)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    micro_count = GLOBAL_BATCH // MICRO // dp
    first_micro = pipeline * micro_count
    timer = PhaseTimer()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [i for j in range(micro_count) for i in order.microbatch_ids(step, first_micro + j, MICRO)]
        return dataset.batch(ids)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # DDP averages over the dp replicas; ours sums per-sample losses / B: scale so both give sum / B.
        return lm_loss(logits, targets) * dp / GLOBAL_BATCH

    schedule = None
    if pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        stage = PipelineStage(ddp, stage_index, pp, torch.device("cpu"), group=pp_group)
        schedule = Schedule1F1B(stage, micro_count, loss_fn=loss_fn, scale_grads=False)
    times, losses = [], []
    for step in range(steps):
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        with timer.phase("data"):
            inputs, targets = batch(step) if stage_index in (0, pp - 1) else (None, None)
        if schedule is None:
            if inputs is None or targets is None:
                raise RuntimeError("data: the only stage must build inputs and targets")
            for j in range(micro_count):
                sync = j == micro_count - 1
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    rows = slice(j * MICRO, (j + 1) * MICRO)
                    with timer.phase("forward"):
                        loss = loss_fn(ddp(inputs[rows]), targets[rows])
                    with timer.phase("backward (+ DDP all-reduce)"):
                        loss.backward()
                loss_total += float(loss.detach()) / dp
        else:
            with timer.phase("1F1B schedule (+ DDP all-reduce)"):
                if stage_index == 0:
                    schedule.step(inputs)
                elif stage_index == pp - 1:
                    micro_losses: list[torch.Tensor] = []
                    schedule.step(target=targets, losses=micro_losses)
                    loss_total = sum(float(x.detach()) for x in micro_losses) / dp
                else:
                    schedule.step()
        with timer.phase("optimizer"):
            optimizer.step()
        times.append(time.perf_counter() - began)
        timer.end_step()
        losses.append(loss_total)
    # Each step's loss over the world, for the equality check: one all-reduce after the timed steps.
    total = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(total)
    losses = total.tolist()
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "losses": losses, "phases": timer.per_step()}))
    dist.destroy_process_group()


def run_theirs(dp: int, pp: int, steps: int) -> tuple[list[float], list[float], dict[str, float]]:
    """(rank 0's seconds per step, losses, rank 0's mean seconds per phase) of the plain PyTorch job."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.json")
        mp.start_processes(
            _reference_worker,
            args=(dp, pp, free_port(), steps, out),
            nprocs=dp * pp,
            start_method="forkserver",
        )
        data = json.loads(Path(out).read_text())
    return data["times"], data["losses"], data["phases"]


# ---- phase timers (profile mode) -------------------------------------------------------------------------
class PhaseTimer:
    """Seconds per named phase, accumulated per step (nested phases count in both)."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.steps: list[dict[str, float]] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.current[name] += time.perf_counter() - began
            self.calls[name] += 1

    def wrap(self, owner: Any, attribute: str, name: Callable[..., str] | str) -> None:
        """Replace owner.attribute by a timed version (name: fixed, or computed from the call's args)."""
        original = getattr(owner, attribute)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            label = name(*args, **kwargs) if callable(name) else name
            with self.phase(label):
                return original(*args, **kwargs)

        setattr(owner, attribute, timed)

    def end_step(self) -> None:
        self.steps.append(dict(self.current))
        self.current = defaultdict(float)

    def per_step(self, skip: int = 2) -> dict[str, float]:
        """Mean seconds per step of each phase, warm-up steps skipped."""
        kept = self.steps[skip:] or self.steps
        names = sorted({name for step in kept for name in step})
        return {name: statistics.mean(step.get(name, 0.0) for step in kept) for name in names}


PHASES = (
    "run_step",
    "  data (_inputs)",
    "  forward",
    "  backward (torch.autograd.backward)",
    "  wait: pipeline send/receive",
    "  gradient sum (sum_replicas)",
    "    wait: gradient all-reduce",
    "  tied sum (sum_tied)",
    "  norm share (norm_share)",
    "  commit (_commit)",
    "    commit vote (TCPStore compare_set)",
    "    wait: commit",
    "  optimizer (per-layer AdamW.step)",
    "  zero_grad",
    "  rest of run_step (schedule loop, loss.item, isend calls)",
    "worker loop between steps (store writes, plan read)",
)
"""Rows of the breakdown, in display order; indented rows are inside the row above them."""


def _phase_rank(name: str) -> tuple[int, str]:
    return (PHASES.index(name) if name in PHASES else len(PHASES), name)


def _wait_label(_self: Any, _work: Any, what: str) -> str:
    if what.startswith("gradient all-reduce"):
        return "    wait: gradient all-reduce"
    if what.startswith(("receive", "send")):
        return "  wait: pipeline send/receive"
    return "    wait: commit" if what == "commit" else f"  wait: {what}"


def _profiled_worker(rank: int, port: int, config: JobConfig, out: str) -> None:
    """Our worker (`worker_main`) with perf counters around the step's phases, in this process only."""
    from resilientjob.agent import _runtime_commit, _runtime_grads, runtime, worker

    timer = PhaseTimer()
    trainer_cls = runtime.Trainer
    original_run_step = trainer_cls.run_step
    previous_end: list[float] = []

    def run_step(self: Any, latest: int) -> Any:
        if previous_end:  # the worker loop's own work after the previous step (store writes, plan read)
            timer.current[PHASES[-1]] += time.perf_counter() - previous_end[0]
        try:
            with timer.phase(PHASES[0]):
                return original_run_step(self, latest)
        finally:
            timer.end_step()
            previous_end[:] = [time.perf_counter()]

    trainer_cls.run_step = run_step  # type: ignore[method-assign]
    timer.wrap(trainer_cls, "_inputs", PHASES[1])
    timer.wrap(trainer_cls, "_forward", PHASES[2])
    timer.wrap(torch.autograd, "backward", PHASES[3])
    timer.wrap(trainer_cls, "_wait", _wait_label)
    timer.wrap(trainer_cls, "_commit", PHASES[9])
    timer.wrap(_runtime_commit.CommitVote, "vote", PHASES[10])
    timer.wrap(_runtime_grads.GradientSync, "sum_replicas", PHASES[5])
    timer.wrap(_runtime_grads.GradientSync, "sum_tied", PHASES[7])
    timer.wrap(_runtime_grads.GradientSync, "norm_share", PHASES[8])
    timer.wrap(torch.optim.AdamW, "step", PHASES[12])
    timer.wrap(runtime.LayerState, "zero_grad", PHASES[13])
    worker.worker_main(rank, config, "127.0.0.1", port, None, False)
    phases = timer.per_step()
    top = [name for name in PHASES[1:-2] if name in phases and not name.startswith("    ")]
    phases[PHASES[-2]] = phases[PHASES[0]] - sum(phases[name] for name in top)
    calls = {name: count / len(timer.steps) for name, count in timer.calls.items()}
    Path(out, f"rank{rank}.json").write_text(json.dumps({"phases": phases, "calls": calls}))


def _run_workers(
    entry: Callable[..., None], dp: int, pp: int, steps: int, tmp: str
) -> tuple[list[float], list[float]]:
    """Run `entry(rank, port, config, tmp)` (which calls `worker_main`) on dp x pp processes against a store
    holding the plan, as the launcher would; returns rank 0's step times and the losses from the store."""
    config = job_config(steps)
    plan = make_plan(dp, pp).model_copy(update={"generation": 0})
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    publish_plan(store, plan, 0)
    mp.start_processes(entry, args=(store.port, config, tmp), nprocs=dp * pp, start_method="forkserver")
    times = [float(v) for v in store.get(steptime_key(0)).decode().split(";") if v]
    losses = [float(store.get(loss_key(step)).decode().split(":", 1)[1]) for step in range(steps)]
    return times, losses


def profile_ours(
    dp: int, pp: int, steps: int, fixed: bool = False
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Rank 0's mean seconds per step in each phase of our runtime (see `_profiled_worker`; `fixed`: with
    `_apply_fixes`), its calls per step of each, and the smallest mean over all ranks of each phase (for a
    wait: its cost without the skew between ranks, since the last rank to arrive hardly waits)."""
    with tempfile.TemporaryDirectory() as tmp:
        _run_workers(_profiled_fixed_worker if fixed else _profiled_worker, dp, pp, steps, tmp)
        ranks = [json.loads(Path(tmp, f"rank{rank}.json").read_text()) for rank in range(dp * pp)]
    lowest = {name: min(r["phases"].get(name, 0.0) for r in ranks) for name in ranks[0]["phases"]}
    return ranks[0]["phases"], ranks[0]["calls"], lowest


# ---- what if: two fixes applied to our worker in the child process only -----------------------------------
_flat_grads: dict[tuple[int, tuple[int, int]], torch.Tensor] = {}


def _apply_fixes() -> None:
    """Patch this process's runtime with two of the fixes docs/benchmarks/overhead.md proposes, to measure
    them side by side without touching agent/: (1) a micro-batch's data is built once when one worker runs
    both the first and the last layer (`Trainer._run_step` calls `_inputs` twice); (2) gradients live in one
    persistent flat buffer per gradient group (DDP's gradient_as_bucket_view), so `sum_replicas` all-reduces
    it in place: no `torch.cat`, no copy back; `zero_grad` zeroes in place to keep the views."""
    from resilientjob.agent import _runtime_grads, runtime

    trainer_cls = runtime.Trainer
    build = trainer_cls._inputs
    last: dict[tuple[int, int], Any] = {}

    def inputs_once(self: Any, step: int, microbatch: int) -> Any:
        key = (step, microbatch)
        if key not in last:
            last.clear()
            last[key] = build(self, step, microbatch)
        return last[key]

    def sum_replicas(self: Any, layers: Any, track: Any, wait: Any) -> None:
        for number in sorted({group.round for group, _ in self.groups}):
            in_flight = []
            for group, handle in self.groups:
                if group.round != number or handle is None:
                    continue
                params = [p for index in range(*group.layers) for p in layers[index].module.parameters()]
                key = (id(self), group.layers)
                flat = _flat_grads.get(key)
                if flat is None or not all(p.grad is not None and p.grad._base is flat for p in params):
                    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                    flat = torch.cat([g.reshape(-1) for g in grads])
                    offset = 0
                    for param in params:  # from now on the gradients are views of the flat buffer
                        param.grad = flat[offset : offset + param.numel()].view_as(param)
                        offset += param.numel()
                    _flat_grads[key] = flat
                in_flight.append((group, track(dist.all_reduce(flat, group=handle, async_op=True))))
            for group, work in in_flight:
                wait(work, f"gradient all-reduce of layers {list(group.layers)}")

    def zero_grad(self: Any) -> None:
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad.zero_()

    trainer_cls._inputs = inputs_once  # type: ignore[method-assign]
    _runtime_grads.GradientSync.sum_replicas = sum_replicas  # type: ignore[method-assign]
    runtime.LayerState.zero_grad = zero_grad  # type: ignore[method-assign]


def _fixed_worker(rank: int, port: int, config: JobConfig, _tmp: str) -> None:
    from resilientjob.agent import worker

    _apply_fixes()
    worker.worker_main(rank, config, "127.0.0.1", port, None, False)


def _profiled_fixed_worker(rank: int, port: int, config: JobConfig, out: str) -> None:
    _apply_fixes()
    _profiled_worker(rank, port, config, out)


def run_ours_fixed(dp: int, pp: int, steps: int) -> tuple[list[float], list[float]]:
    """Our runtime with fixes 1 and 2 patched in (see `_apply_fixes`)."""
    with tempfile.TemporaryDirectory() as tmp:
        return _run_workers(_fixed_worker, dp, pp, steps, tmp)


def adamw_microbench(repeats: int) -> dict[str, float]:
    """Seconds per optimizer step over the whole model, in this process: one AdamW per layer with
    foreach=False (our `LayerState`), one AdamW over the model (torch's default on CPU: single-tensor, as
    the reference uses), and one AdamW with foreach=True. Interleaved, median of `repeats`."""
    from resilientjob.agent.p2p import LayerState

    model = job_config(1).load_model()
    training = job_config(1).workload.training
    layers = [LayerState(index, model.layer(index), training=training) for index in range(model.num_layers)]
    params = [p for layer in layers for p in layer.module.parameters()]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-3
    whole = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    foreach = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), weight_decay=0.0, foreach=True)
    sides: dict[str, Callable[[], None]] = {
        "per-layer AdamW, foreach=False (ours)": lambda: _step_all(layers),
        "one AdamW, torch's CPU default (reference)": whole.step,
        "one AdamW, foreach=True": foreach.step,
    }
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        for name, step in sides.items():
            began = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - began)
    return {name: statistics.median(values[2:]) for name, values in times.items()}


def _median_phases(runs: list[dict[str, float]]) -> dict[str, float]:
    return {name: statistics.median(run.get(name, 0.0) for run in runs) for name in runs[0]}


def _step_all(layers: list[Any]) -> None:
    for layer in layers:
        layer.optimizer.step()


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 15 steps (about a minute)")
    parser.add_argument("--rounds", type=int, default=None, help="runs per side and layout (default 5)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run not counted")
    parser.add_argument("--profile", action="store_true", help="also time the phases of our step")
    parser.add_argument("--profile-runs", type=int, default=2, help="profiled runs per layout and side")
    parser.add_argument(
        "--what-if", action="store_true", help="add a third side: ours with fixes 1 and 2 patched in"
    )
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 5)
    steps = args.steps or (15 if args.quick else 30)
    if steps <= args.warmup + 2:
        parser.error(f"--steps: need more than warmup + 2 = {args.warmup + 2}")
    torch.set_num_threads(1)
    print(
        f"model gpt {MODEL}, global batch {GLOBAL_BATCH}, micro-batch {MICRO}, AdamW lr {LR}; CPU, gloo, "
        f"1 thread per process; {rounds} rounds x {steps} steps per run, first {args.warmup} dropped; "
        f"load average at start {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    sides = ["ours", "theirs", *(["ours+fixes"] if args.what_if else [])]
    rates: dict[tuple[str, str], list[float]] = defaultdict(list)
    loss_gap: dict[tuple[str, str], float] = defaultdict(float)
    their_phases: dict[str, list[dict[str, float]]] = defaultdict(list)
    for number in range(rounds):
        for layout, (dp, pp) in LAYOUTS.items():
            losses: dict[str, list[float]] = {}
            for side in sides[number % len(sides) :] + sides[: number % len(sides)]:  # rotate the order
                if side == "ours":
                    times, losses[side] = run_ours(dp, pp, steps)
                elif side == "theirs":
                    times, losses[side], phases = run_theirs(dp, pp, steps)
                    their_phases[layout].append(phases)
                else:
                    times, losses[side] = run_ours_fixed(dp, pp, steps)
                rate = 1.0 / statistics.median(times[args.warmup :])
                rates[(layout, side)].append(rate)
                print(f"round {number + 1} {layout:<8} {side:<10} {rate:6.2f} steps/s", flush=True)
            for side in sides:
                gap = max(abs(a - b) for a, b in zip(losses[side], losses["theirs"], strict=True))
                loss_gap[(layout, side)] = max(loss_gap[(layout, side)], gap)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}\n")
    print(
        "| layout | side | steps/s, median (min-max) | reference steps/s | ratio: median of per-round ratios "
        f"(min-max) | ratio of medians | max loss gap | goal >= {GOAL} |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for layout in LAYOUTS:
        theirs = rates[(layout, "theirs")]
        for side in sides:
            if side == "theirs":
                continue
            ours = rates[(layout, side)]
            paired = [a / b for a, b in zip(ours, theirs, strict=True)]
            ratio = statistics.median(paired)
            print(
                f"| {layout} | {side} | {statistics.median(ours):.2f} ({_spread(ours)}) | "
                f"{statistics.median(theirs):.2f} ({_spread(theirs)}) | {ratio:.3f} ({_spread(paired)}) | "
                f"{statistics.median(ours) / statistics.median(theirs):.3f} | "
                f"{loss_gap[(layout, side)]:.1e} | {'met' if ratio >= GOAL else 'BELOW'} |"
            )
    if not args.profile:
        return
    for layout, (dp, pp) in LAYOUTS.items():
        # Plain and patched runs alternate too; each phase is the median over the runs of its side.
        runs: dict[bool, list[tuple[dict[str, float], dict[str, float], dict[str, float]]]] = defaultdict(
            list
        )
        for _ in range(args.profile_runs):
            for fixed_side in (False, True) if args.what_if else (False,):
                runs[fixed_side].append(profile_ours(dp, pp, steps, fixed=fixed_side))
        phases, calls, lowest = (_median_phases([run[k] for run in runs[False]]) for k in range(3))
        fixed = _median_phases([run[0] for run in runs[True]]) if args.what_if else {}
        print(
            f"\n{layout}, our runtime: ms per step, mean over the steps after the first 2 of a run, median "
            f"of {args.profile_runs} runs (indented rows are inside the row above; min rank: the smallest "
            "of all ranks, i.e. a wait without the skew between ranks)\n"
        )
        print("| phase | rank 0 | min rank | rank 0 calls per step | rank 0 with fixes 1+2 |")
        print("|---|---|---|---|---|")
        for name in sorted(phases, key=_phase_rank):
            count = f"{calls[name]:.1f}" if name in calls else ""
            after = f"{fixed[name] * 1e3:.2f}" if name in fixed else ""
            depth = (len(name) - len(name.lstrip())) // 2
            row = f"{'&nbsp;' * 4 * depth}{name.strip()}"
            print(f"| {row} | {phases[name] * 1e3:.2f} | {lowest[name] * 1e3:.2f} | {count} | {after} |")
        reference = {
            name: statistics.median(run[name] for run in their_phases[layout])
            for name in their_phases[layout][0]
        }
        print(f"\n{layout}, reference rank 0: ms per step, median over its {rounds} runs\n")
        print("| phase | rank 0 |\n|---|---|")
        for name, seconds in reference.items():
            print(f"| {name} | {seconds * 1e3:.2f} |")
    print("\nOptimizer step over the whole model, this process alone, ms (median of 50, interleaved)\n")
    print("| optimizer | ms per step |\n|---|---|")
    for name, seconds in adamw_microbench(50).items():
        print(f"| {name} | {seconds * 1e3:.2f} |")


if __name__ == "__main__":
    main()
