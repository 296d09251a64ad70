"""When a compute candidate has persisted long enough in steps to open an episode (Falcon's minimum
duration, counted in steps beside the spec's time), pure: no I/O.

A compute report is a candidate until the job-wide rule (`_straggler`) has found its node slow on two
disjoint windows of steps, so that two independent medians agree and one noisy window on a loaded machine
opens nothing:
- two **level windows**, each sized from the job's noise so that a healthy node's median stays 2.5
  standard errors under the threshold; the first from the report's onset when the steps kept still bear it
  out (`first_window_end`), else the one that ends when the node was first found slow;
- or two **shorter windows** that each decide the node alone (`decided_early`), where it stands far
  enough above its peers for the same certainty in fewer steps.

`FailSlowTracker.tick` asks `persisted` on every pass while the rule keeps finding the node slow; the
spec's `min_duration_s` is checked there, in time.
"""

from __future__ import annotations

from ._failslow_types import Candidate
from ._straggler import MIN_WINDOW, StragglerGate


def first_window_end(gate: StragglerGate, node: int, onset: int, latest: int) -> int:
    """The last step of the first level window that found `node` slow: the window from its onset when the
    steps kept still judge it a straggler there, else the one that ends now. A report read some steps after
    its onset (the agent's detector needs five, the pass comes after) has its first window behind it
    already, and the second, independent one can follow it at once instead of starting now: one window
    sooner (the demo's episodes came 11 iterations after the onset)."""
    end = onset + gate.window - 1
    if end < latest and gate.straggler_then(node, onset, end):
        return end
    return latest


def persisted(gate: StragglerGate, candidate: Candidate, latest: int, min_duration_s: float) -> bool:
    """Whether a compute candidate has persisted in steps: the level window has turned over once since
    the first one found the node slow (`candidate.confirmed_step`), or two short windows each decided it
    (`decided_early`). With `min_duration_s` 0, at once. May update `candidate.decisive_steps`."""
    if min_duration_s <= 0 or latest - candidate.confirmed_step >= gate.window:
        return True
    return decided_early(gate, candidate, latest)


def decided_early(gate: StragglerGate, candidate: Candidate, latest: int) -> bool:
    """Two disjoint windows of a report's steps, shorter than two level windows, that each find the node a
    straggler as surely as a full window finds one at the threshold (`StragglerGate.decisive`). The level
    window is sized so that noise keeps a healthy node under the threshold; a node far above it needs fewer
    steps for the same certainty (the demo's worker ordered 2x ran 1.5-1.7x its peers, and on two cores the
    1.2 threshold's window was 26 steps: two of them took 32-54 iterations).
    - The first runs from the onset: the first that decides it as the steps come.
    - The second starts after the report's step (the steps the agent's detector chose the onset by are
      biased toward a rise) and is as long, and at least half a level window: a stall shorter than that,
      which a full window's median shrugs off, cannot fill it. Every check while it grows must find the
      node slow (as the full windows' must), and it must decide at its end; else the full level windows
      confirm the node (`candidate.decisive_steps` -1).
    The operator's sweep has no onset, and judges on full windows only."""
    if candidate.swept or candidate.decisive_steps < 0:
        return False
    report = candidate.report
    node, onset = report.node, report.onset_step
    if candidate.decisive_steps == 0:
        # The window from the onset to the newest step, checked as the steps come: the first that decides
        # it is the shortest (one judgement per pass; a full window confirms as before).
        steps = latest - onset + 1
        if not MIN_WINDOW <= steps < gate.window or not gate.decisive(node, onset, latest):
            return False
        candidate.decisive_steps = steps
    first = max(onset + candidate.decisive_steps, report.step + 1)
    last = first + max(candidate.decisive_steps, gate.window // 2) - 1
    if latest < last:
        if gate.straggler_then(node, first, latest) is not False:
            return False  # every check of the second window so far finds it slow, or has too few steps
    elif gate.decisive(node, first, last):
        return True
    candidate.decisive_steps = -1
    return False
