"""Write planner/sim/traces/spot.csv: a synthetic spot-instance availability trace (deterministic).

Shaped like the EC2/GCP traces Oobleck replays (section 7.3): 32 single-GPU nodes for 12 hours, preemption
attempts every 7 minutes on average (exponential gaps), skipped while only 8 nodes are up, which leaves about
one preemption every 8.5 minutes (EC2 P3: 7.7 min, GCP a2: 10.3 min); each preempted node returns after an
exponential delay with a mean of 40 minutes.
Run: .venv/bin/python scripts/gen_spot_trace.py
"""

from __future__ import annotations

import heapq
from pathlib import Path

import numpy as np

NODES = 32
HOURS = 12.0
MEAN_PREEMPTION_GAP_S = 420.0
MEAN_DOWNTIME_S = 2400.0
MIN_UP = 8
SEED = 20240607
OUT = Path(__file__).resolve().parent.parent / "planner" / "sim" / "traces" / "spot.csv"


def generate(seed: int = SEED) -> list[tuple[float, int, str]]:
    rng = np.random.default_rng(seed)
    horizon = HOURS * 3600.0
    up = set(range(NODES))
    returns: list[tuple[float, int]] = []
    rows: list[tuple[float, int, str]] = []
    clock = 0.0
    while True:
        clock += float(rng.exponential(MEAN_PREEMPTION_GAP_S))
        if clock >= horizon:
            break
        while returns and returns[0][0] <= clock:
            when, node = heapq.heappop(returns)
            up.add(node)
            rows.append((when, node, "up"))
        if len(up) <= MIN_UP:
            continue
        node = sorted(up)[int(rng.integers(len(up)))]
        up.discard(node)
        rows.append((clock, node, "down"))
        back = clock + float(rng.exponential(MEAN_DOWNTIME_S))
        if back < horizon:
            heapq.heappush(returns, (back, node))
    while returns:
        when, node = heapq.heappop(returns)
        rows.append((when, node, "up"))
    return sorted(rows)


def main() -> None:
    rows = generate()
    lines = ["time_s,node,state"] + [f"{t:.1f},{node},{state}" for t, node, state in rows]
    OUT.write_text("\n".join(lines) + "\n")
    downs = sum(1 for _, _, state in rows if state == "down")
    print(f"wrote {OUT} ({downs} preemptions, one every {HOURS * 60 / max(downs, 1):.1f} min on average)")


if __name__ == "__main__":
    main()
