"""PNG plots of simulation results (matplotlib, imported inside the functions so the simulator core and the
rest of the planner never load it): throughput and active devices over time per policy, like Odyssey's
Figs. 7-8, and bar charts of average throughput."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ._model import PolicyResult

_COLOURS = {
    "adaptive": "#d62728",
    "templates": "#1f77b4",
    "reroute": "#2ca02c",
    "checkpoint": "#9467bd",
    "redundant": "#8c564b",
    "dynamic": "#ff7f0e",
    "oracle": "#7f7f7f",
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, figure: Any, path: str | Path) -> Path:
    """Lay out, write the PNG (creating its folder) and free the figure."""
    figure.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=110)
    plt.close(figure)
    return target


def _steps(result: PolicyResult, column: int) -> tuple[list[float], list[float]]:
    hours = [entry[0] / 3600.0 for entry in result.timeline] + [result.hours]
    values = [float(entry[column]) for entry in result.timeline]
    if column == 2:
        values = [value * result.gpus_per_node for value in values]
    return hours, values + values[-1:]


def windowed_throughput(result: PolicyResult, bins: int = 180) -> tuple[list[float], list[float]]:
    """Average throughput over `bins` equal windows (hours at window centres, samples/s): pauses of seconds
    show as dips instead of hairlines, as in Oobleck's Fig. 10."""
    horizon = result.hours * 3600.0
    width = horizon / bins
    edges = [entry[0] for entry in result.timeline] + [horizon]
    centres: list[float] = []
    averages: list[float] = []
    segment = 0
    for index in range(bins):
        low, high = index * width, (index + 1) * width
        total = 0.0
        while segment + 1 < len(edges) and edges[segment + 1] <= low:
            segment += 1
        probe = segment
        while probe < len(result.timeline) and edges[probe] < high:
            overlap = min(high, edges[probe + 1]) - max(low, edges[probe])
            total += max(overlap, 0.0) * result.timeline[probe][1]
            probe += 1
        centres.append((low + high) / 2 / 3600.0)
        averages.append(total / width)
    return centres, averages


def cumulative_samples(result: PolicyResult) -> tuple[list[float], list[float]]:
    """Samples kept over time (hours, samples): throughput integrated, minus work lost at each recovery
    (the roll-backs a throughput curve cannot show)."""
    horizon = result.hours * 3600.0
    times = sorted(
        {entry[0] for entry in result.timeline} | {r.time_s for r in result.recoveries} | {horizon}
    )
    losses = sorted((r.time_s, r.lost_samples) for r in result.recoveries)
    hours: list[float] = []
    kept: list[float] = []
    total = 0.0
    segment = 0
    lost_index = 0
    previous = 0.0
    for moment in times:
        while segment + 1 < len(result.timeline) and result.timeline[segment + 1][0] <= previous:
            segment += 1
        total += (moment - previous) * result.timeline[segment][1]
        while lost_index < len(losses) and losses[lost_index][0] <= moment:
            total -= losses[lost_index][1]
            lost_index += 1
        hours.append(moment / 3600.0)
        kept.append(total)
        previous = moment
    return hours, kept


def plot_timelines(results: Mapping[str, PolicyResult], path: str | Path, title: str) -> Path:
    """Three panels: training throughput (windowed averages), samples kept and active devices over time,
    one line per policy; lines drawn thinner in turn so that policies on top of each other stay visible."""
    plt = _pyplot()
    figure, (top, middle, bottom) = plt.subplots(3, 1, figsize=(9, 8.5), sharex=True)
    count = max(len(results), 1)
    for order, (name, result) in enumerate(results.items()):
        if not result.timeline:
            continue
        colour = _COLOURS.get(name)
        width = 1.0 + 2.0 * (count - order) / count
        hours, throughput = windowed_throughput(result)
        top.plot(hours, throughput, label=f"{name} (avg {result.avg_throughput:.2f})", color=colour, lw=width)
        hours, kept = cumulative_samples(result)
        middle.plot(hours, kept, color=colour, lw=width)
        hours, devices = _steps(result, 2)
        bottom.step(hours, devices, where="post", label=name, color=colour, lw=width)
    top.set_ylabel("throughput (samples/s, windowed)")
    middle.set_ylabel("samples kept")
    top.set_title(title)
    top.legend(loc="upper right", fontsize=8)
    bottom.set_ylabel("active devices")
    bottom.set_xlabel("time (hours)")
    return _save(plt, figure, path)


def plot_bars(
    means: Mapping[str, float],
    path: str | Path,
    title: str,
    errors: Mapping[str, float] | None = None,
    ylabel: str = "average throughput (samples/s)",
) -> Path:
    """One bar per policy (with an error bar when given)."""
    plt = _pyplot()
    names: Sequence[str] = list(means)
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.bar(
        names,
        [means[name] for name in names],
        yerr=[errors.get(name, 0.0) for name in names] if errors else None,
        color=[_COLOURS.get(name, "#444444") for name in names],
        capsize=4,
    )
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    return _save(plt, figure, path)


def plot_grouped(
    groups: Mapping[str, Mapping[str, float]], path: str | Path, title: str, ylabel: str
) -> Path:
    """Grouped bars: one group per scenario (e.g. failure interval), one bar per policy."""
    plt = _pyplot()
    group_names = list(groups)
    policies: list[str] = []
    for values in groups.values():
        policies += [name for name in values if name not in policies]
    figure, axes = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(policies), 1)
    for index, policy in enumerate(policies):
        xs = [g + index * width for g in range(len(group_names))]
        ys = [groups[group].get(policy, 0.0) for group in group_names]
        axes.bar(xs, ys, width=width, label=policy, color=_COLOURS.get(policy))
    axes.set_xticks([g + 0.4 - width / 2 for g in range(len(group_names))], group_names)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.legend(fontsize=8)
    return _save(plt, figure, path)
