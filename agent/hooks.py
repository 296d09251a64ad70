"""What a worker's training loop lets an observer do around it, without patching the `Trainer`: the pod's
probe (`_bridge`: tracing, chaos, telemetry lines, validation passes) and the test harness's crashes
(`resilientjob.testing.faults.CrashAt`) plug in here, the runtime stays as it is, and a plain `Trainer` runs
with the no-op hooks.

Every hook runs in the worker process, on its training thread, at a point where nothing is in flight: a hook
that blocks holds training (which is what a validation pass wants), and one that raises fails the step."""

from __future__ import annotations

from torch._C._distributed_c10d import Store

from resilientjob.planner.plan import Plan


class StepHooks:
    """No-op hooks; override what you need."""

    def on_plan(self, plan: Plan) -> None:
        """A plan is about to be applied: before its world is joined and its layers are copied."""

    def on_applied(self, generation: int, rendezvous_s: float, copy_s: float, copied_bytes: int) -> None:
        """This node switched to `generation`: how long its rendezvous and its layer copies took, and the
        bytes it received (called by the node's first device only)."""

    def before_step(self, store: Store | None, generation: int, step: int, world_rank: int | None) -> None:
        """Step `step` of `generation` is about to run (an iteration boundary); `world_rank` None: this
        node has no part in the current plan."""

    def after_step(self, plan: Plan | None, generation: int, step: int, loss: float, samples: int) -> None:
        """A step committed: `step` is the number of committed steps now, `samples` how many samples'
        losses this node computed in it. Not called for an abandoned step."""

    def on_abort(self, generation: int, step: int, error: str, switching: bool = False) -> None:
        """Step `step` of `generation` (numbered as `after_step` numbers it once committed) was abandoned on
        a communication error (`error`, one line), in the switch to `generation` when `switching` (the
        plan's layer copies may be unfinished): this worker, alive, now waits for the next generation."""

    def before_export(self, store: Store, items: list[int]) -> None:
        """The job trained its last step; this node is about to write `items` of the trained model (layer
        indices; -1 for its config and index) into `spec.output.path`."""
