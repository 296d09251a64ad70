"""A world that stops with every node alive (`operator/_aborts`), timed on the local stack with the demo's
real GPT on CPU gloo workers: `rjob local chaos break` on one worker (its next collective fails once, as a
reset connection would; the world re-forms, `CollectiveFailed`), repeated `--breaks` times, then `rjob
local chaos hang` on another (its worker blocks while its agent beats on; it is fenced, `NodeHung`). Between
them, `--switch-breaks` times, a break in a switch: `chaos break --switch` arms node 0's next rendezvous,
then a plain break on node 1 brings a re-formation on, whose switch fails; the world re-forms once more
(both `CollectiveFailed`), timed from the plain break to the second.

For each order it prints the seconds from the order's write to the generation that answers it, to the first
step node 0 commits under that generation, and the training gap (node 0's last committed step before the
order to its first after), and it checks that node 0 committed no step number twice. For a break it also
prints how every node abandoned the broken step, from its pod's log: waiting out its collective timeout
("no progress within"), or at once (the broken call itself, or a peer's word through the generation's
`abandoned` counter, `agent._runtime_wait.FailureNotice`). Run it on a checkout before that counter
(c32f9db) for the comparison in docs/benchmarks/runtime.md.

No baseline runs beside it: before `operator/_aborts` the workers waited out their plan timeout (120 s in a
pod) and exited, every pod at once; that path is gone from the code, so the 120 s is the configuration's
figure, not a measurement.

Usage: .venv/bin/python bench/bench_world_stops.py [--nodes 3] [--breaks 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench_failslow_e2e import Stack, wait  # noqa: E402

from resilientjob.protocol.chaos import ChaosOrder  # noqa: E402
from resilientjob.protocol.messages import PlanAnnouncement  # noqa: E402

JOB = "demo-gpt"
HANG_S = 300


def order(stack: Stack, fault: str, node: int, switch: bool = False) -> float:
    """Write a `fault` order on `node`; returns when it was written (unix time)."""
    options = ["--for", f"{HANG_S}s"] if fault == "hang" else (["--switch"] if switch else [])
    stack.rjob("chaos", fault, f"{JOB}-node-{node}", *options)
    raw = stack.client.get(stack.keys.chaos(node))
    if raw is None:
        raise RuntimeError(f"no chaos order on node {node} after `rjob local chaos {fault}`")
    return ChaosOrder.model_validate_json(raw).until - (
        HANG_S if fault == "hang" else 600.0 if switch else 60.0
    )


def answered(stack: Stack, after: int, trigger: str) -> tuple[PlanAnnouncement, float]:
    """The first generation after `after` with `trigger`, and when this bench saw it (unix time)."""
    deadline = time.time() + 120
    while time.time() < deadline:
        plan = stack.plan()
        if plan is not None and plan.generation > after:
            if plan.trigger != trigger:
                raise RuntimeError(
                    f"generation {plan.generation}: {plan.trigger}, not {trigger}: {plan.reason}"
                )
            return plan, time.time()
        time.sleep(0.05)
    raise TimeoutError(f"no {trigger} generation after {after} within 120 s")


def timed(
    stack: Stack, fault: str, node: int, trigger: str, switch_node: int | None = None
) -> dict[str, Any]:
    """One order timed; with `switch_node`, that node's next switch is broken first, and the answer is the
    second generation (the re-formation of the re-formation whose switch failed)."""
    before = stack.plan()
    assert before is not None
    if switch_node is not None:
        order(stack, "break", switch_node, switch=True)
        time.sleep(0.5)  # two polls of the node's chaos watcher
    ordered_at = order(stack, fault, node)
    plan, seen_at = answered(stack, before.generation + (1 if switch_node is not None else 0), trigger)

    def first_step() -> float | None:
        sent = [r.sent_at for r in stack.iterations() if r.node == 0 and r.generation >= plan.generation]
        return min(sent) if sent else None

    resumed_at = wait(first_step, 60, f"node 0's first step under generation {plan.generation}")
    last_before = max(r.sent_at for r in stack.iterations() if r.node == 0 and r.sent_at < ordered_at)
    return {
        "fault": fault if switch_node is None else "switch",
        "node": node,
        "generation": plan.generation,
        "answered_s": round(seen_at - ordered_at, 2),
        "first_step_s": round(resumed_at - ordered_at, 2),
        "training_gap_s": round(resumed_at - last_before, 2),
        "reason": plan.reason,
        # A re-formed world has the broken one's nodes.
        "abandoned": abandoned(stack, plan.generation - 1, plan.plan.nodes) if fault == "break" else {},
        "switches": abandoned(stack, plan.generation - 1, plan.plan.nodes, "switch")
        if switch_node is not None
        else {},
    }


def abandoned(stack: Stack, generation: int, nodes: Iterable[int], what: str = "") -> dict[int, str]:
    """How each node's pod log says it abandoned its step (or `what`: "switch") of `generation` (the error,
    shortened)."""
    said: dict[int, str] = {}
    for node in nodes:
        lines = stack.rjob("logs", f"{JOB}-node-{node}").splitlines()
        found = [
            line for line in lines if line.startswith(f"gen {generation}: {what}") and " abandoned" in line
        ]
        if found:
            error = found[0].split(" abandoned: ", 1)[-1].removesuffix("; waiting for the next generation")
            said[node] = error[:120]
    return said


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--breaks", type=int, default=3)
    parser.add_argument("--switch-breaks", type=int, default=2)
    args = parser.parse_args()
    job = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    job["spec"]["nodes"] = args.nodes
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rjob-world-stops-") as directory:
        stack = Stack(Path(directory), JOB)
        try:
            path = Path(directory) / "job.yaml"
            path.write_text(yaml.safe_dump(job))
            stack.rjob("apply", "-f", str(path))
            wait(lambda: stack.step(0) > 30, 180, "30 steps")
            for round_ in range(args.breaks):
                rows.append(timed(stack, "break", 1 + round_ % (args.nodes - 1), "CollectiveFailed"))
                time.sleep(5)  # steps under the re-formed world before the next order
            for _ in range(args.switch_breaks):
                rows.append(timed(stack, "break", 1, "CollectiveFailed", switch_node=0))
                time.sleep(5)
            rows.append(timed(stack, "hang", args.nodes - 1, "NodeHung"))
            steps = [r.step for r in stack.iterations() if r.node == 0]
        finally:
            stack.down()
    repeated = len(steps) - len(set(steps))
    for row in rows:
        timed_out = [node for node, error in row["abandoned"].items() if "no progress within" in error]
        waited = (
            f"; nodes that waited out their collective timeout: {timed_out or 'none'}"
            if row["fault"] in ("break", "switch")
            else ""
        )
        print(
            f"{row['fault']:>5} node {row['node']}: generation {row['generation']} {row['answered_s']:.2f} s "
            f"after the order, node 0's first step under it {row['first_step_s']:.2f} s, training gap "
            f"{row['training_gap_s']:.2f} s{waited}"
        )
    for row in rows:
        for node, error in sorted(row["abandoned"].items()):
            kind = "the switch" if node in row["switches"] else "its step"
            print(f"  generation {row['generation'] - 1}, node {node} abandoned {kind}: {error}")
    print(f"node 0 committed {len(steps)} steps in the stream kept, {repeated} step numbers twice")
    print(json.dumps(rows))
    return 0 if repeated == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
