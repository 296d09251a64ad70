#!/usr/bin/env python3
"""Fail-slow detection benchmark (Falcon Tables 4-5, section 4.2): accuracy, speed, ACF error, in one run.

1. Accuracy, false-positive and false-negative rates of the sliding window, plain BOCD and BOCD +
   verification on labelled traces from `tracegen` (a seed not used while tuning the detector). A trace is
   right when every fail-slow onset and recovery is flagged within 10 iterations and nothing else is
   flagged; FPR counts clean traces with any event, FNR slow traces with a missed onset or recovery.
2. Detector throughput: `BatchDetector` over 4,096 workers on one core, against the single-stream API.
3. ACF iteration-time error on synthetic collective-call streams with jitter.

Run: .venv/bin/python bench/bench_detection.py [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # "per core": keep numpy on one thread
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from resilientjob.planner.failslow import (
    BatchDetector,
    ChangeDetector,
    ChangeEvent,
    DetectorConfig,
    SlidingWindowDetector,
    iteration_times,
)
from resilientjob.planner.failslow.tracegen import LabelledTrace, TraceScore, call_stream, score, trace_suite

SEED = 2025  # the detector's defaults were chosen on seeds 1-7


def _batch_events(traces: Sequence[LabelledTrace], config: DetectorConfig) -> list[list[ChangeEvent]]:
    matrix = np.stack([trace.times for trace in traces], axis=1)
    per_trace: list[list[ChangeEvent]] = [[] for _ in traces]
    for worker, event in BatchDetector(len(traces), config).detect(matrix):
        per_trace[worker].append(event)
    return per_trace


def _window_events(traces: Sequence[LabelledTrace]) -> list[list[ChangeEvent]]:
    return [SlidingWindowDetector().detect(trace.times) for trace in traces]


def _table(name: str, traces: Sequence[LabelledTrace], scores: Sequence[TraceScore]) -> str:
    clean = [s for t, s in zip(traces, scores, strict=True) if not t.slow]
    slow = [s for t, s in zip(traces, scores, strict=True) if t.slow]
    correct = sum(s.correct for s in scores)
    fp = sum(s.false_alarms > 0 for s in clean)
    fn = sum(s.missed_onsets + s.missed_recoveries > 0 for s in slow)
    delays = [d for s in slow for d in s.delays]
    alarms = sum(s.false_alarms for s in scores)
    delay = f"{np.mean(delays):5.1f} / {max(delays):3d}" if delays else "    -"
    return (
        f"| {name:<12} | {100 * correct / len(scores):6.1f} ({correct}/{len(scores)}) "
        f"| {100 * fp / len(clean):5.1f} ({fp}/{len(clean)}) "
        f"| {100 * fn / len(slow):5.1f} ({fn}/{len(slow)}) "
        f"| {alarms:5d} | {delay} |"
    )


def accuracy(clean: int, slow: int) -> None:
    traces = trace_suite(SEED, clean=clean, slow=slow, length=1000)
    episodes = sum(len(t.episodes) for t in traces)
    ladders = sum(e.ladder for t in traces for e in t.episodes)
    never = sum(e.end is None for t in traces for e in t.episodes)
    print(
        f"\n## Accuracy: {clean} clean + {slow} slow traces of 1,000 iterations (seed {SEED}); "
        f"{episodes} fail-slows ({ladders} ladders, {never} never recover)\n"
    )
    detectors: dict[str, Callable[[Sequence[LabelledTrace]], list[list[ChangeEvent]]]] = {
        "SlideWindow": _window_events,
        "BOCD": lambda ts: _batch_events(ts, DetectorConfig(verify=False, despike=False)),
        "BOCD+V": lambda ts: _batch_events(ts, DetectorConfig()),
    }
    groups = {
        "all traces": lambda t: True,
        "low noise (jitter CV <= 2%, like computation)": lambda t: t.jitter_cv <= 0.02,
        "high noise (jitter CV > 2%, like RDMA)": lambda t: t.jitter_cv > 0.02,
    }
    results = {name: run(traces) for name, run in detectors.items()}
    for title, keep in groups.items():
        chosen = [i for i, t in enumerate(traces) if keep(t)]
        subset = [traces[i] for i in chosen]
        print(f"### {title}\n")
        print(
            "| algorithm    | accuracy % | FPR % (clean) | FNR % (slow) | false alarms | delay mean / max |"
        )
        print("|---|---|---|---|---|---|")
        for name, events in results.items():
            print(_table(name, subset, [score(traces[i], events[i]) for i in chosen]))
        print()
    index_error = [
        min(abs(e.index - episode.onset) for e in results["BOCD+V"][i]) if results["BOCD+V"][i] else -1
        for i, t in enumerate(traces)
        for episode in t.episodes
    ]
    exact = sum(err == 0 for err in index_error)
    print(
        f"BOCD+V onset index exact for {exact}/{len(index_error)} fail-slows, max error {max(index_error)}\n"
    )


def throughput(workers: int, steps: int) -> None:
    rng = np.random.default_rng(SEED)
    base = np.exp(rng.uniform(np.log(0.2), np.log(4.0), workers))
    matrix = base * rng.normal(1.0, 0.02, (steps + 50, workers))
    slow = rng.random(workers) < 0.05  # 5% of workers fail slow half-way through the timed part
    matrix[50 + steps // 2 :, slow] *= 1.5
    spikes = rng.random(matrix.shape) < 0.005
    matrix[spikes] *= 2.5
    detector = BatchDetector(workers)
    for row in matrix[:50]:
        detector.feed(row)
    started = time.perf_counter()
    events = 0
    for row in matrix[50:]:
        events += len(detector.feed(row))
    batch_rate = workers * steps / (time.perf_counter() - started)
    single = ChangeDetector()
    stream = matrix[:, 0]
    started = time.perf_counter()
    for _ in range(3):
        for value in stream:
            single.feed(float(value))
    single_rate = 3 * len(stream) / (time.perf_counter() - started)
    print(f"## Throughput ({workers} workers x {steps} iterations, one thread)\n")
    print("| detector | updates/s | vs goal 100,000/s |")
    print("|---|---|---|")
    print(f"| BatchDetector, {workers} workers | {batch_rate:,.0f} | {batch_rate / 1e5:.1f}x |")
    print(f"| ChangeDetector, one stream | {single_rate:,.0f} | {single_rate / 1e5:.2f}x |")
    print(
        f"\nbatch / single-stream = {batch_rate / single_rate:.0f}x; "
        f"{events} events raised ({int(slow.sum())} fail-slows injected)\n"
    )


def acf_error(seeds: int) -> None:
    print("## ACF iteration-time error (synthetic call streams, 1% racing swaps, timestamp noise)\n")
    print(
        "| calls/iteration | jitter CV | period found | mean-time error % (max) "
        "| per-iteration error % (max) | ms |"
    )
    print("|---|---|---|---|---|---|")
    for calls in (4, 12, 40):
        for cv in (0.005, 0.02, 0.05):
            mean_errors, iter_errors, found, spent = [], [], 0, 0.0
            for seed in range(seeds):
                stream = call_stream(np.random.default_rng(seed), 300, calls, base_s=1.5, jitter_cv=cv)
                started = time.perf_counter()
                result = iteration_times(stream.calls)
                spent += time.perf_counter() - started
                truth = stream.iteration_s
                found += result.period == calls
                mean_errors.append(abs(result.mean_s - truth.mean()) / truth.mean())
                n = len(result.times_s)
                iter_errors.append(
                    min(
                        float(np.mean(np.abs(result.times_s - truth[k : k + n]) / truth[k : k + n]))
                        for k in (0, 1)
                    )
                )
            print(
                f"| {calls} | {cv:.1%} | {found}/{seeds} | {100 * np.mean(mean_errors):.3f} "
                f"({100 * max(mean_errors):.3f}) "
                f"| {100 * np.mean(iter_errors):.2f} ({100 * max(iter_errors):.2f}) "
                f"| {1e3 * spent / seeds:.1f} |"
            )
    print()


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    print("# Fail-slow detection (bench/bench_detection.py); taken on a shared 2-core machine under load")
    accuracy(100 if quick else 500, 100 if quick else 500)
    throughput(4096, 30 if quick else 150)
    acf_error(3 if quick else 10)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
