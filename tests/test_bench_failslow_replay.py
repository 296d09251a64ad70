"""The offline replay of recorded fail-slow runs (bench/bench_failslow_replay.py) drives the operator's real
detection: a recorded straggler opens an episode on it, noise alone opens none, and a shorter window opens
it sooner."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_failslow_replay import empirical_shares, first_generation, replay  # a script, not a package

from resilientjob.operator.api import FailSlowSpec


def _trace(
    steps: int, slow_from: int | None, factor: float, noise: float, seed: int = 1
) -> list[list[float]]:
    """Rows as bench_failslow_e2e.py writes them: node, generation, step, seconds, compute_s, sent_at."""
    rng = random.Random(seed)
    rows: list[list[float]] = []
    for step in range(steps):
        for node in range(8):
            slow = factor if slow_from is not None and step >= slow_from and node == 5 else 1.0
            compute = 0.1 * slow * max(0.2, 1 + rng.gauss(0, noise))
            rows.append([node, 0, step, compute + 0.02, compute, 1000.0 + step * 0.2 + node * 1e-3])
    rows.append([0, 1, steps, 0.5, 0.5, 1000.0 + steps * 0.2])  # a later generation: left out
    return rows


def test_a_recorded_straggler_opens_an_episode_and_noise_alone_none() -> None:
    spec = FailSlowSpec(slowdown_threshold=1.2, min_duration_s=1.0)
    slowed = first_generation(_trace(300, 200, 1.3, 0.03))
    assert {record.generation for record in slowed} == {0} and len(slowed) == 300 * 8
    shares = empirical_shares(slowed, 100)
    assert set(shares) == set(range(8)) and all(0.9 < share < 1.1 for share in shares.values())
    sized = replay(slowed, [], spec, 0, shares)
    fixed = replay(slowed, [], spec, 16, shares)
    # The replay starts over after each episode, and the straggler is still there: it opens again.
    assert {o.nodes for o in sized} == {(5,)} == {o.nodes for o in fixed}
    assert 200 < sized[0].step <= 210 < fixed[0].step, (sized, fixed)  # the quiet job's window is short
    healthy = first_generation(_trace(600, None, 1.0, 0.3, seed=2))
    assert replay(healthy, [], spec, 0, empirical_shares(healthy, 100)) == []
