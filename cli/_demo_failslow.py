"""The demo's fail-slow measurement: when the slowdown was ordered, when it took effect (the slowed worker's
first step that held chaos delay, `IterationRecord.chaos_s`), when the operator named the slow node
(`status.slowNodes`), when the mitigation's plan came, and the throughput before, during and after, so the
demo ends with the detection delay in iterations after the slowdown's onset and after the order, and the
share of the slowdown removed.

The detection's step is the one the operator recorded when it opened the episode (the NodeSlow recovery
row's `detectedStep`) once that row is there; until then, the step the demo saw when the status first named
the node, which lags by the status's update interval.

The slowdown is measured as Falcon measures it (section 6, "1.9x to 1.2x"): the job's step time against
the healthy one. The global batch is fixed, so a step time ratio is the inverse of the throughput ratio;
the share removed is (slowed - mitigated) / (slowed - 1) of those ratios. The share of the lost throughput
won back, (mitigated - slowed) / (healthy - slowed) of the rates, is smaller for a large slowdown (x3 on one
of six replicas with two micro-batches each: a perfect S2 halves the step, 75% of the slowdown, and wins
back 50% of the throughput) and is printed beside it."""

from __future__ import annotations

from dataclasses import dataclass

from ..planner.failslow import slowdown_removed

ONSET_S = 0.5
"""The slowed throughput counts from this long after the order (the worker polls its order every 0.25 s)."""
SETTLE_S = 2.0
"""The mitigated throughput counts from this long after the mitigation's plan (the workers' switch)."""
BASELINE_S = 10.0
"""The healthy throughput is measured over this long before the order."""
SHORTEST_S = 1.5
"""A window shorter than this gives no rate: a fast mitigation leaves little slowed time to measure."""


@dataclass(slots=True)
class FailSlowWatch:
    """Times (seconds since the demo started) and committed steps of the fail-slow episode."""

    node: int | None = None
    slowed_at: float | None = None
    slowed_step: int = 0
    onset_step: int | None = None
    """The slowed worker's first step at or after the order that held chaos delay: when it took effect."""
    detected_at: float | None = None
    detected_step: int = 0
    detected_exact: bool = False
    """Whether `detected_step` is the operator's own record of the episode's opening."""
    mitigated_at: float | None = None
    mitigated_step: int = 0
    strategy: str = ""
    generation: int | None = None
    """The generation that carried the mitigation."""

    def slowed(self, node: int, at: float, step: int) -> None:
        self.node, self.slowed_at, self.slowed_step = node, at, step

    def took_effect(self, node: int, step: int, chaos_s: float | None) -> None:
        """A step record of a worker: the first of the slowed worker's with chaos delay is the onset."""
        if self.slowed_at is None or self.onset_step is not None or node != self.node:
            return
        if chaos_s and step >= self.slowed_step:
            self.onset_step = step

    def detected(self, nodes: list[int], at: float, step: int) -> str | None:
        """The operator's status names slow nodes; the first time after the order that they include the
        slowed worker is the detection (another node named on a loaded host is not)."""
        if self.slowed_at is None or self.detected_at is not None or self.node not in nodes:
            return None
        self.detected_at, self.detected_step = at, step
        # When the demo saw it: the summary dates the detection by the operator's own record once it has it.
        after = step - self.slowed_step
        return f"fail-slow detected: nodes {nodes} (in the job's status {after} steps after the order)"

    def dated(self, recoveries: list[dict[str, object]], at: float) -> None:
        """Take the operator's step of the detection from the first NodeSlow recovery row for the slowed
        node after the order (`detectedStep`)."""
        if self.slowed_at is None or self.detected_exact:
            return
        for row in recoveries:
            step = row.get("detectedStep")
            nodes = row.get("nodes")
            if row.get("trigger") != "NodeSlow" or not isinstance(step, int) or step < self.slowed_step:
                continue
            if isinstance(nodes, list) and self.node in nodes:
                if self.detected_at is None:
                    self.detected_at = at
                self.detected_step, self.detected_exact = step, True
                return

    def mitigated(self, strategy: str, at: float, step: int = 0, generation: int | None = None) -> None:
        if self.slowed_at is not None and self.mitigated_at is None and strategy and strategy != "restore":
            self.mitigated_at, self.strategy = at, strategy
            self.mitigated_step, self.generation = step, generation

    def since_order(self, at: float) -> float | None:
        """Seconds from the order to `at` (None before the order)."""
        return None if self.slowed_at is None else at - self.slowed_at

    def live(self, samples: list[tuple[float, int]], now: float) -> str:
        """One line for the live table: the order, the detection, the mitigation and the throughput before
        the order, while slowed and since the mitigation (each counted from the steps
        in its window: `_rate`)."""
        if self.slowed_at is None:
            return "fail-slow: none ordered yet"
        order = self.slowed_at
        parts = [f"fail-slow: worker {self.node} slowed at +{order:.0f}s"]
        if self.detected_at is None:
            parts.append("not detected yet")
        else:
            parts.append(f"detected after {self.detected_step - self.slowed_step} steps")
        if self.mitigated_at is not None:
            parts.append(f"{self.strategy} at +{self.mitigated_at - order:.1f}s")
        healthy = _rate(samples, order - BASELINE_S, order)
        slow_end = self.mitigated_at if self.mitigated_at is not None else now
        slowed = _rate(samples, order + ONSET_S, slow_end)
        after = None if self.mitigated_at is None else _rate(samples, self.mitigated_at + SETTLE_S, now)
        rates = [
            f"{name} {value:.0f}"
            for name, value in (("healthy", healthy), ("slowed", slowed), ("mitigated", after))
            if value is not None
        ]
        if rates:
            parts.append(" / ".join(rates) + " samples/s")
        return "; ".join(parts)

    def summary(self, samples: list[tuple[float, int]], end: float) -> str:
        """One line: detection delay and the share of the throughput loss the mitigation won back."""
        if self.slowed_at is None:
            return "fail-slow: no slowdown was injected"

        def rate(begin: float, finish: float) -> float | None:
            return _rate(samples, begin, finish)

        order = self.slowed_at
        healthy = rate(order - BASELINE_S, order)
        slow_end = self.mitigated_at if self.mitigated_at is not None else end
        slowed = rate(order + ONSET_S, slow_end)
        after = rate(self.mitigated_at + SETTLE_S, end) if self.mitigated_at is not None else None
        parts = [f"fail-slow on worker {self.node}:"]
        if self.detected_at is None:
            parts.append("not detected")
        else:
            after_order = (
                f"{self.detected_step - self.slowed_step} iterations ({self.detected_at - order:.1f}s) after "
                "the order;"
            )
            if self.onset_step is None:
                parts.append(f"detected {after_order}")
            else:
                parts.append(
                    f"in effect from step {self.onset_step} ({self.onset_step - self.slowed_step} after the "
                    f"order); detected {self.detected_step - self.onset_step} iterations after its onset, "
                    f"{after_order}"
                )
        if self.mitigated_at is not None:
            parts.append(
                f"{self.strategy} at +{self.mitigated_at - order:.1f}s "
                f"({self.mitigated_step - self.slowed_step} iterations after the order);"
            )
        if healthy is not None and slowed is not None:
            parts.append(f"throughput {healthy:.0f} healthy, {slowed:.0f} slowed")
            if after is not None:
                parts.append(f", {after:.0f} mitigated samples/s")
                shares = slowdown_removed(healthy, slowed, after)
                if shares is not None:
                    step_time, won_back = shares
                    parts.append(
                        f": step time {healthy / slowed:.2f}x -> {healthy / after:.2f}x of healthy, "
                        f"{100 * step_time:.0f}% of the slowdown removed "
                        f"({100 * won_back:.0f}% of the lost throughput won back)"
                    )
            else:
                parts.append("samples/s, no mitigation")
        elif healthy is not None and self.mitigated_at is not None and slowed is None:
            parts.append(
                f"throughput {healthy:.0f} healthy samples/s; the mitigation came too soon after the order "
                f"to measure the slowed rate (under {SHORTEST_S:g} s)"
            )
        return " ".join(parts).replace(" ,", ",").replace(" :", ":")


def _rate(samples: list[tuple[float, int]], begin: float, finish: float) -> float | None:
    """Samples the workers reported as trained in [begin, finish), per second; None for a window under
    `SHORTEST_S` or with no step in it. Counted from the steps themselves, not from the live table's 2 s
    sliding rate, whose window would straddle the order or the mitigation."""
    if finish - begin < SHORTEST_S:
        return None
    counted = [count for at, count in samples if begin <= at < finish]
    return sum(counted) / (finish - begin) if counted else None
