"""The papers' results suite: Odyssey's simulation, Oobleck's Table 2, Falcon's 64-GPU case and a sweep.

`run_suite(out)` runs every experiment and writes `out/results.md` with tables, the commands that reproduce
them and PNG plots under `out/img/`. Scenarios are fixed by seeds; plans are cached per planning context
(see `_planner`), which is what keeps the whole suite within minutes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..profile import ModelProfile
from ..spec import ClusterSpec, GiB, JobSpec, TransitionCosts
from ._model import FailSlow, FailSlowKind, PolicyResult, SimCosts, SimPolicy
from ._planner import Planner
from .engine import ORACLE, PlannerPool, Scenario
from .events import every_interval_failures
from .runner import random_scenario, ratios, run_policies, summarise

Log = Callable[[str], None] | None
STORAGE_BYTES_PER_S = 2e9  # checkpoint storage throughput (Oobleck's NVMe object store, order of magnitude)


def checkpoint_costs(
    profile: ModelProfile, interval_s: float = 1800.0, bytes_per_s: float = STORAGE_BYTES_PER_S
) -> TransitionCosts:
    """Checkpoint save and load scaled by the model's state bytes over storage throughput (load also pays
    a minute of relaunch and warm-up)."""
    state = profile.state_bytes(0, profile.num_layers)
    seconds = state / bytes_per_s
    return TransitionCosts(
        checkpoint_save_s=seconds, checkpoint_load_s=60.0 + seconds, checkpoint_interval_s=interval_s
    )


def _say(log: Log, text: str) -> None:
    if log is not None:
        log(text)


# ---- 1. Odyssey section V-B --------------------------------------------------------------------------------
def odyssey(out: Path, seeds: int, pool: PlannerPool, log: Log) -> tuple[str, dict[str, Any]]:
    profile = ModelProfile.load("llama2-7b")
    cluster = ClusterSpec(nodes=32, gpus_per_node=1, device_memory_bytes=64 * GiB)
    job = JobSpec(global_batch=64, microbatch_size=1, fault_tolerance=1)
    costs = SimCosts(transition=checkpoint_costs(profile))
    policies: list[SimPolicy | str] = [*SimPolicy.__members__.values(), ORACLE]
    policies.remove(SimPolicy.DYNAMIC)
    runs: list[dict[str, PolicyResult]] = []
    for seed in range(seeds):
        scenario = random_scenario(profile, cluster, job, hours=9.0, failure_rate=0.1, seed=seed, costs=costs)
        runs.append(run_policies(scenario, policies, pool))
        _say(
            log,
            f"odyssey seed {seed}: " + ", ".join(f"{k}={v.avg_throughput:.2f}" for k, v in runs[-1].items()),
        )
    spread = summarise(runs)
    vs_templates = ratios(runs, "adaptive", "templates")
    vs_reroute = ratios(runs, "adaptive", "reroute")
    from .plot import plot_bars, plot_timelines

    plot_timelines(
        runs[0], out / "img" / "odyssey_timeline.png", "Odyssey setup, seed 0: 32 NPUs, 10%/NPU/h, 9 h"
    )
    plot_bars(
        {k: v.mean for k, v in spread.items()},
        out / "img" / "odyssey_bars.png",
        f"Average throughput over {seeds} seeds",
        {k: v.std for k, v in spread.items()},
    )
    rows = [
        f"| {name} | {value.text(2)} | {value.low:.2f} - {value.high:.2f} |" for name, value in spread.items()
    ]
    text = "\n".join(
        [
            "## 1. Odyssey's simulation (section V-B, Figs. 7-8)",
            "",
            "32 NPUs (one planner node each, 64 GiB), "
            "Llama-2-7B-like profile, global batch 64, micro-batch 1,",
            "fail-stops at 10% per NPU per hour with no repair, "
            "9 hours, checkpoint save/load from the model's",
            f"state at {STORAGE_BYTES_PER_S / 1e9:g} GB/s. {seeds} seeds (0..{seeds - 1}).",
            "",
            "```",
            "rjob simulate --nodes 32 --gpus-per-node 1 "
            f"--device-memory {64 * GiB} --failure-rate 0.1 --hours 9 "
            "--profile llama2-7b --global-batch 64 --storage-bandwidth 2e9 "
            "--policy adaptive,templates,reroute,checkpoint,redundant,oracle "
            f"--seed 0 --seeds {seeds} --json",
            "```",
            "(planning time is measured, so repeated runs differ in the last digits; add `--planning-s 0.1`",
            "for bit-identical runs.)",
            "",
            "| policy | avg throughput (samples/s), mean ± std | min - max |",
            "|---|---|---|",
            *rows,
            "",
            "| ratio (per seed) | ours, mean ± std | paper |",
            "|---|---|---|",
            f"| adaptive / templates (Oobleck) | {vs_templates.text()} | 1.229 |",
            f"| adaptive / reroute (ReCycle) | {vs_reroute.text()} | 1.355 |",
            "",
            "![throughput and active NPUs over time](img/odyssey_timeline.png)",
            "![average throughput](img/odyssey_bars.png)",
            "",
        ]
    )
    summary = {
        "avg_throughput": {k: v.mean for k, v in spread.items()},
        "adaptive_over_templates": vs_templates.mean,
        "adaptive_over_reroute": vs_reroute.mean,
        "worst_seed_ratio": min(vs_templates.low, vs_reroute.low),
    }
    return text, summary


# ---- 2. Oobleck Table 2 ------------------------------------------------------------------------------------
# Oobleck's Table 1 global batches (8192 for BERT, 1024 for GPT-3), micro-batch 1: template instantiation
# no longer grows with the micro-batch count (each template carries its time curve).
OOBLECK_MODELS = (("bert-large", 8192, 1), ("gpt3-2.7b", 1024, 1), ("gpt3-6.7b", 1024, 1))
OOBLECK_INTERVALS = (("6h", 6 * 3600.0), ("1h", 3600.0), ("10m", 600.0))


def oobleck(out: Path, seeds: int, pool: PlannerPool, log: Log) -> tuple[str, dict[str, Any]]:
    policies: list[SimPolicy | str] = [
        SimPolicy.TEMPLATES,
        SimPolicy.CHECKPOINT,
        SimPolicy.REDUNDANT,
        SimPolicy.ADAPTIVE,
    ]
    table: dict[str, dict[str, float]] = {}
    notes: dict[str, str] = {}
    for model, batch, micro in OOBLECK_MODELS:
        profile = ModelProfile.load(model)
        cluster = ClusterSpec(nodes=30, gpus_per_node=1, device_memory_bytes=40 * GiB)
        job = JobSpec(global_batch=batch, microbatch_size=micro, fault_tolerance=1)
        costs = SimCosts(transition=checkpoint_costs(profile))
        for label, interval in OOBLECK_INTERVALS:
            per_seed: list[dict[str, PolicyResult]] = []
            for seed in range(seeds):
                rng = np.random.default_rng(1000 + seed)
                stops = every_interval_failures(rng, cluster.nodes, interval, until_alive=15)
                scenario = Scenario(
                    profile=profile,
                    cluster=cluster,
                    job=job,
                    hours=stops[-1].time_s / 3600.0,
                    fail_stops=tuple(stops[:-1]),
                    failure_rate_per_node_hour=3600.0 / interval / cluster.nodes,
                    costs=costs,
                )
                per_seed.append(run_policies(scenario, policies, pool))
            column = f"{model} {label}"
            table[column] = {k: v.mean for k, v in summarise(per_seed).items()}
            for name, result in per_seed[0].items():
                if result.infeasible:
                    notes[f"{name} {model}"] = result.infeasible
            _say(log, f"oobleck {column}: " + ", ".join(f"{k}={v:.2f}" for k, v in table[column].items()))
    from .plot import plot_grouped

    for model, _, _ in OOBLECK_MODELS:
        groups = {label: table[f"{model} {label}"] for label, _ in OOBLECK_INTERVALS}
        plot_grouped(
            groups, out / "img" / f"oobleck_{model}.png", f"{model}: one failure every ...", "samples/s"
        )
    columns = list(table)
    names = [str(p) for p in policies]
    header = "| policy | " + " | ".join(columns) + " |"
    rule = "|---|" + "---|" * len(columns)
    rows = [
        f"| {name} | " + " | ".join(_cell(table[c].get(name, 0.0)) for c in columns) + " |" for name in names
    ]
    note_lines = [f"- {key}: {value}" for key, value in sorted(notes.items())]
    text = "\n".join(
        [
            "## 2. Oobleck Table 2's shape (section 7.2)",
            "",
            "30 single-GPU nodes (40 GiB), one failure every 6 h, 1 h or 10 min on average (exponential",
            "gaps, a random node each time) until half the nodes remain; average throughput (samples/s)",
            f"until then, mean over {seeds} seeds. Oobleck's global batches: 8192 for BERT, 1024 for GPT-3,",
            "micro-batch 1. `checkpoint` (Varuna) saves at Young's optimum",
            "interval, the others every 30 min as a last resort; save and load scale with the model state",
            f"at {STORAGE_BYTES_PER_S / 1e9:g} GB/s. `redundant` (Bamboo) is planned on half the device",
            "memory and runs 1.5x slower while healthy.",
            "",
            "```",
            "rjob simulate --suite paper   # section 2; single cells: see planner/sim/suite.py `oobleck`",
            "```",
            "",
            header,
            rule,
            *rows,
            "",
            "Policies the planner could not place at all (the paper's OOM blanks for Bamboo):"
            if notes
            else "",
            *note_lines,
            "",
            *[f"![{m}](img/oobleck_{m}.png)" for m, _, _ in OOBLECK_MODELS],
            "",
        ]
    )
    return text, {"table": table}


def _cell(value: float) -> str:
    return "OOM / infeasible" if value == 0 else f"{value:.2f}"


# ---- 3. Falcon section 7.5 ---------------------------------------------------------------------------------
def falcon_trace() -> tuple[FailSlow, ...]:
    """Two link and eight compute fail-slows over one hour, shaped like Falcon's Fig. 20 (bottom)."""
    compute = FailSlowKind.COMPUTE
    link = FailSlowKind.LINK
    return (
        FailSlow(300.0, 5, compute, 1.5, 300.0),
        FailSlow(600.0, 22, link, 3.0, 600.0),
        FailSlow(900.0, 40, compute, 2.0, 240.0),
        FailSlow(1300.0, 13, compute, 1.3, 400.0),
        FailSlow(1500.0, 57, compute, 1.8, 300.0),
        FailSlow(2100.0, 33, link, 4.0, 500.0),
        FailSlow(2300.0, 8, compute, 2.5, 200.0),
        FailSlow(2700.0, 61, compute, 1.4, 450.0),
        FailSlow(3000.0, 18, compute, 1.7, 250.0),
        FailSlow(3200.0, 47, compute, 2.2, 300.0),
    )


def falcon(out: Path, pool: PlannerPool, log: Log) -> tuple[str, dict[str, Any]]:
    profile = ModelProfile.load("gpt3-6.7b")
    cluster = ClusterSpec(nodes=64, gpus_per_node=1, device_memory_bytes=80 * GiB)
    job = JobSpec(global_batch=128, microbatch_size=1, fault_tolerance=1, dp_range=(16, 16), pp_range=(4, 4))
    base = {"profile": profile, "cluster": cluster, "job": job, "hours": 1.0, "costs": SimCosts()}
    runs = {
        "healthy": Scenario(**base),  # type: ignore[arg-type]
        "unmitigated": Scenario(**base, failslows=falcon_trace()),  # type: ignore[arg-type]
        "mitigated": Scenario(**base, failslows=falcon_trace(), mitigation=True),  # type: ignore[arg-type]
    }
    results = {name: run_policies(sc, [SimPolicy.ADAPTIVE], pool)["adaptive"] for name, sc in runs.items()}
    thr = {name: r.avg_throughput for name, r in results.items()}
    iters = {name: 60.0 * value / job.global_batch for name, value in thr.items()}
    gap = thr["healthy"] - thr["unmitigated"]
    removed = (thr["mitigated"] - thr["unmitigated"]) / gap if gap > 0 else math.nan
    layout = f"The planner's layout: `{results['healthy'].initial_layout}`."
    mitigations = [r for r in results["mitigated"].recoveries if r.cause in {"s2", "s3", "s4", "rejoin"}]
    _say(log, f"falcon: {iters}, removed {removed:.3f}")
    from .plot import plot_timelines

    labelled = {}
    for name, result in results.items():
        result.label = name
        labelled[name] = result
    plot_timelines(labelled, out / "img" / "falcon_timeline.png", "Falcon setup: 16 DP x 4 PP, 10 fail-slows")
    text = "\n".join(
        [
            "## 3. Falcon's 64-GPU case (section 7.5, Table 7)",
            "",
            "64 single-GPU nodes (80 GiB), GPT-3 6.7B-like profile, 16 DP x 4 PP (forced with dp/pp ranges),",
            "global batch 128; two link and eight compute fail-slows over one hour (`suite.falcon_trace`,",
            "severities 1.3-4x, 200-600 s each); policy adaptive with Falcon mitigation off and on.",
            layout,
            "",
            "```",
            "rjob simulate --suite paper   # section 3 (the "
            "fixed trace is planner/sim/suite.py falcon_trace)",
            "```",
            "",
            "| run | iterations/min | samples/s |",
            "|---|---|---|",
            *[f"| {name} | {iters[name]:.2f} | {thr[name]:.2f} |" for name in thr],
            "",
            f"Slowdown removed by mitigation: **{removed * 100:.1f}%** "
            "(paper: 60.1%, 17.1 / 14.8 / 16.2 it/min).",
            "Mitigation steps taken: "
            f"{', '.join(f'{r.cause}@{r.time_s:.0f}s' for r in mitigations) or 'none'}.",
            "",
            "![throughput over time](img/falcon_timeline.png)",
            "",
        ]
    )
    steps = {name: sum(1 for r in mitigations if r.cause == name) for name in ("s2", "s3", "s4")}
    return text, {"iterations_per_min": iters, "slowdown_removed": removed, "steps": steps}


SWEEP_FAILURES = 12.0
LARGE_NODES = 32  # beyond this, one seed, the first model and the extreme rates only


# ---- 4. Sweep ----------------------------------------------------------------------------------------------
def sweep(
    out: Path,
    seeds: int,
    pool: PlannerPool,
    log: Log,
    sizes: tuple[tuple[int, int], ...],
    rates: tuple[float, ...],
    models: tuple[str, ...],
) -> tuple[str, dict[str, Any]]:
    policies: list[SimPolicy | str] = [
        SimPolicy.ADAPTIVE,
        SimPolicy.TEMPLATES,
        SimPolicy.REROUTE,
        SimPolicy.CHECKPOINT,
        SimPolicy.REDUNDANT,
        ORACLE,
    ]
    rows: list[str] = []
    worst = math.inf
    below: list[str] = []
    for model in models:
        profile = ModelProfile.load(model)
        costs = SimCosts(transition=checkpoint_costs(profile))
        for nodes, gpus in sizes:
            cluster = ClusterSpec(nodes=nodes, gpus_per_node=gpus)
            job = JobSpec(global_batch=max(64, 4 * nodes), microbatch_size=1, fault_tolerance=1)
            large = nodes > LARGE_NODES
            if large and model != models[0]:
                continue  # the largest clusters for the first model only: their replans take seconds each
            for rate in (rates[0], rates[-1]) if large else rates:
                # Until half the nodes failed on average, at most 12 expected failures and 9 hours: large
                # clusters fail often, and each replan of a 128-node cluster costs seconds.
                hours = min(9.0, math.log(2) / (rate * gpus), SWEEP_FAILURES / (nodes * gpus * rate))
                runs = []
                cell_seeds = seeds if nodes <= 32 else 1
                for seed in range(cell_seeds):
                    sc = random_scenario(
                        profile, cluster, job, hours=hours, failure_rate=rate, seed=seed, costs=costs
                    )
                    runs.append(run_policies(sc, policies, pool))
                spread = summarise(runs)
                singles = {k: v for k, v in spread.items() if k not in {"adaptive", ORACLE}}
                best_name = max(singles, key=lambda k: singles[k].mean)
                best = singles[best_name]
                adaptive = spread["adaptive"]
                oracle = spread[ORACLE]
                noise = 2 * math.hypot(adaptive.std, best.std) / math.sqrt(cell_seeds)
                ratio = adaptive.mean / best.mean if best.mean > 0 else math.inf
                gap = 1 - adaptive.mean / oracle.mean if oracle.mean > 0 else 0.0
                worst = min(worst, ratio)
                flag = ""
                if adaptive.mean < best.mean - noise:
                    flag = " **below**"
                    below.append(f"{model} {nodes * gpus} devices {rate:.0%}/h")
                rows.append(
                    f"| {model} | {nodes}x{gpus} | {rate:.0%} | "
                    f"{hours:.1f} | {adaptive.mean:.2f} | {best_name} "
                    f"{best.mean:.2f} | {ratio:.3f}{flag} | {oracle.mean:.2f} | {gap * 100:.1f}% |"
                )
                _say(log, rows[-1])
    text = "\n".join(
        [
            "## 4. Sweep: cluster size, failure rate, model size",
            "",
            "Poisson fail-stops per device (a device failure takes its node down), no repair, until half",
            f"the nodes failed on average, capped at {SWEEP_FAILURES:.0f} expected failures and 9 hours. "
            f"{seeds} seeds per cell up to 32 nodes, 1 seed",
            "beyond (each replan of 128 nodes takes seconds). "
            "Global batch max(64, 4 x nodes), micro-batch 1.",
            "`best single` is the best of templates, reroute, "
            "checkpoint and redundant. `oracle` is a one-step",
            "hindsight oracle: at every change it asks the planner for each concrete plan (reroute, dynamic,",
            "templates, checkpoint) and keeps the one that "
            "trains the most samples before the next fail-stop,",
            "whose time it knows (it is greedy, so not a strict "
            "upper bound). A cell is flagged **below** when",
            "adaptive trails the best single policy by more than twice the standard error of the difference",
            "(single-seed cells have no noise estimate: any shortfall is flagged).",
            "",
            "```",
            "rjob simulate --nodes N --gpus-per-node G --failure-rate R --hours H --profile P "
            "--global-batch B --policy "
            "adaptive,templates,reroute,checkpoint,redundant,oracle --seeds K --json",
            "```",
            "",
            "| model | nodes x GPUs | rate /device/h | hours | "
            "adaptive | best single | adaptive / best | oracle "
            "| gap to oracle |",
            "|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"Worst adaptive / best-single ratio: {worst:.3f}. "
            "Cells below the best single policy beyond noise: "
            f"{', '.join(below) or 'none'}.",
            "",
        ]
    )
    return text, {"worst_ratio": worst, "below": below}


def discussion(report: dict[str, Any]) -> str:
    """What matches the papers, what does not, and why (numbers from this run)."""
    odyssey_report = report["odyssey"]
    table = report["oobleck"]["table"]
    falcon_report = report["falcon"]
    sweep_report = report["sweep"]
    degrade = {
        model: (
            table[f"{model} 10m"]["checkpoint"] / table[f"{model} 6h"]["checkpoint"],
            table[f"{model} 10m"]["templates"] / table[f"{model} 6h"]["templates"],
        )
        for model, _, _ in OOBLECK_MODELS
    }
    beaten = sum(row["templates"] > row["checkpoint"] for row in table.values())
    everywhere = (
        "on every seed" if odyssey_report["worst_seed_ratio"] > 1 else "on average (not on every seed)"
    )
    lines = [
        "## What we reproduce, what we do not, and why",
        "",
        f"- **Odyssey**: adaptive beats both baselines {everywhere}, by "
        f"{odyssey_report['adaptive_over_templates']:.3f}x over templates (paper 1.229x) and "
        f"{odyssey_report['adaptive_over_reroute']:.3f}x over reroute (paper 1.355x). Our `templates`",
        "  recovers almost as well as dynamic parallelism: both replan in well under a second and copy only",
        "  missing layers, so Oobleck's large fluctuations "
        "(paper Fig. 8) do not appear; the gap that remains",
        "  is the templates' coarser layouts. Rerouting "
        "degrades faster here than in the paper: the planner's",
        "  eq. 13 adds every failed stage's extra micro-batches serially, so after the 15-20 failures of a",
        "  9-hour run the step has grown far longer, and a stage that loses every replica forces a",
        "  checkpoint restart.",
        "- **Oobleck Table 2**: the shape holds for checkpoint-restart (Varuna), whose throughput falls as",
        "  failures get frequent (10 min / 6 h: "
        + ", ".join(f"{m} {d[0]:.2f}" for m, d in degrade.items())
        + "), while templates stay flat ("
        + ", ".join(f"{m} {d[1]:.2f}" for m, d in degrade.items())
        + "). Templates beat checkpoint in "
        + f"{beaten} of {len(table)} cells at Oobleck's global batches; "
        + ("in every cell" if beaten == len(table) else "not everywhere: see the table")
        + ". They now rank",
        "  layouts by the full step (1F1B plus the gradient all-reduce) instead of the pipelines alone,",
        "  which had picked data-parallel-heavy layouts. Bamboo (`redundant`) is not out of memory for the",
        "  GPT-3 models as in the paper: the planner spreads the model over more stages on half the memory;",
        "  it pays the 1.5x redundancy instead.",
        f"- **Falcon**: mitigation removes {falcon_report['slowdown_removed'] * 100:.1f}% of the slowdown",
        "  (paper 60.1%). Falcon's controller (`failslow.MitigationController`, fed every slow iteration)",
        "  applied "
        + ", ".join(f"{name.upper()} {count}x" for name, count in falcon_report["steps"].items())
        + "; slowdowns of 1.3-1.5x cost too little",
        "  to pay for S3 or S4 before they end, and S2 cannot fully hide a 2x straggler (each pipeline keeps",
        "  at least one micro-batch, and the slow stage still sets its pipeline's pace). Our healthy step",
        "  (GPT-3 6.7B profile) is faster than the paper's GPT2-13B, and the gradient all-reduce a link",
        "  fail-slow stretches is a smaller share of it, so severities are not comparable one to one.",
        f"- **Sweep**: worst adaptive / best single policy {sweep_report['worst_ratio']:.3f}; cells below "
        f"beyond noise: {', '.join(sweep_report['below']) or 'none'}.",
    ]
    if sweep_report["below"]:
        lines += [
            "  Where adaptive falls behind at 1,024 devices and 20% per device-hour (a failure every half",
            "  minute, one seed), the cause is the planner's own cost: `auto` evaluates every policy at each",
            "  change, which takes seconds at 128 nodes, while `reroute` answers in a millisecond, and the",
            "  measured planning time is charged as lost training time.",
        ]
    lines += [
        "  The one-step hindsight oracle is greedy, so adaptive can beat it by a little (negative gaps).",
        "",
    ]
    return "\n".join(lines)


# ---- the whole suite ---------------------------------------------------------------------------------------
def run_suite(
    out: Path, quick: bool = False, log: Log = None, planner: Planner | None = None
) -> dict[str, Any]:
    """Run every section and write `out/results.md`; returns the headline numbers. `quick` runs fewer seeds
    and cells (a smoke run); `planner` replaces the real plan search (tests only)."""
    started = time.perf_counter()
    pool = PlannerPool(planner)
    out.mkdir(parents=True, exist_ok=True)
    sections: list[str] = []
    report: dict[str, Any] = {}
    text, report["odyssey"] = odyssey(out, 4 if quick else 20, pool, log)
    sections.append(text)
    text, report["oobleck"] = oobleck(out, 1 if quick else 3, pool, log)
    sections.append(text)
    text, report["falcon"] = falcon(out, pool, log)
    sections.append(text)
    sizes = ((8, 1), (32, 1)) if quick else ((8, 1), (32, 1), (16, 8), (128, 8))
    text, report["sweep"] = sweep(
        out, 1 if quick else 3, pool, log, sizes, (0.01, 0.05, 0.2), ("gpt3-2.7b", "llama2-7b")
    )
    sections.append(text)
    elapsed = time.perf_counter() - started
    report["wall_s"] = elapsed
    report["planner_calls"] = pool.calls
    report["plan_cache_hits"] = pool.hits
    header = "\n".join(
        [
            "# Results: the papers' headline experiments in the ResilientJob simulator",
            "",
            "Generated by `rjob simulate --suite paper` (or `make results`) in "
            f"{elapsed:.0f} s on a shared 2-core machine; {pool.calls} "
            f"planner calls, {pool.hits} plan-cache hits.",
            "Every policy is the real planner "
            "(`resilientjob.planner.search.replan`) choosing plans; the simulator",
            "charges detection, measured planning, weight "
            "transfer, restart, checkpoint save/load and lost work",
            "(see `planner/sim/engine.py`). Plans are cached by (plan replaced, nodes failed, nodes joined,",
            "policy): the planner is deterministic in these, so the cache changes nothing but time.",
            "",
        ]
    )
    sections.append(discussion(report))
    (out / "results.md").write_text(header + "\n" + "\n".join(sections))
    return report
