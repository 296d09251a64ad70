"""What a fail-slow episode's validation pass asks and what its answer is worth (Falcon 4.3), pure.

A communication report says that a worker waits, not what it waits for. A validation pass (the agents'
`validation`) then times each suspect's GEMM and each suspect link. These functions say when a report is
worth a pass (`communication_holds`), pick the suspects, turn a pass's result into findings, and check the
devices it names against the job-wide compute rule: one GEMM timing on a shared host can name a healthy
device. `FailSlowTracker` keeps the episode and applies them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from statistics import median
from typing import TypeVar

from resilientjob.protocol.messages import ProfileRecord, SlowKind, SlowReport, ValidationResult

from ._failslow_job import EXPLAINED, NOISE_Z, slowdown_bar
from ._failslow_types import Candidate, Finding, FindingKind, Link
from ._straggler import MIN_WINDOW, StragglerGate, beyond_noise, communication_suspects, relative_spread

Key = TypeVar("Key", int, Link)


def communication_holds(
    report: SlowReport, walls: Sequence[tuple[int, float]], threshold: float
) -> bool | None:
    """Whether a communication report's slowdown stands on the reporter's own steps (`walls`: its kept
    (step, wall seconds), oldest first), as the job-level trigger's must on the job's: the median wall since
    the onset at least `slowdown_bar` times the median before it, and beyond what the
    steps' own noise before the onset takes a median of that many steps to (`NOISE_Z` standard errors).
    False once the median is under that bar: the slowdown is over, or was the noise of a moment; None while
    it is over the bar but too few steps are in to clear the noise (or fewer than `MIN_WINDOW`).

    An agent's detector verifies a change on its own steps, but the steps of a shared host rise together
    for a moment now and then: in 10 minutes of a healthy demo job at threshold 1.2 on a slow two-core host,
    every agent's step-time reports (1.25-1.3x) asked for 27 passes, each holding training ~0.5 s, and one
    pass timed a link 4x the median twice and opened an episode on it. With none of the node's steps kept,
    or too few before the onset to measure their noise, the agent's verification stands (True)."""
    if not walls:
        return True  # none of its steps kept (an operator just restarted): the agent's verification stands
    rise = _wall_rise(report, walls)
    if rise is None:
        return None
    ratio, noise, steps = rise
    if ratio < slowdown_bar(threshold):
        return False
    if noise is None:
        return True
    return True if beyond_noise(ratio, noise, steps, NOISE_Z) else None


def _wall_rise(
    report: SlowReport, walls: Sequence[tuple[int, float]]
) -> tuple[float, float | None, int] | None:
    """The reporter's median wall since the onset over its median before (the report's baseline where too
    few steps before are kept to measure their noise), that noise, and the steps since; None with fewer
    than `MIN_WINDOW` since."""
    before = [seconds for step, seconds in walls if step < report.onset_step]
    after = [seconds for step, seconds in walls if step >= report.onset_step]
    if len(after) < MIN_WINDOW:
        return None
    noise = relative_spread(before)
    level = median(before) if noise is not None else report.baseline_s
    if not level > 0:
        return None
    return median(after) / level, noise, len(after)


def compute_explains(
    report: SlowReport, walls: Sequence[tuple[int, float]], compute_rise: float | None
) -> str | None:
    """How the nodes' own compute rose with a communication report's steps, when it explains the rise, or
    None: `compute_rise` (their median over the same steps, `JobStepTrigger.compute_rise`) at least
    `EXPLAINED` of the reporter's wall rise, in ratio (a host's load slows the work and the waits alike).
    A slow link lengthens the waits, not the work, and a slow device the work of one node; a host that
    slows every worker lengthens both, and an agent whose own compute happened to rise less than its
    detector's 25% reports the blip as a wait: in 20 healthy minutes of the demo job at threshold 1.2 on
    two cores, 9 such reports (every node's compute up a median 1.2-1.5x for a few steps) met a pass that
    timed some link slow by chance, and opened episodes. Such a report is dismissed (`FailSlowTracker.tick`);
    a slow link that came with a blip and lasts is the job-level trigger's (`_failslow_job`): the job's step
    stays slower once the work is back at its level."""
    rise = _wall_rise(report, walls) if walls else None
    if rise is None or compute_rise is None:
        return None
    ratio = rise[0]
    if ratio <= 1.0 or compute_rise < 1.0 + EXPLAINED * (ratio - 1.0):
        return None
    return (
        f"its step time since step {report.onset_step} rose {ratio:.2f}x and the nodes' compute with it "
        f"({compute_rise:.2f}x, their median)"
    )


def suspects(waiting: Sequence[int], profiles: Mapping[int, ProfileRecord]) -> list[int] | None:
    """The nodes to test: the communication candidates ready for a pass (`waiting`), and the nodes of the
    groups the agents' profiles flag. None when no candidate is ready."""
    if not waiting:
        return None
    found = set(waiting)
    for nodes in communication_suspects(profiles).values():
        found.update(nodes)
    return sorted(found)


def named_by(result: ValidationResult) -> tuple[list[Link], list[int], list[Finding]]:
    """The slow links (sender, receiver) and slow devices a pass named, and a finding for each kind."""
    links = sorted({(a, b) for a, b in result.slow_links if a != b})
    devices = sorted(set(result.slow_nodes))
    held = f"validation at step {result.step} (training held {result.held_s:.2f}s)"
    findings = []
    if links:
        ends = tuple(sorted({n for link in links for n in link}))
        named = ", ".join(f"{a}->{b}" for a, b in links)
        timed = {(timing.src, timing.dst): timing.seconds for timing in result.links}
        named += _ratios(timed, links, "transfer")
        findings.append(
            Finding(FindingKind.SLOW_LINK, ends, f"{held} found slow links {named}", tuple(links))
        )
    if devices:
        ratios = _ratios(result.gemm_s, devices, "GEMM")
        findings.append(
            Finding(
                FindingKind.SLOW_DEVICE,
                tuple(devices),
                f"{held} found slow devices on nodes {devices}{ratios}",
            )
        )
    return links, devices, findings


def corroborated(
    reporter: int, candidate: Candidate, links: set[Link], gate: StragglerGate, threshold: float
) -> tuple[tuple[int, ...], set[int], Finding | None]:
    """The nodes a validated communication episode takes in, which of them are slow devices, and the
    finding for devices left out. Validation's GEMM is one timing on a shared host and can name a device by
    accident; the job-wide compute rule (the device's compute since the report's onset) must agree:
    - a device that the rule finds not slow is left out. Taken in, it gets the episode's S2, which moves
      work off a healthy node: in `rjob demo` GEMM named nodes 1 (1.38x) and 6 (1.90x) beside the x3
      worker and S2 removed 38% of the slowdown; beside a slow link, the link stayed slow (7%);
    - a link's end is a slow device only when the rule finds its compute slow. Counted on GEMM alone,
      the link episode of the mixed bench became a compute one and S2 came before S3.
    A device the rule cannot judge (too few steps) is taken on validation's word; the tracker first waits,
    within the candidate's time to live, for the rule to have the steps (`unjudged`)."""
    named = candidate.validated
    if candidate.report.kind is not SlowKind.COMMUNICATION or not named:
        return named or (), set(), None
    ends = {n for link in links for n in link}
    devices = set(candidate.devices) & set(named)
    verdicts = gate.judge(dict.fromkeys(devices, candidate.report.onset_step))
    unconfirmed = sorted(n for n in devices if n not in ends and verdicts.get(n) is False)
    finding = None
    if unconfirmed:
        stands = "; the slow link stands" if ends & set(named) else ""
        finding = Finding(
            FindingKind.DISMISSED,
            tuple(unconfirmed),
            f"node {reporter}: slow devices on nodes {unconfirmed} named by validation alone: their "
            f"compute is within {threshold}x of the other nodes'{stands}",
        )
    slow = {n for n in devices if n not in unconfirmed and (n not in ends or verdicts.get(n))}
    return tuple(n for n in named if n not in unconfirmed), slow, finding


def unjudged(candidate: Candidate, links: set[Link], gate: StragglerGate) -> list[int]:
    """Devices validation named for a communication candidate, link ends aside, that the job-wide rule
    cannot judge yet (too few steps since the report's onset: a new generation clears the levels).
    `corroborated` would take them on validation's word alone, one GEMM timing. In `rjob demo` a pass named
    node 4 at 1.14x, the rule found it not slow, a worker was killed the next second, and the same pass's
    names opened an episode on node 4 for another waiting report: the kill had left no steps to judge."""
    ends = {n for link in links for n in link}
    devices = [n for n in candidate.devices if n not in ends]
    if not devices:
        return []
    verdicts = gate.judge(dict.fromkeys(devices, candidate.report.onset_step))
    return [n for n in devices if verdicts.get(n) is None]


def _ratios(seconds: Mapping[Key, float], named: list[Key], what: str) -> str:
    """How far each named device or link timed above the pass's median, for the finding."""
    if not seconds:
        return ""
    middle = median(seconds.values())
    if middle <= 0:
        return ""
    parts = [f"{_label(key)}: {seconds[key] / middle:.2f}x" for key in named if key in seconds]
    return f" ({what} vs median: {', '.join(parts)})" if parts else ""


def _label(key: int | Link) -> str:
    return f"{key[0]}->{key[1]}" if isinstance(key, tuple) else str(key)
