"""Template generation on Oobleck's Table 3 grid, next to the paper's planning times, and side by side with
our own stage-count DP and a straightforward memoised implementation of Oobleck's divide and conquer (same
objective, same optimum).

Run: .venv/bin/python bench/bench_templates.py [--quick]
     .venv/bin/python bench/bench_templates.py --instantiate [--quick]

`--instantiate` times what happens at failure time instead (issue #16): `instantiate` and `reinstantiate`
(failed=[3]) of the 96-layer GPT profile of `bench/bench_replan.py`, f = 1, micro-batch 1, global batch
8,192, best of seven (the development machine is shared), with `generate_templates` (offline: it also
makes each template's time curve) once,
and the largest relative error of the time curves against the exact 1F1B tables up to 8,192 micro-batches
(on the 32-node cells; `--quick` leaves out 1,024 nodes).

`--instantiate --baseline DIR` also times another checkout of the project (e.g. `git worktree add
/tmp/base <commit>`) side by side: for each cell, `generate_templates` once and `instantiate` best of seven,
in fresh processes that alternate baseline and this checkout twice (the least of each kept, so a loaded
machine slows both alike), and prints the ratios and whether both chose the same layout and step time.

Each grid cell plans ONE template of n nodes x G GPUs for an L-layer model (GPT-3 2.7B blocks, 80 GiB
devices), as Table 3 does ("a single pipeline template"): that is the column compared with the paper.
Times are the best of five runs on one core and include building the mapper. Next to it, from the same
run: the stage-count DP (`best_by_stage_count`, the exact search the node-level path falls back to; one
run) with a check that both find the same optimum, and `generate_templates` for the whole template set of
that cluster (every size n0..N - f n0 with f = 1, each with its exact 1F1B time; best of three), which is
more than the paper's column measures. The divide-and-conquer baseline
follows Oobleck's recursion (split layers at k, stages into s + (S' - s), nodes - or one node's GPUs - into
two groups; memoised on (stages, layer range, nodes, GPUs)). Because sum t + (4S - 1) max t does not
decompose, each sub-problem keeps the Pareto front of (sum, max) pairs, which makes it exact for the
objective; it runs only on cells small enough to finish in seconds.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import sys
import time
from collections.abc import Callable
from functools import cache, partial

import numpy as np

from resilientjob.planner._stage_mapping import StageMapper
from resilientjob.planner.estimator import OneFOneB, pipeline_arrays
from resilientjob.planner.profile import ModelProfile
from resilientjob.planner.spec import ClusterSpec, JobSpec
from resilientjob.planner.templates import (
    TemplateSet,
    generate_templates,
    instantiate,
    pipeline_plan,
    reinstantiate,
    template_curve,
)

GiB = 2**30
# Oobleck Table 3 (seconds): (nodes, GPUs per node) -> times for 24, 32, 64, 96 layers.
PAPER = {
    (8, 1): (0.28, 0.71, 9.65, 68.50),
    (8, 4): (0.41, 1.15, 11.58, 74.56),
    (8, 8): (0.54, 1.50, 20.98, 109.76),
    (16, 1): (3.37, 7.45, 66.35, 540.36),
    (16, 4): (4.56, 10.41, 108.10, 649.67),
    (16, 8): (4.90, 11.78, 176.04, 1213.63),
    (24, 1): (11.35, 30.11, 262.47, 1477.54),
    (24, 4): (14.78, 45.80, 472.53, 2153.84),
    (24, 8): (15.59, 49.25, 520.08, 3297.92),
}
LAYERS = (24, 32, 64, 96)
# Cells where the divide and conquer finishes in seconds: (nodes, GPUs per node, layers).
BUILTIN_CELLS = (
    ("llama2-7b", 8, 8),
    ("llama2-7b", 24, 4),
    ("gpt3-6.7b", 16, 8),
    ("gpt3-2.7b", 8, 2),
    ("bert-large", 4, 8),
)
DC_CELLS = ((8, 1, 24), (8, 4, 24), (8, 8, 24), (16, 1, 24), (4, 2, 10))


def model(layers: int) -> ModelProfile:
    block = ModelProfile.load("gpt3-2.7b").layers[1]
    return ModelProfile(
        name=f"gpt3-2.7b-blocks-{layers}",
        layers=tuple(block.model_copy(update={"name": f"block{i}"}) for i in range(layers)),
    )


def ours(profile: ModelProfile, nodes: int, gpus: int, repeats: int = 5) -> tuple[float, float, int]:
    """Best-of-`repeats` seconds, objective and stage count of the exact search for one template."""
    best_time, result = float("inf"), None
    for _ in range(repeats):
        began = time.perf_counter()
        result = StageMapper(profile, gpus, nodes, 80 * GiB).best(nodes)
        best_time = min(best_time, time.perf_counter() - began)
    assert result is not None
    return best_time, result.objective, result.num_stages


def stage_count_dp(profile: ModelProfile, nodes: int, gpus: int) -> tuple[float, float]:
    """Seconds (one run) and objective of the stage-count DP alone."""
    began = time.perf_counter()
    result = StageMapper(profile, gpus, nodes, 80 * GiB).best_by_stage_count(nodes)
    seconds = time.perf_counter() - began
    assert result is not None
    return seconds, result.objective


def template_set(profile: ModelProfile, nodes: int, gpus: int) -> tuple[float, int]:
    """Best-of-three seconds of generate_templates (f = 1) and how many templates it made."""
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=gpus, device_memory_bytes=80 * GiB)
    best_time, count = float("inf"), 0
    for _ in range(3):
        began = time.perf_counter()
        count = len(generate_templates(profile, cluster, 1).templates)
        best_time = min(best_time, time.perf_counter() - began)
    return best_time, count


def divide_and_conquer(profile: ModelProfile, nodes: int, gpus: int) -> float:
    """Oobleck's memoised recursion over (stages, [u, v), nodes, GPUs), exact via (sum, max) fronts."""
    layers = profile.num_layers

    def stage_time(start: int, end: int, width: int) -> float:
        forward, backward = profile.stage_times(start, end, width)
        return forward + backward

    def pareto(pairs: list[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
        front: list[tuple[float, float]] = []
        for total, peak in sorted(pairs):
            if not front or peak < front[-1][1]:
                front.append((total, peak))
        return tuple(front)

    @cache
    def solve(stages: int, start: int, end: int, group: int, width: int) -> tuple[tuple[float, float], ...]:
        if stages > end - start or (group == 1 and width < stages) or group > stages:
            return ()
        if stages == 1:
            t = stage_time(start, end, width)
            return ((t, t),)
        pairs: list[tuple[float, float]] = []
        for cut in range(start + 1, end):
            splits = (
                [(1, g, 1, width - g) for g in range(1, width)]
                if group == 1
                else [(n, width, group - n, width) for n in range(1, group)]
            )
            for left_group, left_width, right_group, right_width in splits:
                for left_stages in range(1, stages):
                    left = solve(left_stages, start, cut, left_group, left_width)
                    if not left:
                        continue
                    right = solve(stages - left_stages, cut, end, right_group, right_width)
                    pairs.extend((a + c, max(b, d)) for a, b in left for c, d in right)
        return pareto(pairs)

    best = float("inf")
    for stages in range(nodes, min(layers, nodes * gpus) + 1):
        for total, peak in solve(stages, 0, layers, nodes, gpus):
            best = min(best, total + (4 * stages - 1) * peak)
    return best


INSTANTIATE_CASES = ((32, 1, 0.020), (32, 8, 0.020), (1024, 1, 0.5))  # nodes, GPUs per node, target s
INSTANTIATE_BATCH = 8192


def _best_of(repeats: int, run: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - began)
    return best


def curve_error(profile: ModelProfile, cluster: ClusterSpec, templates: TemplateSet, upto: int) -> float:
    """Largest relative error of the stored time curves against the exact 1F1B tables up to `upto`."""
    worst = 0.0
    for template in templates.templates:
        arrays = pipeline_arrays(
            profile, cluster, pipeline_plan(profile, template, list(range(template.nodes)), 1)
        )
        exact = np.maximum.accumulate(OneFOneB(*arrays).times(upto))
        curve = template_curve(profile, cluster, template)
        line = np.array([curve.at(m) for m in range(1, upto + 1)])
        worst = max(worst, float(np.max(np.abs(line - exact) / exact)))
    return worst


# Run in a fresh process against one checkout: the public API both versions share.
_SIDE_SNIPPET = """
import json, sys, time
sys.path.insert(0, sys.argv[4])
from bench_replan import gpt_96
from resilientjob.planner.spec import ClusterSpec, JobSpec
from resilientjob.planner.templates import generate_templates, instantiate
nodes, gpus, batch = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
profile = gpt_96()
cluster = ClusterSpec(nodes=nodes, gpus_per_node=gpus)
job = JobSpec(global_batch=batch, microbatch_size=1, fault_tolerance=1)
began = time.perf_counter()
templates = generate_templates(profile, cluster, 1)
generate = time.perf_counter() - began
best = float("inf")
for _ in range(7):
    began = time.perf_counter()
    plan = instantiate(templates, list(range(nodes)), profile, cluster, job)
    best = min(best, time.perf_counter() - began)
found = {"generate": generate, "instantiate": best, "layout": plan.layout, "step": plan.step_time_s}
print(json.dumps(found))
"""


def _side_run(checkout: str, nodes: int, gpus: int) -> dict[str, float | str]:
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        os.symlink(os.path.abspath(checkout), os.path.join(root, "resilientjob"))
        env = {**os.environ, "PYTHONPATH": root}
        bench_dir = os.path.dirname(os.path.abspath(__file__))
        args = [str(nodes), str(gpus), str(INSTANTIATE_BATCH), bench_dir]
        out = subprocess.run(
            [sys.executable, "-c", _SIDE_SNIPPET, *args], env=env, capture_output=True, text=True, check=True
        ).stdout
    found: dict[str, float | str] = json.loads(out.strip().splitlines()[-1])
    return found


def side_by_side(baseline: str, quick: bool) -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f"## Side by side with {baseline} (fresh processes, alternating, least of two each)\n")
    print(
        "| nodes x GPUs | generate: baseline (s) | ours (s) | ratio | instantiate: baseline (ms) | ours (ms) "
        "| speed-up | same layout and step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|:---:|")
    for nodes, gpus, _ in INSTANTIATE_CASES:
        if quick and nodes > 32:
            continue
        runs: dict[str, list[dict[str, float | str]]] = {"base": [], "ours": []}
        for _ in range(2):
            runs["base"].append(_side_run(baseline, nodes, gpus))
            runs["ours"].append(_side_run(here, nodes, gpus))
        gen = {k: min(float(r["generate"]) for r in v) for k, v in runs.items()}
        inst = {k: min(float(r["instantiate"]) for r in v) for k, v in runs.items()}
        same = all(
            (r["layout"], r["step"]) == (runs["base"][0]["layout"], runs["base"][0]["step"])
            for v in runs.values()
            for r in v
        )
        print(
            f"| {nodes} x {gpus} | {gen['base']:.2f} | {gen['ours']:.2f} | "
            f"{gen['base'] / gen['ours']:.1f}x | "
            f"{inst['base'] * 1e3:.1f} | {inst['ours'] * 1e3:.1f} | {inst['base'] / inst['ours']:.1f}x | "
            f"{'yes' if same else 'NO'} |",
            flush=True,
        )
    print()


def instantiation(quick: bool) -> int:
    from bench_replan import gpt_96

    profile = gpt_96()
    print(f"## Instantiation at failure time: {profile.name}, f = 1, global batch {INSTANTIATE_BATCH}\n")
    print("load average at start: " + ", ".join(f"{x:.1f}" for x in os.getloadavg()) + "\n")
    print(
        "| nodes x GPUs | templates | generate (s) | instantiate (ms) | target (ms) | met | layout "
        "| reinstantiate (ms) | curve error |"
    )
    print("|---|---:|---:|---:|---:|:---:|---|---:|---:|")
    missed = 0
    for nodes, gpus, target in INSTANTIATE_CASES:
        if quick and nodes > 32:
            continue
        cluster = ClusterSpec(nodes=nodes, gpus_per_node=gpus)
        job = JobSpec(global_batch=INSTANTIATE_BATCH, microbatch_size=1, fault_tolerance=1)
        began = time.perf_counter()
        templates = generate_templates(profile, cluster, 1)
        generate_s = time.perf_counter() - began
        alive = list(range(nodes))
        plan = instantiate(templates, alive, profile, cluster, job)
        seconds = _best_of(7, partial(instantiate, templates, alive, profile, cluster, job))
        again = _best_of(7, partial(reinstantiate, templates, plan, [3], profile, cluster, job))
        error = f"{curve_error(profile, cluster, templates, INSTANTIATE_BATCH):.2e}" if nodes <= 32 else "-"
        met = seconds <= target
        missed += not met
        print(
            f"| {nodes} x {gpus} | {len(templates.templates)} | {generate_s:.2f} | {seconds * 1e3:.1f} | "
            f"{target * 1e3:.0f} | {'yes' if met else 'no'} | {plan.layout} | {again * 1e3:.1f} | {error} |",
            flush=True,
        )
    return 1 if missed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the 24- and 32-layer columns")
    parser.add_argument("--instantiate", action="store_true", help="time instantiation at failure time")
    parser.add_argument(
        "--baseline", metavar="DIR", help="with --instantiate: another checkout, timed side by side"
    )
    args = parser.parse_args()
    if args.instantiate:
        if args.baseline:
            side_by_side(args.baseline, args.quick)
        return instantiation(args.quick)
    layer_set = LAYERS[:2] if args.quick else LAYERS
    print("## Table 3 grid: one template, exact search vs Oobleck's reported planning time\n")
    print(
        "| nodes | GPUs/node | layers | stages | ours (ms) | paper (s) | ours / paper | <= 1%? "
        "| stage-count DP (ms) | same optimum | template set: sizes | template set (ms) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|:---:|---:|:---:|---:|---:|")
    passed = margin = total = 0
    worst = 0.0
    for (nodes, gpus), times in PAPER.items():
        for layers, paper in zip(LAYERS, times, strict=True):
            if layers not in layer_set:
                continue
            profile = model(layers)
            seconds, objective, stages = ours(profile, nodes, gpus)
            dp_seconds, dp_objective = stage_count_dp(profile, nodes, gpus)
            set_seconds, set_count = template_set(profile, nodes, gpus)
            same = abs(objective - dp_objective) <= 1e-9 * dp_objective
            ratio = seconds / paper
            total += 1
            passed += ratio <= 0.01
            margin += ratio <= 0.005
            worst = max(worst, ratio)
            print(
                f"| {nodes} | {gpus} | {layers} | {stages} | {seconds * 1e3:.2f} | {paper:g} | "
                f"{ratio * 100:.3f}% | {'yes' if ratio <= 0.01 else 'no'} | {dp_seconds * 1e3:.1f} | "
                f"{'yes' if same else f'NO ({objective} vs {dp_objective})'} | {set_count} | "
                f"{set_seconds * 1e3:.1f} |",
                flush=True,
            )
    print(
        f"\n{passed} of {total} cells within 1% of the paper's time, {margin} within 0.5%; "
        f"worst {worst * 100:.3f}%.\n"
    )
    print("## Built-in profiles (embedding and head layers differ from the blocks)\n")
    print("| profile | nodes | GPUs/node | stages | ours (ms) | stage-count DP (ms) | same optimum |")
    print("|---|---:|---:|---:|---:|---:|:---:|")
    for name, nodes, gpus in BUILTIN_CELLS:
        profile = ModelProfile.load(name)
        seconds, objective, stages = ours(profile, nodes, gpus)
        dp_seconds, dp_objective = stage_count_dp(profile, nodes, gpus)
        same = abs(objective - dp_objective) <= 1e-9 * dp_objective
        print(
            f"| {name} | {nodes} | {gpus} | {stages} | {seconds * 1e3:.2f} | {dp_seconds * 1e3:.1f} | "
            f"{'yes' if same else f'NO ({objective} vs {dp_objective})'} |",
            flush=True,
        )
    print()
    print("## Side by side with a memoised divide and conquer (same objective)\n")
    print("| nodes | GPUs/node | layers | D&C (s) | ours (ms) | speed-up | same optimum |")
    print("|---:|---:|---:|---:|---:|---:|:---:|")
    for nodes, gpus, layers in DC_CELLS:
        profile = model(layers)
        began = time.perf_counter()
        reference = divide_and_conquer(profile, nodes, gpus)
        dc_seconds = time.perf_counter() - began
        seconds, objective, _ = ours(profile, nodes, gpus)
        same = abs(objective - reference) <= 1e-9 * reference
        print(
            f"| {nodes} | {gpus} | {layers} | {dc_seconds:.3f} | {seconds * 1e3:.2f} | "
            f"{dc_seconds / seconds:.0f}x | {'yes' if same else f'NO ({objective} vs {reference})'} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
