"""The healthy fail-slow bench's judgement of an episode (bench/bench_failslow_e2e.py): an episode counts
as real only when the job's own step times, which the bench gathers itself, show the slowdown at its onset."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_failslow_e2e import (  # a script, not a package
    EPISODE_ONSET,
    healthy_verdict,
    job_step_times,
    judge_episode,
)


def _steps(times: dict[int, float], nodes: int = 4) -> dict[tuple[int, int], float]:
    return {(node, step): seconds for step, seconds in times.items() for node in range(nodes)}


def test_the_job_time_per_step_is_the_median_over_nodes() -> None:
    seen = {(0, 5): 0.1, (1, 5): 0.3, (2, 5): 0.2, (0, 6): 0.4}
    assert job_step_times(seen) == {5: 0.2, 6: 0.4}


def test_a_stall_at_the_onset_measures_as_the_jobs_slowdown() -> None:
    job = job_step_times(_steps({s: 0.1 if s < 200 else 0.25 for s in range(100, 260)}))
    assert judge_episode(job, 200) == pytest.approx(2.5)
    assert judge_episode(job, 150) == pytest.approx(1.0)  # nothing changed there


def test_too_few_steps_around_the_onset_cannot_be_judged() -> None:
    job = job_step_times(_steps(dict.fromkeys(range(190, 230), 0.1)))
    assert judge_episode(job, 200) is None  # 10 steps before it, 16 needed


def test_the_verdict_confirms_only_episodes_the_job_measured() -> None:
    assert healthy_verdict([], 1.5, 0) == "CLEAN"
    assert healthy_verdict([1.7, 1.54], 1.5, 4) == "REAL SLOWDOWNS ONLY"
    assert healthy_verdict([1.7, 1.2], 1.5, 4) == "FALSE ALARM"
    assert healthy_verdict([1.7, None], 1.5, 2) == "FALSE ALARM"
    assert healthy_verdict([], 1.5, 1) == "FALSE ALARM"  # a mitigation without an episode


def test_the_onset_is_read_from_the_operators_finding() -> None:
    line = (
        "[2026-11-26 06:41:39,640] resilientjob.operato [INFO    ] job default/demo-gpt: NodeSlow: node 4 "
        "is 1.98x slower (compute) than its baseline (0.124s/step) since step 2894; slow nodes [4]"
    )
    match = EPISODE_ONSET.search(line)
    assert match is not None and match.group(1) == "2894"
