"""Step-time and memory estimators (Odyssey section IV-C, Oobleck section 4.1.2).

`pipeline_time` simulates the 1F1B schedule stage by stage (Odyssey eq. 11): every forward waits for the
previous op of its stage and for the same micro-batch's forward upstream; every backward for the same
micro-batch's backward downstream. It is exact for the schedule, handles unequal stages and micro-batch
counts, and equals the closed form of eq. 9 when stages are equal. Results are cached because plan search
asks for the same pipeline shape many times.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache

import numpy as np

from .errors import PlannerError
from .plan import PipelinePlan
from .profile import ModelProfile
from .spec import ClusterSpec


def symmetric_step_time(num_stages: int, microbatches: int, forward_s: float, backward_s: float) -> float:
    """Odyssey eq. 9: (N_pp + N_m - 1)(T_f + T_b) for equal stages."""
    return (num_stages + microbatches - 1) * (forward_s + backward_s)


def reroute_step_time(
    num_stages: int,
    microbatches: int,
    dp: int,
    failed_per_stage: Sequence[int],
    forward_s: float,
    backward_s: float,
) -> float:
    """Odyssey eq. 13 (eq. 12 with one failure): peers of a stage that lost F_i of its dp replicas each take
    N_m * F_i / (dp - F_i) extra micro-batches. A stage that lost every replica cannot be rerouted."""
    if len(failed_per_stage) != num_stages:
        raise PlannerError("failed_per_stage", f"needs {num_stages} entries, got {len(failed_per_stage)}")
    extra = 0.0
    for stage, failed in enumerate(failed_per_stage):
        if failed >= dp:
            raise PlannerError("failed", f"stage {stage} lost all {dp} replicas; rerouting is impossible")
        if failed > 0:
            extra += microbatches * failed / (dp - failed)
    return (num_stages + microbatches - 1 + extra) * (forward_s + backward_s)


def pipeline_time(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    microbatches: int,
    send_s: Sequence[float] | None = None,
) -> float:
    """Makespan of one 1F1B iteration. `send_s[i]` is the transfer time between stage i and i + 1."""
    if len(forward_s) != len(backward_s) or not forward_s:
        raise PlannerError("stages", "forward and backward times must be non-empty and of equal length")
    if microbatches < 0:
        raise PlannerError("microbatches", f"must be >= 0, got {microbatches}")
    if microbatches == 0:
        return 0.0  # a drained replica (fail-slow S2) computes nothing
    sends = tuple(send_s) if send_s is not None else (0.0,) * (len(forward_s) - 1)
    if len(sends) != len(forward_s) - 1:
        raise PlannerError("send_s", f"needs {len(forward_s) - 1} entries, got {len(sends)}")
    return _simulate_1f1b(tuple(forward_s), tuple(backward_s), microbatches, sends)


@lru_cache(maxsize=65536)
def _simulate_1f1b(
    forward: tuple[float, ...], backward: tuple[float, ...], microbatches: int, sends: tuple[float, ...]
) -> float:
    stages = len(forward)
    # Each stage's op order: warm-up forwards, then one-forward-one-backward, then cool-down backwards.
    orders: list[list[tuple[bool, int]]] = []
    for stage in range(stages):
        warmup = min(stages - stage - 1, microbatches)
        order = [(True, mb) for mb in range(warmup)]
        for k in range(microbatches - warmup):
            order.append((True, warmup + k))
            order.append((False, k))
        order.extend((False, mb) for mb in range(microbatches - warmup, microbatches))
        orders.append(order)

    unset = -1.0
    forward_end = [[unset] * microbatches for _ in range(stages)]
    backward_end = [[unset] * microbatches for _ in range(stages)]
    position = [0] * stages
    clock = [0.0] * stages
    remaining = 2 * stages * microbatches
    while remaining:
        progressed = False
        for stage in range(stages):
            order = orders[stage]
            while position[stage] < len(order):
                is_forward, mb = order[position[stage]]
                if is_forward:
                    ready = 0.0 if stage == 0 else forward_end[stage - 1][mb]
                    if ready == unset:
                        break
                    if stage:
                        ready += sends[stage - 1]
                    end = max(clock[stage], ready) + forward[stage]
                    forward_end[stage][mb] = end
                else:
                    if stage == stages - 1:
                        ready = forward_end[stage][mb]
                    else:
                        ready = backward_end[stage + 1][mb]
                        if ready == unset:
                            break
                        ready += sends[stage]
                    end = max(clock[stage], ready) + backward[stage]
                    backward_end[stage][mb] = end
                clock[stage] = end
                position[stage] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the schedule is deadlock-free by construction
            raise RuntimeError("1F1B simulation made no progress")
    return max(clock)


def in_flight_microbatches(stage: int, num_stages: int, microbatches: int) -> int:
    """Activations stage `stage` holds at its 1F1B peak: the warm-up depth plus the one in steady state."""
    return min(num_stages - stage, microbatches)


def stage_peak_memory(
    profile: ModelProfile,
    start: int,
    end: int,
    gpus: int,
    stage: int,
    num_stages: int,
    microbatches: int,
) -> int:
    """Odyssey eq. 14 per GPU: parameters, gradients (= parameters) and optimizer state, plus activations of
    the micro-batches in flight at the stage's position in the pipeline; split over the stage's GPUs."""
    param = profile.prefix("param")
    optimizer = profile.prefix("optimizer")
    activation = profile.prefix("activation")
    static = 2 * (param[end] - param[start]) + (optimizer[end] - optimizer[start])
    dynamic = in_flight_microbatches(stage, num_stages, microbatches) * (activation[end] - activation[start])
    return int((static + dynamic) / gpus)


def send_time(profile: ModelProfile, cluster: ClusterSpec, last_layer: int, same_node: bool) -> float:
    """Time to move one micro-batch's boundary activations out of `last_layer`."""
    size = profile.layers[last_layer].output_bytes
    bandwidth = cluster.intra_node_bandwidth if same_node else cluster.inter_node_bandwidth
    return size / bandwidth + cluster.message_latency_s


def pipeline_arrays(
    profile: ModelProfile,
    cluster: ClusterSpec,
    pipeline: PipelinePlan,
    compute: Mapping[int, float] | None = None,
    link: Mapping[int, float] | None = None,
) -> tuple[list[float], list[float], list[float]]:
    """Per-stage forward and backward times and the sends between stages, as `estimate_pipeline` uses them.

    Fail-slow factors (node -> slowdown) stretch them: `compute` a stage's times on a slow node (not a
    rerouted stage's: its peers run it), `link` a send leaving or entering a node with a slow NIC."""
    compute = compute or {}
    link = link or {}
    forward: list[float] = []
    backward: list[float] = []
    sends: list[float] = []
    stages = pipeline.stages
    for index, stage in enumerate(stages):
        fwd, bwd = profile.stage_times(stage.layers[0], stage.layers[1], len(stage.gpus))
        factor = 1.0 if stage.rerouted else compute.get(stage.node, 1.0)
        forward.append(fwd * factor)
        backward.append(bwd * factor)
        if index + 1 < len(stages):
            following = stages[index + 1].node
            same_node = following == stage.node
            slow = 1.0 if same_node else max(link.get(stage.node, 1.0), link.get(following, 1.0))
            sends.append(send_time(profile, cluster, stage.layers[1] - 1, same_node) * slow)
    return forward, backward, sends


def estimate_pipeline(
    profile: ModelProfile, cluster: ClusterSpec, pipeline: PipelinePlan, microbatches: int | None = None
) -> float:
    """Step time of one pipeline (no gradient sync), from the profile and the stages' GPU counts."""
    forward, backward, sends = pipeline_arrays(profile, cluster, pipeline)
    return pipeline_time(
        forward, backward, pipeline.microbatches if microbatches is None else microbatches, sends
    )


def allreduce_time(
    profile: ModelProfile, cluster: ClusterSpec, rounds: Sequence[Sequence[tuple[int, int]]], replicas: int
) -> float:
    """Gradient synchronisation: rounds run one after another; segments within a round in parallel, each a
    ring all-reduce of its parameter bytes over `replicas` participants between nodes: 2 (replicas - 1)
    messages in sequence, each costing `message_latency_s` besides its share of the bytes."""
    if replicas <= 1:
        return 0.0
    param = profile.prefix("param")
    factor = 2 * (replicas - 1) / replicas / cluster.inter_node_bandwidth
    latency = 2 * (replicas - 1) * cluster.message_latency_s
    return sum(
        max((float(param[end] - param[start]) for start, end in segments), default=0.0) * factor + latency
        for segments in rounds
        if segments
    )


class OneFOneB:
    """Exact 1F1B makespans of one pipeline for any number of micro-batches, much cheaper than calling
    `pipeline_time` for each count (plan search asks for many neighbouring counts).

    Every stage's schedule is: warm-up forwards (stages - 1 - stage of them, or all m when fewer), then
    (forward, backward) pairs, then cool-down backwards. The ops before the cool-down of m are also the first
    ops of every larger m, and they depend only on each other, so they are simulated once and extended as m
    grows; each query then simulates only its own cool-down, O(stages x min(m, stages)). The recurrences are
    the ones of `pipeline_time`, evaluated in the same arithmetic, so the results are identical to it (a test
    checks, for counts below stages - 1 too).
    """

    def __init__(
        self, forward_s: Sequence[float], backward_s: Sequence[float], send_s: Sequence[float] | None = None
    ) -> None:
        if len(forward_s) != len(backward_s) or not forward_s:
            raise PlannerError("stages", "forward and backward times must be non-empty and of equal length")
        self._forward = tuple(float(x) for x in forward_s)
        self._backward = tuple(float(x) for x in backward_s)
        stages = len(self._forward)
        sends = tuple(float(x) for x in send_s) if send_s is not None else (0.0,) * (stages - 1)
        if len(sends) != stages - 1:
            raise PlannerError("send_s", f"needs {stages - 1} entries, got {len(sends)}")
        self._sends = sends
        self._stages = stages
        self._forward_end: list[list[float]] = [[] for _ in range(stages)]
        self._backward_end: list[list[float]] = [[] for _ in range(stages)]
        self._clock = [0.0] * stages
        self._done = 0  # micro-batches whose non-cool-down ops are simulated

    def time(self, microbatches: int) -> float:
        """`pipeline_time(forward_s, backward_s, microbatches, send_s)`."""
        if microbatches < 1:
            raise PlannerError("microbatches", f"must be >= 1, got {microbatches}")
        self._extend(microbatches)
        return self._cool_down(microbatches)

    def _extend(self, upto: int) -> None:
        stages, forward, backward, sends = self._stages, self._forward, self._backward, self._sends
        forward_end, backward_end, clock = self._forward_end, self._backward_end, self._clock
        last = stages - 1
        for mb in range(self._done, upto):
            for stage in range(stages):
                ready = 0.0 if stage == 0 else forward_end[stage - 1][mb]
                if stage:
                    ready += sends[stage - 1]
                end = max(clock[stage], ready) + forward[stage]
                forward_end[stage].append(end)
                clock[stage] = end
                k = mb - (last - stage)  # the backward paired with this forward, if any
                if k >= 0:
                    if stage == last:
                        ready = forward_end[stage][k]
                    else:
                        ready = backward_end[stage + 1][k] + sends[stage]
                    end = max(clock[stage], ready) + backward[stage]
                    backward_end[stage].append(end)
                    clock[stage] = end
        self._done = max(self._done, upto)

    def _cool_down(self, microbatches: int) -> float:
        stages, backward, sends = self._stages, self._backward, self._sends
        forward_end, backward_end = self._forward_end, self._backward_end
        m = microbatches
        finals: list[float] = []
        below: list[float] = []  # cool-down backward ends of the stage below (stage + 1)
        first_below = m  # the stage below's first cool-down backward (the last stage has none)
        for stage in range(stages - 1, -1, -1):
            # With fewer micro-batches than stages - 1, the upper stages run every forward before any
            # backward: their warm-up is the whole batch and their cool-down every backward.
            warmup = min(stages - 1 - stage, m)
            paired = m - warmup  # backwards 0..paired-1 ran before the cool-down
            clock = backward_end[stage][paired - 1] if paired >= 1 else forward_end[stage][m - 1]
            row: list[float] = []
            for k in range(paired, m):
                done = backward_end[stage + 1][k] if k < first_below else below[k - first_below]
                ready = done + sends[stage]
                clock = max(clock, ready) + backward[stage]
                row.append(clock)
            finals.append(clock)
            below, first_below = row, paired
        return max(finals)

    def times(self, upto: int) -> np.ndarray:
        """`[time(1), ..., time(upto)]` as an array, in O(upto x stages) in all.

        From stages - 1 micro-batches on, the cool-down is a max-plus function of the stage clocks reached
        before it, and its shape does not depend on m: time(m) = max_s (clock_s(m) + tail_s), with tail_s
        the longest path from stage s's clock through the cool-down (`_tails`, computed once). The values
        equal `pipeline_time` up to the order of floating-point additions (a test checks to 1e-12).
        """
        if upto < 1:
            raise PlannerError("microbatches", f"must be >= 1, got {upto}")
        stages = self._stages
        first = max(stages - 1, 1)
        small = self._short_times(min(first - 1, upto))
        if upto < first:
            return np.asarray(small, dtype=np.float64)
        clocks = np.empty((upto - first + 1, stages), dtype=np.float64)
        rows = len(clocks)
        row = 0
        while row < rows:
            self._extend(first + row)
            clocks[row] = self._clock
            period = self._period(clocks, row)
            row += 1
            if period:
                # Past the transient the clocks repeat every `period` micro-batches shifted by a constant
                # (a max-plus linear system reached its periodic regime), so the rest follows exactly.
                shift = clocks[row - 1] - clocks[row - 1 - period]
                for index in range(row, rows):
                    clocks[index] = clocks[index - period] + shift
                break
        tails = self._tails()
        return np.concatenate([np.asarray(small, dtype=np.float64), (clocks + tails).max(axis=1)])

    def _short_times(self, most: int) -> list[float]:
        """`[time(1), ..., time(most)]` for counts below stages - 1, all counts at once.

        Each count's cool-down runs on the shared prefix of ops (`_extend`). Stage s (warm-up w) runs its
        cool-down backwards j = 0, 1, ... for every count m together, one vector step per j: O(stages^2)
        numpy steps instead of O(stages^3) Python ones (the event simulation per count was O(stages^4), half
        a minute over a 1,024-node template set). The j-th backward of m waits for the stage below's j-th
        when m < w (both stages run all forwards first) and for its (j - 1)-th otherwise, so each step reads
        two slices of the stage below's rows. Same recurrences in the same arithmetic as `_cool_down`, so
        bit for bit `pipeline_time` (a test checks)."""
        if most < 1:
            return []
        stages, backward, sends = self._stages, self._backward, self._sends
        self._extend(most)
        last = stages - 1
        counts = np.arange(most + 1)  # index m: the schedule of m micro-batches (index 0 unused)
        finals = np.asarray([0.0, *self._backward_end[last][:most]], dtype=np.float64)  # last stage: B(m-1)
        below = np.empty((0, most + 1), dtype=np.float64)  # below[j, m]: the stage below's j-th cool-down end
        for stage in range(last - 1, -1, -1):
            warmup = stages - 1 - stage
            before = np.asarray(self._backward_end[stage], dtype=np.float64)  # pre-cool-down backwards
            under = np.asarray(self._backward_end[stage + 1], dtype=np.float64)
            forward_ends = np.asarray([0.0, *self._forward_end[stage][:most]], dtype=np.float64)
            # The clock before the cool-down: the last paired backward (m > w), else the last forward.
            clock = forward_ends.copy()
            if most > warmup:
                clock[warmup + 1 :] = before[: most - warmup]
            steps = min(warmup, most)
            rows = np.empty((steps, most + 1), dtype=np.float64)
            send, duration = sends[stage], backward[stage]
            split = min(warmup, most + 1)  # counts below it run all forwards first
            for j in range(steps):
                first = j + 1  # counts with a j-th cool-down backward: m > j
                if j == 0:
                    late = under[counts[max(warmup, first) :] - warmup]  # the stage below's paired backward
                else:
                    late = below[j - 1, max(warmup, first) :]
                ready = np.concatenate([below[j, first:split], late]) if first < split else late
                tick = np.maximum(clock[first:], ready + send) + duration
                clock[first:] = tick
                rows[j, first:] = tick
            np.maximum(finals, clock, out=finals)
            below = rows
        return [float(x) for x in finals[1:]]

    @staticmethod
    def _period(clocks: np.ndarray, row: int) -> int:
        """The smallest p <= 8 with clocks[row] - clocks[row - p] the same for every stage, else 0."""
        deepest = min(8, row)
        if not deepest:
            return 0
        # Rounding leaves a few ulps of the clocks (~1e-16 each); 1e-13 of them is far above that and far
        # below any real difference: at 1e-11 a pipeline with 1e-11 s sends passed for periodic, and its
        # extrapolated times drifted by a send per micro-batch (a saved Hypothesis case).
        scale = 1e-13 * max(1.0, float(np.abs(clocks[row]).max()))
        # Every candidate period at once (rows row - 1 down to row - deepest): one numpy pass per row.
        shifts = clocks[row] - clocks[row - deepest : row][::-1]
        spread = shifts.max(axis=1) - shifts.min(axis=1)
        periodic = np.flatnonzero(spread <= scale)
        return int(periodic[0]) + 1 if len(periodic) else 0

    def _tails(self) -> np.ndarray:
        stages, backward, sends = self._stages, self._backward, self._sends
        if stages == 1:
            return np.zeros(1)
        minus = float("-inf")
        # longest[s][j]: longest path from stage s's j-th cool-down backward to the end of the iteration.
        longest: list[list[float]] = []
        for stage in range(stages - 1):
            warmup = stages - 1 - stage
            row = [minus] * warmup
            for j in range(warmup - 1, -1, -1):
                best = 0.0 if j == warmup - 1 else backward[stage] + row[j + 1]
                if stage >= 1:
                    # This backward releases the stage above's (j + 1)-th cool-down backward.
                    best = max(best, sends[stage - 1] + backward[stage - 1] + longest[stage - 1][j + 1])
                row[j] = best
            longest.append(row)
        tails = np.empty(stages, dtype=np.float64)
        for stage in range(stages):
            best = 0.0 if stage == stages - 1 else backward[stage] + longest[stage][0]
            if stage >= 1:
                best = max(best, sends[stage - 1] + backward[stage - 1] + longest[stage - 1][0])
            tails[stage] = best
        return tails
