"""`rjob demo` as a user runs it (a subprocess, log mode): the local stack trains the small GPT for real
through a worker kill and a slowdown, the summary lists the fail-stop recovery and the fail-slow
mitigation (S2), the PNG is written, and everything is torn down."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.serial  # the detection delay in iterations, the share of the slowdown removed

ROOT = Path(__file__).resolve().parents[1]


def _rjob_demo(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "resilientjob.cli", "demo", *args],
        cwd=ROOT,
        env={key: value for key, value in os.environ.items() if key != "RJOB_LOCAL_DIR"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _operator_said(out: Path, lines: int = 30) -> str:
    """The operator's last words on the demo's job (validations, findings, decisions) from the torn-down
    stack's log: what a failed run's output alone does not say (a CI run keeps nothing else)."""
    log = out / "stack" / "operator.log"
    if not log.exists():
        return ""
    said = [line for line in log.read_text(errors="replace").splitlines() if "job default/demo-gpt:" in line]
    return "\noperator:\n" + "\n".join(said[-lines:])


def test_demo_rejects_a_too_short_duration(tmp_path: Path) -> None:
    done = _rjob_demo("--duration", "5", "--out", str(tmp_path), timeout=30)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "duration" in done.stderr
    assert not (tmp_path / "stack").exists()


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.cluster
def test_demo_recovers_from_a_kill_mitigates_the_slowdown_and_writes_the_plot(tmp_path: Path) -> None:
    # What a user sees, every phase included: the kill 6 s into training, the slowdown 12 s after it (the
    # healthy baseline, 10 s, starts after the kill's recovery), then about 20 s of mitigated training to
    # measure (the default 180 s only adds more of that: the suite's time is kept under 20 minutes).
    done = _rjob_demo("--no-live", "--duration", "60", "--out", str(tmp_path), timeout=420)
    output = done.stdout + done.stderr
    (tmp_path / "demo.log").write_text(output)  # beside the picture, for reading a failed run
    assert done.returncode == 0, output
    # Worker 2, unless a heartbeat expiry on a loaded host already replanned it away.
    killed = re.search(r"kill: worker (\d+) \(SIGKILL\)", output)
    assert killed is not None, output
    assert "training: first step committed" in output
    assert "NodeJoined" not in output  # the demo job asks for no replacement pods (replaceFailedNodes)
    # The summary table's row for the fail-stop recovery: its trigger and the node that died.
    rows = [line for line in output.splitlines() if "NodeFailed" in line and "│" in line]
    assert rows and any(cell.strip() == killed[1] for cell in rows[0].split("│")), output
    # The demo's layout is pipelined, so the recovery moves layers: the workers copied them peer-to-peer.
    copies = re.search(r"peer-to-peer: (\d+) layer copies planned, (\d+) bytes copied", output)
    assert copies is not None and int(copies[1]) > 0 and int(copies[2]) > 0, output
    # The slowdown: S2 published as a generation of its own, a NodeSlow row, and the closing measurement.
    slowed = re.search(r"slow: worker (\d+) x", output)
    assert slowed is not None, output
    # The slowed worker is among the nodes named. A second one was named with it on loaded two-core runners
    # (world rank 0's GEMM, timed while its peers still computed: the validation pass now waits for every
    # rank first); a noisy validation may still name one, and S2 then balances both.
    mitigation = re.search(r"generation \d+: NodeSlow \[([\d, ]+)\] .*\(microbatch mitigation\)", output)
    named = mitigation is not None and slowed[1] in mitigation[1].split(", ")
    assert named, output + _operator_said(tmp_path)
    rows = [line for line in output.splitlines() if "NodeSlow" in line and "│" in line]
    assert rows and any(slowed[1] in cell.strip().split(",") for cell in rows[0].split("│")), output
    closing = re.search(
        rf"fail-slow on worker {slowed[1]}: in effect from step \d+ \(\d+ after the order\); detected \d+ "
        r"iterations after its onset, \d+ iterations .* microbatch at .*% of the slowdown removed",
        " ".join(output.split()),  # the console wraps the closing line at its width
    )
    assert closing is not None, output
    png = tmp_path / "demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert not (tmp_path / "stack" / "state.json").exists()  # torn down


def test_the_fail_slow_summary_measures_detection_and_the_slowdown_removed() -> None:
    from resilientjob.cli._demo_failslow import FailSlowWatch

    watch = FailSlowWatch()
    assert watch.detected([7], 1.0, 5) is None  # nothing ordered yet: not a detection
    watch.slowed(7, at=50.0, step=1000)
    assert watch.detected([], 52.0, 1010) is None
    assert watch.detected([3], 52.5, 1011) is None  # another node: not the ordered slowdown's detection
    seen = watch.detected([7], 53.0, 1012)
    assert seen == "fail-slow detected: nodes [7] (in the job's status 12 steps after the order)"
    watch.mitigated("microbatch", 60.0)
    watch.mitigated("restore", 80.0)  # the episode's end is not its mitigation
    # A step every 0.5 s: 600 samples/s healthy, 400 slowed, 550 after the mitigation: 75% of the loss won
    # back. Rates are counted from the steps in each window (the order at 50 s, the mitigation at 60 s).
    timeline = [(t / 2, 300 if t < 100 else 200 if t < 120 else 275) for t in range(200)]
    line = watch.summary(timeline, end=100.0)
    assert "detected 12 iterations (3.0s) after the order" in line
    assert "microbatch at +10.0s" in line
    # The step time went 1.5x -> 1.09x of healthy: 82% of the slowdown removed, as Falcon measures it.
    assert (
        "600 healthy, 400 slowed, 550 mitigated samples/s: step time 1.50x -> 1.09x of healthy, 82% of the "
        "slowdown removed (75% of the lost throughput won back)"
    ) in line, line
    assert "not detected" in FailSlowWatch(node=7, slowed_at=50.0).summary(timeline, end=100.0)
    # A mitigation within a second of the order leaves no slowed window to measure: said, not made up.
    quick = FailSlowWatch(node=7, slowed_at=50.0, mitigated_at=51.0, strategy="microbatch")
    assert "the mitigation came too soon after the order to measure the slowed rate" in quick.summary(
        timeline, end=100.0
    )
    # The live table's line: the same episode as it unfolds.
    assert FailSlowWatch().live(timeline, 10.0) == "fail-slow: none ordered yet"
    live = watch.live(timeline, 100.0)
    assert "worker 7 slowed at +50s; detected after 12 steps; microbatch at +10.0s" in live, live
    assert live.endswith("healthy 600 / slowed 400 / mitigated 550 samples/s"), live
    # Once the NodeSlow row is in the status, the operator's own step of the detection replaces the one the
    # demo sampled: a row for another node, or from before the order, is not this episode's.
    watch.dated([{"trigger": "NodeSlow", "nodes": [7], "detectedStep": 990, "onsetStep": 985}], 61.0)
    watch.dated([{"trigger": "NodeSlow", "nodes": [3], "detectedStep": 1004}], 61.0)
    watch.dated([{"trigger": "NodeFailed", "nodes": [7]}], 61.0)
    assert watch.detected_step == 1012 and not watch.detected_exact
    watch.dated([{"trigger": "NodeSlow", "nodes": [3, 7], "detectedStep": 1006, "onsetStep": 1001}], 61.0)
    assert "detected 6 iterations (3.0s) after the order" in watch.summary(timeline, end=100.0)
    watch.dated([{"trigger": "NodeSlow", "nodes": [7], "detectedStep": 1030}], 70.0)  # a later episode
    assert watch.detected_step == 1006
    # Dated without the status ever naming the node in a sample: the row alone is the detection.
    unseen = FailSlowWatch()
    unseen.slowed(7, at=50.0, step=1000)
    unseen.dated([{"trigger": "NodeSlow", "nodes": [7], "detectedStep": 1009}], 58.0)
    assert "detected 9 iterations (8.0s) after the order" in unseen.summary(timeline, end=100.0)
    # The slowed worker's first step with chaos delay at or after the order is the onset: the detection
    # counts from there too (the worker polls its order every 0.25 s, a few steps of a fast job).
    unseen.took_effect(7, 1001, 0.0)  # not slowed yet
    unseen.took_effect(3, 1002, 0.2)  # another worker
    unseen.took_effect(7, 999, 0.2)  # before the order (a stale record)
    unseen.took_effect(7, 1003, 0.2)
    unseen.took_effect(7, 1004, 0.2)
    assert unseen.onset_step == 1003
    assert (
        "in effect from step 1003 (3 after the order); detected 6 iterations after its onset, 9 iterations "
        "(8.0s) after the order;"
    ) in unseen.summary(timeline, end=100.0)


def test_the_slowdown_is_dated_by_the_step_read_right_after_its_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The last sample's step is up to SAMPLE_S and the order's round trip old: a few steps of a fast job,
    # which the detection delay "after the order" would count against the operator.
    from resilientjob.cli import _demo, _local

    written: list[str] = []
    monkeypatch.setattr(_local, "_slow", lambda pod, factor, duration: written.append(pod))
    seen = _demo.Observed(training_since=0.0, killed_at=0.0, committed=100, plan_nodes=(0, 1, 7))
    for node in seen.plan_nodes:
        seen.workers[node] = _demo.Worker(node, alive=True)
    chaos = _demo.Chaos("demo-gpt", nodes=8, duration=120.0, kill_node=2, killed_at=-30.0, killed=2)

    def committed_step() -> int:
        assert written, "read before the order was written"
        return 104

    events = chaos.step(seen, committed_step)
    assert written == ["demo-gpt-node-7"] and events and events[0].startswith("slow: worker 7")
    assert seen.failslow.node == 7 and seen.failslow.slowed_step == 104
    # Before the job has a store to read, the last sample's step stands.
    again = _demo.Observed(training_since=0.0, committed=100, plan_nodes=(0, 7))
    again.workers = {0: _demo.Worker(0, alive=True), 7: _demo.Worker(7, alive=True)}
    chaos = _demo.Chaos("demo-gpt", nodes=8, duration=120.0, kill_node=2, killed_at=-30.0, killed=2)
    chaos.step(again, lambda: None)
    assert again.failslow.slowed_step == 100


def test_the_recoveries_table_counts_the_steps_to_a_fail_slow_detection() -> None:
    from resilientjob.cli._demo import _detect_steps

    assert _detect_steps({"trigger": "NodeSlow", "onsetStep": 120, "detectedStep": 128}) == "8"
    assert _detect_steps({"trigger": "NodeFailed", "detectS": 0.4}) == "-"


def test_the_recoveries_table_times_each_decision_from_the_fault_it_answers() -> None:
    from resilientjob.cli._demo import Observed, _after_fault

    seen = Observed(killed_at=20.0, published={1: 20.6, 2: 57.5, 3: 90.0})
    seen.failslow.slowed(7, at=50.0, step=100)
    assert _after_fault(seen, 1, "NodeFailed") == "0.6"
    assert _after_fault(seen, 2, "NodeSlow") == "7.5"  # the order -> the mitigation's generation
    assert _after_fault(seen, 3, "NodeRecovered") == "-"  # no injected fault answers a restore
    assert _after_fault(seen, 4, "NodeSlow") == "-"  # never seen published


def test_the_demo_job_leaves_s2_micro_batches_to_move_off_the_slowed_worker() -> None:
    # `rjob demo` kills worker 2, then slows the highest surviving worker (SLOW_FACTOR). S2 must have a whole
    # micro-batch to move off it (with one per replica it declined), keeping the global batch exact.
    import yaml

    from resilientjob.cli._demo import SLOW_FACTOR
    from resilientjob.operator import api
    from resilientjob.operator._failslow_plans import microbatch_plan, slowed_step_time, sync_time
    from resilientjob.operator.planning import plan_initial, plan_next, planner_inputs

    manifest = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    spec = api.parse_spec(manifest["spec"])
    inputs = planner_inputs(spec)
    after_kill = plan_next(spec, inputs, plan_initial(spec, inputs), failed=[2])
    slowed = max(after_kill.nodes)
    factors = {slowed: SLOW_FACTOR}
    sync_s = sync_time(after_kill, inputs.profile, inputs.cluster)
    s2 = microbatch_plan(after_kill, inputs.profile, inputs.cluster, factors, sync_s)
    assert not isinstance(s2, str), s2
    assert sum(p.microbatches for p in s2.pipelines) * s2.microbatch_size == spec.global_batch_size
    # Samples, not micro-batches: S2 may split them finer (it does at x3, where one whole micro-batch left on
    # the slowed worker still takes longer than two on a healthy one).
    mine = [p.microbatches * s2.microbatch_size for p in s2.pipelines if slowed in p.nodes]
    before = [p.microbatches * after_kill.microbatch_size for p in after_kill.pipelines if slowed in p.nodes]
    assert mine[0] < before[0], (before, mine)
    healthy = slowed_step_time(after_kill, inputs.profile, inputs.cluster, {})
    slow = slowed_step_time(after_kill, inputs.profile, inputs.cluster, factors)
    fixed = slowed_step_time(s2, inputs.profile, inputs.cluster, factors)
    assert (slow - fixed) / (slow - healthy) >= 0.5  # the estimate: at least half of the slowdown removed


def test_labels_of_event_lines_a_few_seconds_apart_stand_side_by_side() -> None:
    from resilientjob.cli._demo import _label_columns

    # The kill alone; then the slowdown, its detection 3 s later and S2 1 s after that (a 180 s run: a label
    # is 3 s wide); then a restore far off.
    assert _label_columns([41.0, 42.0, 56.5, 59.5, 60.5, 120.0], 180.0) == [0, 1, 0, 0, 1, 0]
    assert _label_columns([10.0, 10.5, 11.0, 11.5], 180.0) == [0, 1, 2, 3]
    assert _label_columns([], 180.0) == []


@pytest.mark.torch
@pytest.mark.cluster
def test_a_stopped_demo_tears_down_and_exits_as_a_stopped_program(tmp_path: Path) -> None:
    """Ctrl-C or SIGTERM tears the stack down, and the exit status says the demo was stopped (128 + the
    signal), as a shell reports a stopped program (it exited 0). Its output, redirected, comes as log lines
    while it runs, not as the live table's last frame at the end."""
    import signal

    command = [sys.executable, "-m", "resilientjob.cli", "demo", "--duration", "60", "--out", str(tmp_path)]
    env = {key: value for key, value in os.environ.items() if key != "RJOB_LOCAL_DIR"}
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True) as demo:
        assert demo.stdout is not None
        said = []
        for line in demo.stdout:  # log lines as they come: the redirected demo shows no live table
            said.append(line)
            if "training: first step committed" in line:
                demo.send_signal(signal.SIGTERM)
                break
        for line in demo.stdout:
            said.append(line)
            if "interrupted: tearing down" in line:
                demo.send_signal(signal.SIGINT)  # an impatient second signal: the teardown still ends
                break
        rest, _ = demo.communicate(timeout=120)
    output = "".join(said) + rest
    assert demo.returncode == 128 + signal.SIGTERM, output
    assert "interrupted: tearing down" in output
    assert not (tmp_path / "stack" / "state.json").exists()  # torn down
