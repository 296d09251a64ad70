"""Tokens/s and MFU of the runtime vs plain PyTorch DDP on the same Llama and devices, and the recovery time
after a worker is killed, measured side by side in one run (docs/benchmarks/gpu.md).

Layouts: DP1 on one device; DP=N on N worker processes (NCCL on CUDA, gloo on CPU); PP2 x DP(N/2) when
N >= 4. For each, our side is `Launcher(config, plan, planner, log_dir).run()` on a hand-made plan and the
plain side is the `transformers` LlamaForCausalLM of the same configuration under DistributedDataParallel
(torch.multiprocessing spawn) over the same N devices with the same global batch, micro-batch, AdamW and
clipping. Both use bf16 autocast with fp32 master weights on CUDA (fp32 on CPU, where the workload refuses
bf16). Step times: our world rank 0's own per-step seconds (`JobResult.step_times`), the plain rank 0's
seconds between two `torch.cuda.synchronize()`; the median after `--warmup` steps on both sides.

Recovery (N >= 2): DP=N with `fail_at={N-1: step}` (the worker exits at the start of that step); the time
from the failure to the first committed step under the new plan, split as bench_recovery.py splits it.

Everything goes to --out (default $OUT, else ./bench-gpu-out): results.json, rewritten after every
measurement so a run cut short still returns what it measured, and table.txt.
Usage: python bench/bench_gpu.py --device cuda --out $OUT
       .venv/bin/python bench/bench_gpu.py --device cpu --tiny --gpus 2   (CPU smoke run: figures meaningless)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_profile import ProfileHooks, StepProfiler  # sibling modules, not a package
from bench_recovery import phases

from resilientjob.agent.profiler import measure_profile
from resilientjob.agent.worker import JobConfig, worker_main
from resilientjob.planner.plan import PipelinePlan, Plan, Policy, StagePlan
from resilientjob.protocol.workload import (
    DataFormat,
    DataSpec,
    Precision,
    TokenDtype,
    TrainingSpec,
    Workload,
)
from resilientjob.testing.launcher import JobResult, Launcher, NodeAgent
from resilientjob.testing.plans import RuntimePlanner

PEAK_BF16_DENSE = (  # (substring of torch.cuda.get_device_name(), dense bf16 FLOP/s); first match wins
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H200", 989e12),
    ("GH200", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("B200", 2250e12),
    ("L40S", 362e12),
)
CPU_NOTE = (
    "CPU smoke run (gloo, fp32, tiny model): these figures only prove the benchmark runs; they say nothing "
    "about GPU throughput, MFU or NCCL recovery."
)


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    seq: int

    def keys(self) -> dict[str, Any]:
        """LlamaConfig keys (full multi-head attention: as many key/value heads as heads)."""
        return {
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.heads,
            "intermediate_size": self.intermediate,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.seq,
            "tie_word_embeddings": False,
        }

    def spec(self) -> str:
        return "hf:llama?" + "&".join(f"{k}={str(v).lower()}" for k, v in self.keys().items())

    def params(self) -> tuple[int, int]:
        """(all parameters, parameters that do matmul FLOPs: all but the input embedding's lookup table)."""
        from transformers import LlamaConfig, LlamaForCausalLM

        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**self.keys()))
        total = sum(p.numel() for p in model.parameters())
        return total, total - model.get_input_embeddings().weight.numel()

    def block_flops(self) -> float:
        """Forward matmul FLOPs per token of one decoder block (for balancing pipeline stages)."""
        return 2.0 * (4 * self.hidden * self.hidden + 3 * self.hidden * self.intermediate)


def flops_per_token(shape: Shape, matmul_params: int) -> float:
    """Training FLOPs per token: 6 x parameters (forward + backward of every matmul weight, input
    embedding excluded) + 12 x layers x hidden x seq for attention scores and values (PaLM, appendix B;
    counts the full, not the causal half, of the score matrix)."""
    return 6.0 * matmul_params + 12.0 * shape.layers * shape.hidden * shape.seq


def peak_flops(device: str, override_tflops: float | None) -> tuple[str, float | None]:
    if device != "cuda":
        return platform.processor() or "cpu", None
    name = torch.cuda.get_device_name(0)
    if override_tflops is not None:
        return name, override_tflops * 1e12
    for key, peak in PEAK_BF16_DENSE:
        if key in name:
            return name, peak
    return name, None


# ---- our runtime ---------------------------------------------------------------------------------------
class _PinnedAgent(NodeAgent):
    """NodeAgent whose worker sees only its node's GPU, as a pod does. The runtime maps a node's local rank
    j to device j (`worker.worker_device`): on one machine every single-device node would take GPU 0."""

    def __init__(self, node: int, log_dir: Path, start_method: str, gpu: int | None) -> None:
        super().__init__(node, log_dir, start_method)
        self.gpu = gpu

    def start(self, args: tuple[object, ...], workers: int = 1) -> None:
        env = {} if self.gpu is None else {"CUDA_VISIBLE_DEVICES": str(self.gpu)}
        self.context = start_processes(
            name=f"rjob-node{self.node}",
            entrypoint=worker_main,
            args={j: (*args, j) for j in range(workers)},
            envs={j: dict(env) for j in range(workers)},
            logs_specs=DefaultLogsSpecs(log_dir=str(self.log_dir / f"node{self.node}"), redirects=Std.ALL),
            start_method=self.start_method,
        )


class PinnedLauncher(Launcher):
    """The Launcher with node n's worker on GPU n (CUDA only; on the CPU it is the Launcher)."""

    def __init__(self, *args: Any, pin: bool, profiler: ProfileHooks | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pin = pin
        self.profiler = profiler

    def crash(self, node: int, restore: bool) -> Any:
        """Node 0's worker is profiled (with --profile); a node to kill gets its crash as the Launcher's."""
        if node == 0 and self.profiler is not None and not self.fail_at:
            return self.profiler
        return super().crash(node, restore)

    def _start(self, nodes: list[int], restore: bool) -> None:
        host, port = "127.0.0.1", self.store.port
        for node in nodes:
            agent = _PinnedAgent(node, self.log_dir, self.start_method, node if self.pin else None)
            agent.start(
                (node, self.config, host, port, self.crash(node, restore), restore), workers=self.degree
            )
            self.agents[node] = agent


def stage_bounds(shape: Shape, pp: int) -> list[tuple[int, int]]:
    """Layer ranges of `pp` stages (layer 0 the embedding, 1..L the blocks, L+1 the head), balanced by
    matmul FLOPs (the head counts as its projection, the embedding as nothing)."""
    costs = [0.0] + [shape.block_flops()] * shape.layers + [2.0 * shape.hidden * shape.vocab]
    if pp == 1:
        return [(0, len(costs))]
    if pp != 2:
        raise ValueError(f"pp: only 1 or 2 stages, got {pp}")
    cut = min(range(1, len(costs)), key=lambda c: max(sum(costs[:c]), sum(costs[c:])))
    return [(0, cut), (cut, len(costs))]


def make_plan(shape: Shape, dp: int, pp: int, microbatches: int, micro: int) -> Plan:
    bounds = stage_bounds(shape, pp)
    pipelines = tuple(
        PipelinePlan(
            stages=tuple(StagePlan(layers=b, node=p * pp + s) for s, b in enumerate(bounds)),
            microbatches=microbatches,
        )
        for p in range(dp)
    )
    return Plan(policy=Policy.DYNAMIC, microbatch_size=micro, step_time_s=1.0, pipelines=pipelines)


def job_config(
    args: argparse.Namespace, shape: Shape, tokens: Path, steps: int, timeout_s: float
) -> JobConfig:
    precision = Precision.BF16 if args.device == "cuda" else Precision.FP32
    workload = Workload(
        model=shape.spec(),
        # A token file, not `synthetic`: the synthetic set builds each sample token by token in Python.
        data=DataSpec(path=str(tokens), format=DataFormat.TOKENS, dtype=TokenDtype.UINT16, seq_len=shape.seq),
        training=TrainingSpec(
            steps=steps, lr=3e-4, weight_decay=0.1, grad_clip_norm=1.0, precision=precision
        ),
        device=args.device,
    )
    return JobConfig(workload=workload, collective_timeout_s=timeout_s, plan_timeout_s=max(60.0, timeout_s))


def run_ours(
    args: argparse.Namespace,
    shape: Shape,
    tokens: Path,
    plan: Plan,
    profile: Any,
    steps: int,
    timeout_s: float,
    log_dir: Path,
    fail_at: dict[int, int] | None = None,
    hooks: ProfileHooks | None = None,
) -> JobResult:
    config = job_config(args, shape, tokens, steps, timeout_s)
    planner = RuntimePlanner.for_job(
        profile,
        nodes=len(plan.nodes),
        global_batch=plan.global_batch,
        microbatch_size=plan.microbatch_size,
        fault_tolerance=0,
    )
    launcher = PinnedLauncher(
        config, plan, planner, log_dir, fail_at=fail_at, pin=args.device == "cuda", profiler=hooks
    )
    return launcher.run(timeout_s=args.job_timeout)


# ---- plain PyTorch -------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _plain_worker(rank: int, world: int, port: int, job: dict[str, Any], result_path: str) -> None:
    """One DDP rank: the `transformers` Llama, AdamW (decay on matrices), clipping, gradient accumulation."""
    from torch.nn.parallel import DistributedDataParallel
    from transformers import LlamaConfig, LlamaForCausalLM

    cuda = job["device"] == "cuda"
    torch.set_num_threads(1)  # as the runtime's workers (worker.worker_main)
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    config = LlamaConfig(**job["keys"], attention_dropout=0.0)
    config._attn_implementation = "sdpa"  # as the runtime's layers (_hf_models.family_config)
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(config).train()
    ddp = DistributedDataParallel(model, device_ids=[rank] if cuda else None)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    flat = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": flat, "weight_decay": 0.0}],
        lr=3e-4,
        betas=(0.9, 0.95),
    )
    micro, seq, accumulate = job["micro"], job["seq"], job["accumulate"]
    generator = torch.Generator(device).manual_seed(rank)
    batches = [
        torch.randint(config.vocab_size, (micro, seq + 1), device=device, generator=generator)
        for _ in range(accumulate)
    ]
    bf16 = job["bf16"]
    profiler = None
    if job["profile"] and rank == 0:
        profiler = StepProfiler(Path(job["profile"]), job["profile_first"], job["profile_steps"])
    times = []
    for step in range(job["steps"]):
        if profiler is not None:
            profiler.begin(step)
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        for index, batch in enumerate(batches):
            sync = contextlib.nullcontext() if index == accumulate - 1 else ddp.no_sync()
            with sync:
                with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                    logits = ddp(batch[:, :-1]).logits
                    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()) / accumulate
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
        if profiler is not None:
            profiler.end(step)
    if rank == 0:
        memory = torch.cuda.max_memory_allocated() if cuda else 0
        Path(result_path).write_text(json.dumps({"step_times": times, "max_memory_bytes": memory}))
    dist.destroy_process_group()


def run_plain(
    args: argparse.Namespace, shape: Shape, world: int, global_batch: int, steps: int, profile: str = ""
) -> list[float]:
    if global_batch % (world * args.micro_batch):
        raise ValueError(f"global batch {global_batch} does not split into {world} x micro-batches")
    job = {
        "device": args.device,
        "keys": shape.keys(),
        "micro": args.micro_batch,
        "seq": shape.seq,
        "accumulate": global_batch // (world * args.micro_batch),
        "steps": steps,
        "bf16": args.device == "cuda",
        "profile": profile,
        "profile_first": args.warmup + args.steps,
        "profile_steps": args.profile_steps,
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plain.json"
        mp.spawn(_plain_worker, args=(world, _free_port(), job, str(path)), nprocs=world, join=True)
        return list(json.loads(path.read_text())["step_times"])


# ---- the benchmark -------------------------------------------------------------------------------------
class Report:
    """results.json (rewritten after every measurement) and the printed table."""

    def __init__(self, out: Path, header: dict[str, Any]) -> None:
        self.out = out
        self.data: dict[str, Any] = {**header, "layouts": [], "recovery": None}
        self.lines: list[str] = []

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.json").write_text(json.dumps(self.data, indent=2, default=str))
        (self.out / "table.txt").write_text("\n".join(self.lines) + "\n")

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)
        self.save()


def _median_after(times: list[float], warmup: int, steps: int | None = None) -> float:
    """The median of `steps` step times after `warmup` (all after it when None): profiled steps, which run
    after the measured ones, are left out."""
    measured = times[warmup : None if steps is None else warmup + steps] or times[-1:]
    return statistics.median(measured)


def _mfu(tokens_per_s: float, per_token: float, devices: int, peak: float | None) -> float | None:
    return None if peak is None else tokens_per_s * per_token / (devices * peak)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def layouts(gpus: int) -> list[tuple[int, int]]:
    found = [(1, 1)]
    if gpus >= 2:
        found.append((gpus, 1))
    if gpus >= 4 and gpus % 2 == 0:
        found.append((gpus // 2, 2))
    return found


def measure_layout(
    args: argparse.Namespace, report: Report, shape: Shape, tokens: Path, profile: Any, dp: int, pp: int
) -> None:
    devices = dp * pp
    microbatches = args.pp_microbatches if pp > 1 else args.microbatches
    plan = make_plan(shape, dp, pp, microbatches, args.micro_batch)
    profiled = args.profile_steps if args.profile else 0
    steps = args.warmup + args.steps + profiled
    name = f"dp{dp}pp{pp}"
    row: dict[str, Any] = {
        "layout": f"DP{dp} x PP{pp}",
        "devices": devices,
        "global_batch": plan.global_batch,
    }
    row["stages"] = [list(b) for b in stage_bounds(shape, pp)]
    tokens_per_step = plan.global_batch * shape.seq
    sides = set(args.sides.split(","))
    if "ours" in sides:
        try:
            hooks = None
            if args.profile:
                path = str(report.out / f"profile_{name}_ours.txt")
                hooks = ProfileHooks(path, args.warmup + args.steps, profiled)
            logs = report.out / "logs" / name
            result = run_ours(args, shape, tokens, plan, profile, steps, args.timeout, logs, hooks=hooks)
            times = result.step_times[0]
            row["ours"] = {"step_times": times, "wall_s": result.wall_s}
            row["ours_tokens_per_s"] = tokens_per_step / _median_after(times, args.warmup, args.steps)
        except Exception as exc:  # the plain side still runs; the row says what failed
            row["ours_error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    if "plain" in sides:
        try:
            trace = str(report.out / f"profile_{name}_plain.txt") if args.profile else ""
            times = run_plain(args, shape, devices, plan.global_batch, steps, trace)
            row["plain"] = {"step_times": times, "ddp_world": devices}
            row["plain_tokens_per_s"] = tokens_per_step / _median_after(times, args.warmup, args.steps)
        except Exception as exc:
            row["plain_error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    per_token, peak = report.data["flops_per_token"], report.data["peak_flops"]
    ours, plain = row.get("ours_tokens_per_s"), row.get("plain_tokens_per_s")
    row["ratio"] = ours / plain if ours and plain else None
    row["ours_mfu"] = _mfu(ours, per_token, devices, peak) if ours else None
    row["plain_mfu"] = _mfu(plain, per_token, devices, peak) if plain else None
    report.data["layouts"].append(row)

    def cell(value: float | None, side: str) -> str:
        return f"{value:>12.1f}" if value else f"{'failed' if side in sides else 'not run':>12}"

    ratio = f"{row['ratio']:>8.3f}" if row["ratio"] else f"{'n/a':>8}"
    report.say(
        f"{row['layout']:<12}{devices:>4}{plan.global_batch:>7}"
        f"{cell(ours, 'ours')}{cell(plain, 'plain')}{ratio}"
        f"{_pct(row['ours_mfu']):>10}{_pct(row['plain_mfu']):>10}"
    )


def measure_recovery(
    args: argparse.Namespace, report: Report, shape: Shape, tokens: Path, profile: Any, gpus: int
) -> None:
    plan = make_plan(shape, gpus, 1, args.microbatches, args.micro_batch)
    victim, step = gpus - 1, args.fail_step
    print(f"killing node {victim} at step {step}: torch elastic logs its exit (code 17) below", flush=True)
    entry: dict[str, Any] = {"layout": f"DP{gpus} x PP1", "killed_node": victim, "fail_step": step}
    report.data["recovery"] = entry
    try:
        result = run_ours(
            args, shape, tokens, plan, profile, args.recovery_steps, args.recovery_timeout,
            report.out / "logs" / "recovery", fail_at={victim: step},
        )  # fmt: skip
        split = phases(result)
        after = result.plans[-1]
        entry.update(
            phases_s=split,
            policy=str(after.policy),
            layout_after=after.layout,
            committed=len(result.losses),
            step_before_s=_median_after(result.step_times[0], 1),
            step_after_s=_median_after(result.step_times[after.generation], 1),
        )
        report.say(
            f"recovery after killing node {victim} at step {step} (DP{gpus}): failure -> next committed step "
            f"{split['total']:.2f} s (detect {split['detect']:.2f}, plan {split['plan']:.2f}, rendezvous "
            f"{split['rendezvous']:.2f}, copy {split['copy']:.2f}, resume {split['resume']:.2f}); "
            f"policy {after.policy}, now {after.layout}; {len(result.losses)}/{args.recovery_steps} steps"
        )
        report.say(
            f"step time before {entry['step_before_s'] * 1e3:.1f} ms, "
            f"after {entry['step_after_s'] * 1e3:.1f} ms"
        )
    except Exception as exc:
        entry["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        report.say(f"recovery after killing node {victim} at step {step}: FAILED ({entry['error']})")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    parser.add_argument(
        "--gpus", type=int, default=None, help="devices (workers); default: all GPUs, 2 on CPU"
    )
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized model and job")
    parser.add_argument("--out", default=os.environ.get("OUT") or "bench-gpu-out")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per pipeline (PP1)")
    parser.add_argument("--pp-microbatches", type=int, default=8, help="micro-batches per pipeline (PP2)")
    parser.add_argument("--steps", type=int, default=10, help="measured steps, after --warmup")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--parts", default="throughput,recovery")
    parser.add_argument("--layouts", default="", help="e.g. 1x1,8x1,4x2 (DPxPP); default: all that fit")
    parser.add_argument("--recovery-steps", type=int, default=8)
    parser.add_argument("--fail-step", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0, help="collective timeout of throughput runs")
    parser.add_argument("--recovery-timeout", type=float, default=20.0, help="collective timeout, recovery")
    parser.add_argument("--job-timeout", type=float, default=540.0, help="seconds before a job is abandoned")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the device's peak")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile rank 0 of both sides for --profile-steps steps after the measured ones "
        "(profile_<layout>_{ours,plain}.txt in --out)",
    )
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument(
        "--sides", default="ours,plain", help="which sides run (ours alone: comparing two versions of ours)"
    )
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
        args.tiny = args.tiny or args.device == "cpu"
    if args.device == "cpu" and not args.tiny:
        parser.error("--device cpu needs --tiny (a 1B model on CPU workers would take hours)")
    if args.tiny:
        tiny = {"hidden": 64, "layers": 2, "heads": 4, "intermediate": 128, "vocab": 512, "seq": 64}
        for key, value in tiny.items():
            setattr(args, key, value)
        args.steps, args.warmup, args.recovery_steps, args.fail_step = 4, 1, 6, 2
        args.micro_batch, args.microbatches, args.pp_microbatches = 2, 2, 4
        args.timeout, args.recovery_timeout, args.job_timeout = 30.0, 5.0, 120.0
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible (torch.cuda.is_available() is False)")
    if args.gpus is None:
        args.gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.gpus < 1:
        parser.error(f"--gpus: must be >= 1, got {args.gpus}")
    if args.device == "cuda" and args.gpus > torch.cuda.device_count():
        parser.error(f"--gpus: {args.gpus} requested, {torch.cuda.device_count()} visible")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    shape = Shape(args.hidden, args.layers, args.heads, args.intermediate, args.vocab, args.seq)
    total, matmul = shape.params()
    per_token = flops_per_token(shape, matmul)
    device_name, peak = peak_flops(args.device, args.peak_tflops)
    out = Path(args.out).resolve()
    import transformers

    header = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": args.device,
        "device_name": device_name,
        "gpus": args.gpus,
        "peak_flops": peak,
        "shape": asdict(shape),
        "params": total,
        "matmul_params": matmul,
        "flops_per_token": per_token,
        "mfu_formula": "tokens/s x (6 x params without the input embedding + 12 x layers x hidden x seq) / "
        "(devices x peak dense bf16 FLOP/s)",
        "precision": "bf16 autocast, fp32 master weights" if args.device == "cuda" else "fp32",
        "micro_batch": args.micro_batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None,
        "note": CPU_NOTE if args.device == "cpu" else None,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    report = Report(out, header)
    if args.device == "cpu":
        report.say(CPU_NOTE)
    report.say(
        f"{device_name} x{args.gpus} ({args.device}); Llama {total / 1e6:.1f}M params, hidden {shape.hidden},"
        " "
        f"{shape.layers} layers, {shape.heads} heads, ffn {shape.intermediate}, vocab {shape.vocab}, seq "
        f"{shape.seq}; {header['precision']}; micro-batch {args.micro_batch}; median of {args.steps} steps "
        f"after {args.warmup} warm-up"
    )
    report.say(f"MFU = {header['mfu_formula']}; {per_token:.4g} FLOP/token; peak {peak or 'unknown'}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tokens = Path(tmp) / "tokens.bin"
        biggest = max(dp * max(args.microbatches, args.pp_microbatches) for dp, _ in layouts(args.gpus))
        samples = 4 * biggest * args.micro_batch
        rng = np.random.default_rng(0)
        rng.integers(0, shape.vocab, samples * shape.seq + 1, dtype=np.uint16).tofile(tokens)
        # Bytes exact, times nominal: the planner only needs them for the recovery's replan.
        config = job_config(args, shape, tokens, 1, args.timeout)
        profile = measure_profile(config.load_model(), microbatch_size=args.micro_batch, timed=False)
        parts = set(args.parts.split(","))
        if "throughput" in parts:
            chosen = layouts(args.gpus)
            if args.layouts:
                wanted = [tuple(int(v) for v in item.split("x")) for item in args.layouts.split(",")]
                chosen = [layout for layout in chosen if layout in wanted]
            report.say(
                f"{'layout':<12}{'dev':>4}{'batch':>7}{'ours tok/s':>12}{'plain tok/s':>12}{'ratio':>8}"
                f"{'ours MFU':>10}{'plain MFU':>10}"
            )
            for dp, pp in chosen:
                measure_layout(args, report, shape, tokens, profile, dp, pp)
        if "recovery" in parts and args.gpus >= 2:
            measure_recovery(args, report, shape, tokens, profile, args.gpus)
        elif "recovery" in parts:
            report.say("recovery: skipped, killing a worker needs >= 2 devices (one worker per device)")
    report.data["wall_s"] = time.perf_counter() - started
    report.say(f"ratio = ours / plain tokens/s, same layout, devices, global batch; results in {out}")


if __name__ == "__main__":
    main()
