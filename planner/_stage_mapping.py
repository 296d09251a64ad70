"""Exact GPU-stage mapping for one Oobleck pipeline template (Oobleck section 4.1.2), without the paper's
divide and conquer.

A template of n nodes x G GPUs runs the model's L layers as S stages (n <= S <= min(L, n*G)). Nodes follow
one another along the pipeline; each node hosts one or more consecutive stages and splits its G GPUs among
them (a stage never spans nodes, every GPU is used). A stage of layers [u, v) on d GPUs takes
t = (F + B)(u, v) / speedup(d) per micro-batch and must fit device memory at its 1F1B peak (estimator eq. 14
with S - k micro-batches in flight at stage k).

Objective (minimised over S and all mappings), with N_b = 4S micro-batches as in the paper:

    J = sum_k t_k + (N_b - 1) * max_k t_k

This is the 1F1B critical path: warm-up and cool-down pass every stage once (Oobleck's T1 = sum t_k) and
the steady phase repeats the slowest stage (T2 + T3). Oobleck's T1 + T2 + T3 (eqs. 1-4) equals J whenever the
stages after the slowest one are as slow as it (balanced pipelines, or the slowest stage last); otherwise it
credits those faster downstream stages, which 1F1B cannot (the bottleneck still runs all N_b forwards and
backwards), so J is the same model without that optimism.

Algorithm. For a cap c on the slowest stage, the least sum of stage times is a shortest-path problem over
states (r stages left, first free GPU a, first unassigned layer u): a stage (u, v, d) costs t(u, v, d) and
needs t <= c and memory at r stages left. Counting r from the end makes memory independent of S, so one
pass answers every S and every template size at once (a template of n' nodes starts at GPU (n_max - n')G).
The minimum over v of t(u, v, d) + F[v] on the window (u, v_max] is a range minimum (sparse table), so a
pass is O(S * G * nG * L log L) numpy work. J(c) = (N_b - 1)c + MinSum(c) is minimised over the caps that
matter: the smallest feasible cap c_min (binary search over the sorted distinct stage times with a cheap
feasibility pass), then only caps in (c_min, (best - MinSum_inf)/(N_b - 1)], walked from the top: a pass at
cap c returns a solution whose slowest stage m <= c, and MinSum is constant on [m, c], so the next cap to try
is the largest stage time below m. Stage counts S are visited by a lower bound and skipped once it exceeds
the best J found. Every skipped (S, c) is provably no better, so the result is the exact optimum of J.

`StageMapper.best` first runs the node-level search of `_node_mapping` (one stage per node as the
incumbent, per-S lower bounds, then branch and bound over caps with banded node blocks), which is exact
whenever memory admits the same stages at every r below the caps that matter, and typically settles a
template in well under a millisecond to a few milliseconds. Only when memory depends on r there does it
fall back to the stage-count search above (`best_by_stage_count`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._mapping import BoolArray, FloatArray, IntArray, MappedStage, Mapping, mapping_objective
from ._node_mapping import NodeSearch
from .errors import PlannerError
from .profile import ModelProfile


class StageMapper:
    """Optimal GPU-stage mappings for every template size up to `max_nodes`, sharing all precomputation."""

    def __init__(
        self, profile: ModelProfile, gpus_per_node: int, max_nodes: int, device_memory_bytes: int
    ) -> None:
        if gpus_per_node < 1:
            raise PlannerError("gpus_per_node", f"must be >= 1, got {gpus_per_node}")
        if max_nodes < 1:
            raise PlannerError("nodes", f"must be >= 1, got {max_nodes}")
        self.profile = profile
        self.gpus = gpus_per_node
        self.max_nodes = max_nodes
        self.memory = device_memory_bytes
        layers = profile.num_layers
        self.layers = layers
        self.positions = max_nodes * gpus_per_node + 1
        self.speedups = np.array([profile.speedup(d) for d in range(1, gpus_per_node + 1)])
        forward, backward = profile.prefix("forward"), profile.prefix("backward")
        scale = 1.0 / self.speedups
        # times[d-1, u, v]: stage [u, v) on d GPUs, computed as profile.stage_times does; -inf for v <= u so
        # that counting entries <= cap gives the last admissible end layer of each row.
        diff_f = forward[None, :] - forward[:, None]
        diff_b = backward[None, :] - backward[:, None]
        times = diff_f[None] * scale[:, None, None] + diff_b[None] * scale[:, None, None]
        upper = np.triu(np.ones((layers + 1, layers + 1), dtype=bool), k=1)
        self.times: FloatArray = np.where(upper[None], times, -np.inf)
        self.candidates: FloatArray = np.unique(self.times[:, upper])
        # Per-d decomposition t(u, v, d) = P_d[v] - P_d[u] used inside the range-minimum passes.
        total = forward + backward
        self.scaled_prefix: FloatArray = total[None, :] * scale[:, None]
        self.work = float(total[-1])
        # Integer memory prefixes (exact): static = 2 params + optimizer; activations per micro-batch.
        params = np.concatenate(([0], np.cumsum([layer.param_bytes for layer in profile.layers])))
        optimizer = np.concatenate(([0], np.cumsum([layer.optimizer_bytes for layer in profile.layers])))
        self.static = (2 * params + optimizer).astype(np.int64)
        self.activation = np.concatenate(
            ([0], np.cumsum([layer.activation_bytes for layer in profile.layers]))
        ).astype(np.int64)
        gpu_counts = np.arange(1, gpus_per_node + 1)
        offsets = np.arange(self.positions) % gpus_per_node
        # A stage of d GPUs may start at GPU position a only if it stays inside a's node.
        self.valid: BoolArray = (offsets[None, :] + gpu_counts[:, None] <= gpus_per_node) & (
            np.arange(self.positions)[None, :] + gpu_counts[:, None] <= self.positions - 1
        )
        self._memory_cache: dict[int, IntArray] = {}
        self._nodes: NodeSearch | None = None  # the node-level fast path, built on first use
        levels = max(1, int(np.floor(np.log2(layers))) + 1)
        self._levels = levels
        self._log2 = np.zeros(layers + 2, dtype=np.int64)
        for length in range(2, layers + 2):
            self._log2[length] = self._log2[length // 2] + 1

    # ---- admissible end layers -------------------------------------------------------------------------
    def memory_limit(self, remaining: int) -> IntArray:
        """[d-1, u]: last end layer v with stage [u, v) on d GPUs within memory, `remaining` stages left."""
        cached = self._memory_cache.get(remaining)
        if cached is not None:
            return cached
        prefix = self.static + remaining * self.activation
        # stage_peak_memory floors (static + r * act) / d; that is <= memory iff the bytes < (memory + 1) d.
        budget = (self.memory + 1) * np.arange(1, self.gpus + 1, dtype=np.int64) - 1
        limit = np.searchsorted(prefix, prefix[None, :-1] + budget[:, None], side="right") - 1
        limit = limit.astype(np.int64)
        self._memory_cache[remaining] = limit
        return limit

    def time_limit(self, cap: float) -> IntArray:
        """[d-1, u]: last end layer v with t(u, v, d) <= cap (u itself when none)."""
        counts: IntArray = np.count_nonzero(self.times[:, :-1, :] <= cap, axis=2).astype(np.int64)
        return counts - 1

    # ---- passes ----------------------------------------------------------------------------------------
    def sum_pass(self, cap: float, stages: int) -> list[FloatArray]:
        """tables[r][a, u]: least sum of stage times covering GPUs [a, end) and layers [u, L) with r stages,
        each at most `cap` and within memory; inf where impossible."""
        gpus, positions, layers = self.gpus, self.positions, self.layers
        first = np.full((positions, layers + 1), np.inf)
        first[positions - 1, layers] = 0.0
        tables = [first]
        cap_limit = self.time_limit(cap)
        low = np.arange(1, layers + 1)
        d_index = np.arange(gpus)[:, None, None]
        a_index = np.arange(positions)[None, :, None]
        inf_rows = np.full((gpus, layers + 1), np.inf)
        for remaining in range(1, stages + 1):
            high = np.minimum(cap_limit, self.memory_limit(remaining))
            padded = np.vstack((tables[-1], inf_rows))
            values = np.stack([padded[d : d + positions] for d in range(1, gpus + 1)])
            values += self.scaled_prefix[:, None, :]
            values[~self.valid] = np.inf
            table = self._sparse_table(values)
            usable = high >= low[None, :]
            length = np.where(usable, high - low[None, :] + 1, 1)
            level = self._log2[length]
            left = np.where(usable, low[None, :], 0)
            right = np.where(usable, high - (1 << level) + 1, 0)
            level3, left3, right3 = level[:, None, :], left[:, None, :], right[:, None, :]
            best = np.minimum(table[level3, d_index, a_index, left3], table[level3, d_index, a_index, right3])
            best -= self.scaled_prefix[:, None, :-1]
            best[np.broadcast_to(~usable[:, None, :], best.shape)] = np.inf
            current = np.full((positions, layers + 1), np.inf)
            current[:, :-1] = best.min(axis=0)
            tables.append(current)
        return tables

    def _sparse_table(self, values: FloatArray) -> FloatArray:
        table = np.empty((self._levels, *values.shape))
        table[0] = values
        for level in range(1, self._levels):
            step = 1 << (level - 1)
            previous = table[level - 1]
            table[level] = previous
            np.minimum(previous[..., :-step], previous[..., step:], out=table[level][..., :-step])
        return table

    def feasible_pass(self, caps: Sequence[float], stages: int) -> BoolArray:
        """[b, r, n']: whether a template of n' nodes has an r-stage mapping with every stage <= caps[b].

        Several caps share one pass so that the search for the smallest feasible cap pays numpy's per-call
        overhead once per round rather than once per probe."""
        gpus, positions, layers = self.gpus, self.positions, self.layers
        cap_array = np.asarray(caps, dtype=np.float64)
        batch = len(cap_array)
        reach = np.zeros((batch, positions, layers + 1), dtype=bool)
        reach[:, positions - 1, layers] = True
        starts = (self.max_nodes - np.arange(self.max_nodes + 1)) * gpus
        result = np.zeros((batch, stages + 1, self.max_nodes + 1), dtype=bool)
        result[:, 0] = reach[:, starts, 0]
        fits = self.times[None, :, :-1, :] <= cap_array[:, None, None, None]
        cap_limit = (np.count_nonzero(fits, axis=3) - 1).astype(np.int64)  # (b, d, u)
        columns = np.arange(layers + 1)
        beyond = layers + 1
        false_rows = np.zeros((batch, gpus, layers + 1), dtype=bool)
        for remaining in range(1, stages + 1):
            high = np.minimum(cap_limit, self.memory_limit(remaining)[None])
            padded = np.concatenate((reach, false_rows), axis=1)
            values = np.stack([padded[:, d : d + positions] for d in range(1, gpus + 1)], axis=1)
            values &= self.valid[None, :, :, None]
            # nearest[..., v]: first reachable end layer >= v; the window (u, high] holds one iff
            # nearest[u + 1] <= high, which needs no gather.
            nearest = np.where(values, columns, beyond)[..., ::-1]
            nearest = np.minimum.accumulate(nearest, axis=3)[..., ::-1]
            hits = nearest[..., 1:] <= high[:, :, None, :]
            reach = np.zeros((batch, positions, layers + 1), dtype=bool)
            reach[:, :, :-1] = hits.any(axis=1)
            result[:, remaining] = reach[:, starts, 0]
        return result

    # ---- reconstruction --------------------------------------------------------------------------------
    def reconstruct(self, tables: list[FloatArray], cap: float, nodes: int, stages: int) -> Mapping:
        """Walk a sum pass's tables forward from the template's first GPU to recover one optimal mapping."""
        position = (self.max_nodes - nodes) * self.gpus
        start_position = position
        layer = 0
        cap_limit = self.time_limit(cap)
        chosen: list[MappedStage] = []
        times: list[float] = []
        for remaining in range(stages, 0, -1):
            memory_limit = self.memory_limit(remaining)
            following = tables[remaining - 1]
            best: tuple[float, int, int] | None = None
            for d in range(1, self.gpus + 1):
                if not self.valid[d - 1, position]:
                    continue
                high = min(int(cap_limit[d - 1, layer]), int(memory_limit[d - 1, layer]))
                if high <= layer:
                    continue
                ends = np.arange(layer + 1, high + 1)
                totals = self.times[d - 1, layer, ends] + following[position + d, ends]
                index = int(np.argmin(totals))
                if best is None or totals[index] < best[0]:
                    best = (float(totals[index]), d, int(ends[index]))
            if best is None or not np.isfinite(best[0]):
                raise PlannerError("nodes", f"no mapping of {stages} stages on {nodes} nodes")
            _, d, end = best
            offset = position - start_position
            chosen.append(MappedStage(layer, end, offset // self.gpus, offset % self.gpus, d))
            times.append(float(self.times[d - 1, layer, end]))
            position += d
            layer = end
        return Mapping(nodes, tuple(chosen), mapping_objective(times), max(times), float(sum(times)))

    # ---- search ----------------------------------------------------------------------------------------
    def speedup_budget(self, nodes: int) -> FloatArray:
        """[S]: the largest sum of speed-ups over S stages on `nodes` full nodes. Since the work W equals
        sum_k t_k * speedup(d_k) <= max_k t_k * that sum, W / budget[S] bounds the slowest stage below."""
        gpus = self.gpus
        split = np.full((gpus + 1, gpus + 1), -np.inf)  # split[s, g]: s stages sharing g GPUs
        split[0, 0] = 0.0
        for count in range(1, gpus + 1):
            for used in range(count, gpus + 1):
                split[count, used] = max(
                    split[count - 1, used - d] + self.speedups[d - 1] for d in range(1, used + 1)
                )
        per_node = split[:, gpus]  # per_node[0] = -inf: every node hosts a stage
        top = nodes * gpus
        chain = np.full(top + 1, -np.inf)
        chain[0] = 0.0
        for _ in range(nodes):
            shifted = np.full((gpus, top + 1), -np.inf)
            for here in range(1, gpus + 1):
                shifted[here - 1, here:] = chain[: top + 1 - here] + per_node[here]
            chain = shifted.max(axis=0)
        return chain

    def best(self, nodes: int) -> Mapping | None:
        """The mapping of a `nodes`-node template minimising J, or None if no mapping fits memory."""
        if not 1 <= nodes <= self.max_nodes:
            raise PlannerError("nodes", f"template size must be in [1, {self.max_nodes}], got {nodes}")
        top = min(self.layers, nodes * self.gpus)
        if nodes > top:
            return None
        if self._nodes is None:
            self._nodes = NodeSearch(self)
        decided, found = self._nodes.best(nodes)
        if decided:
            return found
        return self.best_by_stage_count(nodes)

    def best_by_stage_count(self, nodes: int) -> Mapping | None:
        """The stage-count DP search (exact with memory that depends on r); `best` falls back to it."""
        top = min(self.layers, nodes * self.gpus)
        if not 1 <= nodes <= top:
            return None
        sum_floor = self.work / float(self.speedups.max())
        single = self.times[:, np.arange(self.layers), np.arange(1, self.layers + 1)]
        largest_layer = float(single.min(axis=0).max())
        budget = self.speedup_budget(nodes)
        bounds: list[tuple[float, int, float]] = []
        for stages in range(nodes, top + 1):
            capacity = float(budget[stages])
            cap_floor = max(self.work / capacity if capacity > 0 else 0.0, largest_layer)
            bounds.append(((4 * stages - 1) * cap_floor + sum_floor, stages, cap_floor))
        bounds.sort()
        best: Mapping | None = None
        for bound, stages, cap_floor in bounds:
            if best is not None and bound >= best.objective:
                break
            found = self._best_for_stages(nodes, stages, cap_floor, sum_floor, best)
            if found is not None and (best is None or found.objective < best.objective):
                best = found
        return best

    def _probe_width(self, stages: int) -> int:
        """Caps per feasibility pass: many while arrays are small (overhead-bound), one when large."""
        cells = self.gpus * self.positions * (self.layers + 2)
        return int(max(1, min(8, 400_000 // cells)))

    def _smallest_cap(self, nodes: int, stages: int, low: int, high: int, known: bool) -> int | None:
        """Index of the smallest candidate cap in [low, high] admitting a mapping (k-ary search), or None.
        `known` says whether `high` is already known to be feasible."""
        width = self._probe_width(stages)
        found = high if known else None
        upper = high if known else high + 1  # exclusive bound of the indices still to probe
        while low < upper:
            span = upper - low
            probes = sorted({low + (span * j) // (width + 1) for j in range(width + 1)})
            if not known and upper - 1 not in probes:
                probes[-1:] = sorted({probes[-1], upper - 1})
            probes = [p for p in probes if low <= p < upper]
            flags = self.feasible_pass([float(self.candidates[p]) for p in probes], stages)[:, stages, nodes]
            first = next((j for j, flag in enumerate(flags) if flag), None)
            if first is None:
                if not known:
                    return None
                low = probes[-1] + 1
            else:
                known = True
                found = upper = probes[first]
                low = probes[first - 1] + 1 if first > 0 else low
        return found

    def _best_for_stages(
        self, nodes: int, stages: int, cap_floor: float, sum_floor: float, incumbent: Mapping | None
    ) -> Mapping | None:
        candidates = self.candidates
        weight = 4 * stages - 1
        start = (self.max_nodes - nodes) * self.gpus
        # No cap above (best - least possible sum) / weight can beat the incumbent.
        limit = np.inf if incumbent is None else (incumbent.objective - sum_floor) / weight
        high = int(np.searchsorted(candidates, limit, side="right")) - 1
        low = int(np.searchsorted(candidates, cap_floor * (1 - 1e-12), side="left"))
        if high < low:
            return None
        # The uncapped least sum: an exact floor for every cap, and a first solution.
        uncapped = self.sum_pass(np.inf, stages)
        floor = float(uncapped[stages][start, 0])
        if not np.isfinite(floor):
            return None
        best = self.reconstruct(uncapped, np.inf, nodes, stages)
        best_value = best.objective if incumbent is None else min(best.objective, incumbent.objective)
        known_index = int(np.searchsorted(candidates, best.bottleneck_s, side="left"))
        limit_index = int(np.searchsorted(candidates, (best_value - floor) / weight, side="right")) - 1
        high = min(high, known_index, limit_index)
        if high < low:
            return best
        found_low = self._smallest_cap(nodes, stages, low, high, known=high == known_index)
        if found_low is None:
            return best
        low = found_low
        c_min = float(candidates[low])
        at_min = self.reconstruct(self.sum_pass(c_min, stages), c_min, nodes, stages)
        if at_min.objective < best.objective:
            best = at_min
        best_value = min(best_value, best.objective)
        index = int(np.searchsorted(candidates, (best_value - floor) / weight, side="right")) - 1
        while index > low:  # walk caps downward; MinSum is constant between a solution's max and its cap
            cap = float(candidates[index])
            tables = self.sum_pass(cap, stages)
            total = float(tables[stages][start, 0])
            if weight * c_min + total >= best_value:
                break  # lower caps only raise the sum
            found = self.reconstruct(tables, cap, nodes, stages)
            if found.objective < best.objective:
                best = found
                best_value = min(best_value, found.objective)
            limit_index = int(np.searchsorted(candidates, (best_value - floor) / weight, side="right")) - 1
            below = int(np.searchsorted(candidates, found.bottleneck_s, side="left")) - 1
            index = min(limit_index, below)
        return best
