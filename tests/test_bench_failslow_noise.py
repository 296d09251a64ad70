"""bench/bench_failslow_noise.py drives the agents' real detector and the operator's real tracker: on 30%
noise (the local stack's GPT on two cores) the agents report, noise decides some reports' first short
windows, and the second windows undo every one: no episode."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_failslow_noise import episodes  # a script, not a package


def test_agents_reports_on_noise_open_no_episode_on_short_windows() -> None:
    opened, decided = episodes(noise=0.3, seed=0, steps=3000, threshold=1.2)
    assert decided > 0  # the short windows were tried: noise decided first windows
    assert opened == 0
