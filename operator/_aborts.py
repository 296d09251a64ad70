"""A world that stopped with every node alive, and what the operator does about it.

Workers abandon a step when a collective or a receive fails (`agent.worker`: any RuntimeError of a step),
or the switch to a generation when its rendezvous or a layer copy fails (`WorkerAbort.switching`), and
wait for the next generation. After a death that generation comes from the fail-stop path, which fences
the dead node within the heartbeat TTL. But a communication error with no death behind it (a reset
connection, a link that flapped) or a peer that hangs while its agent beats on (a stuck kernel, a
deadlock) fences nobody: no failure detector publishes the generation the workers wait for, they wait out
their plan timeout (120 s in a pod), exit, and the job loses every node at once. The agents therefore report
each abandoned step (`WorkerAbort`, the job's `aborts` hash), and this module judges what they say:

- Every node of the world aborted and none died within `REFORM_GRACE_S`: a transient fault. The world
  re-forms: the same layout as the next generation (`_store.rendezvous_again`), the abandoned step trained
  again, nothing copied, or after a failed switch the copies it left unfinished (`copies_to_carry`).
- Some nodes aborted and the others neither aborted nor committed a step for `hang_after_s` (twice the
  longest collective timeout the aborts name, plus the grace: a peer blocked further up a pipeline aborts
  within one timeout of its own): those hang. They are fenced as failed (`NodeHung`) and planned around,
  and their pods deleted, which ends the hung processes too.

The grace first: the usual abort follows a death (the survivors of a killed pod abandon their step), and
the fail-stop path, not a re-formation, must answer it. A dead node reports no abort, so a world whose every
node did is alive; it waits only `REFORM_GRACE_S`, for a pod that failed just after its abort to show. With
the peers' abandon notice (`agent._runtime_wait`) every node aborts within a look of the first, and that
short grace is what a broken collective costs. A world that re-formed and aborted again before it
committed a step is re-formed at most `MAX_REFORMS` times in a row; then the workers' plan timeout takes
over, as before this existed, and an Event says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from resilientjob.planner.plan import Plan, Transfer
from resilientjob.protocol.keys import HEARTBEAT_TTL_S
from resilientjob.protocol.messages import WorkerAbort

ABORT_GRACE_S = 1.5 * HEARTBEAT_TTL_S
"""How long after the first abort of a generation the fail-stop path has to explain it (a dead node is
fenced within the heartbeat TTL, a deleted pod at once) before the aborts are judged on their own."""

REFORM_GRACE_S = 0.5
"""How long after its last node reported a world whose every node reported waits before it re-forms, the
first time in a row: a pod deleted meanwhile shows in the pod watch within it. A node that reports its abort
and then dies (a device fault after the step failed) may show later (a Failed pod takes the kubelet's status
report, a lost machine the heartbeat TTL): the re-formed generation is then replaced by the fail-stop path's,
one wasted generation. The re-formations after it in a row wait `ABORT_GRACE_S`, so that a link that flaps
for seconds does not spend `MAX_REFORMS` in a few."""

MAX_REFORMS = 3
"""Re-formations in a row without a committed step between them, after which the operator stops."""


def hang_after_s(aborts: Mapping[int, WorkerAbort]) -> float:
    """How long after the first abort a node of the world that neither aborted nor stepped is taken for
    hung: a peer blocked behind another blocked peer aborts within one collective timeout of its own. At
    most half the shortest plan timeout the aborts name: the nodes that aborted must still be waiting for
    the generation that leaves the hung ones out (a collective timeout that long is the user's choice)."""
    timeouts = 2.0 * max(abort.collective_timeout_s for abort in aborts.values()) + ABORT_GRACE_S
    return min(timeouts, 0.5 * min(abort.plan_timeout_s for abort in aborts.values()))


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do about a generation's aborts (at most one of the two)."""

    reform: bool = False
    """Every node aborted: publish the same layout as the next generation."""
    hung: tuple[int, ...] = ()
    """Nodes to fence as hung."""


def judge(
    world: frozenset[int],
    aborts: Mapping[int, WorkerAbort],
    waited_s: float,
    settled_s: float | None = None,
    reform_grace_s: float = REFORM_GRACE_S,
) -> Verdict | None:
    """The verdict on a generation whose `world` (its plan's nodes) reported `aborts`, `waited_s` after
    the first was seen and `settled_s` after the last new one (default: `waited_s`); None while it is too
    early to tell (or nothing to judge). Every node reported: re-form once `reform_grace_s` has passed since
    the last report."""
    reported = set(aborts) & world
    if not reported:
        return None
    if reported == world:
        settled = waited_s if settled_s is None else settled_s
        return Verdict(reform=True) if settled >= reform_grace_s else None
    if waited_s < ABORT_GRACE_S or waited_s < hang_after_s(aborts):
        return None
    return Verdict(hung=tuple(sorted(world - reported)))


def switch_failed(aborts: Mapping[int, WorkerAbort]) -> bool:
    """Whether a node failed in the switch to the aborts' generation (`WorkerAbort.switching`), not only in
    a step after it: its layer copies, or its checkpoint restart, may be unfinished."""
    return any(abort.switching for abort in aborts.values())


def copies_to_carry(plan: Plan, aborts: Mapping[int, WorkerAbort]) -> tuple[Transfer, ...]:
    """The layer copies of `plan` that the re-formed generation carries again. None when every node
    abandoned a step: each got past the copies, and a node that only sent layers may have left. After a
    failed switch, all of them: the workers agree which ones completed before they move a layer
    (`agent.p2p.switch_copies`), and no source drops a layer before every receiver holds its own, so every
    sender of a copy still to make is still there, waiting for the next generation like the others."""
    return plan.transfers if switch_failed(aborts) else ()


def summary(aborts: Mapping[int, WorkerAbort]) -> str:
    """One clause for the Event and the decision: the step (or the switch), who aborted, and the error of
    the node that aborted first (the others' usually say only that it stopped answering)."""
    first = min(aborts.values(), key=lambda abort: (abort.at, abort.node))
    what = f"the switch to generation {first.generation}" if switch_failed(aborts) else f"step {first.step}"
    return f"nodes {sorted(aborts)} abandoned {what} (first node {first.node}: {first.error})"


@dataclass(slots=True)
class AbortWatch:
    """One job's aborts across passes: when the current generation's were first seen, and the re-formations
    in a row that no committed step has followed yet."""

    generation: int = -1
    first_seen: float | None = None
    """Monotonic time the first abort of `generation` was seen; None: none yet."""
    last_new: float = 0.0
    """Monotonic time a node of the world was first seen among `generation`'s aborts, the latest such."""
    seen: frozenset[int] = frozenset()
    """The world's nodes seen among `generation`'s aborts so far."""
    reforms: int = 0
    reformed: int = -1
    """The generation the latest re-formation published."""
    gave_up: int = -1
    """The generation the watch stopped re-forming at (said once)."""

    def observe(
        self, generation: int, world: frozenset[int], aborts: Mapping[int, WorkerAbort], now: float
    ) -> Verdict | None:
        """The verdict on `generation`'s aborts now (`judge`); the first call with aborts starts the clock."""
        if generation != self.generation:
            self.generation, self.first_seen, self.seen = generation, None, frozenset()
        reported = frozenset(aborts) & world
        if not reported:
            return None
        if self.first_seen is None:
            self.first_seen = now
        if reported - self.seen:  # always on the first call of a generation with aborts
            self.seen, self.last_new = self.seen | reported, now
        # The first re-formation in a row is quick; the next ones wait as long as any verdict did before.
        grace = REFORM_GRACE_S if self.reforms == 0 else ABORT_GRACE_S
        return judge(world, aborts, now - self.first_seen, now - self.last_new, grace)

    def stepped(self, generation: int) -> None:
        """A step committed under `generation`: a re-formed world that trains again ends the run of them."""
        if generation >= self.reformed:
            self.reforms = 0

    def waited_s(self, now: float) -> float:
        """Seconds since the current generation's first abort was seen (0 before)."""
        return 0.0 if self.first_seen is None else now - self.first_seen

    def may_reform(self) -> bool:
        return self.reforms < MAX_REFORMS

    def reforming(self, generation: int) -> None:
        """A re-formation publishes `generation`."""
        self.reforms += 1
        self.reformed = generation
