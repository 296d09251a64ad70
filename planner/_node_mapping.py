"""Node-level exact search for one template's GPU-stage mapping: the fast path behind `_stage_mapping`.

Nodes are identical and a stage never spans two of them, so a pipeline is a chain of node blocks: a node
covers layers [u, w) with one or more stages that split its G GPUs. Two things make a block independent of
where it sits in the pipeline:

- Memory. A stage's 1F1B peak grows with r, the number of stages from it to the end. At a cap c where no
  stage at most c is cut by memory differently at r = 1 and at r = R (the most stages the template can
  have), memory is the same for every r. The search checks this at the largest cap it will look at and
  otherwise hands the template back to the stage-count DP in `_stage_mapping`, which is exact for any r.
- The stage count. J = sum t + (4S - 1) max t needs S, but every mapping whose slowest stage lies in
  [lo, hi] has J >= sum_k (t_k + 4 lo) - lo: a per-stage toll that a shortest path over layers carries
  without counting stages.

A pass is (min, +) or (min, max) algebra over layer boundaries, kept as diagonal bands because a cap limits
how many layers a stage can hold: A_o[u, k], the best cover of [u, u + k) by stages on o GPUs of one node
(A_o = min_d A_{o-d} * T_d), then n vector-matrix products for a template of n nodes. The search:

1. Incumbent: one full-node stage per node (S = n), the exact min-max layer split with each stage's own
   memory (sum t is then fixed). It is optimal in most clusters and sets the band width of what follows.
2. The smallest feasible cap c_min over every mapping: one (min, max) pass, no binary search.
3. Caps above (incumbent - least sum) / (4n - 1) cannot win; if none is left above c_min, done. Otherwise
   branch and bound over index intervals [i, j] of the sorted stage times: the pass with cap C[j] and toll
   4 C[i] bounds every mapping whose slowest stage lies in the interval, and its own mapping (slowest stage
   C[k]) updates the incumbent. An interval is dropped once its bound reaches the incumbent, else split at
   k (or halved) so that the part holding that mapping gets the tighter floor C[k].

Every dropped interval provably holds nothing better, so the result is the exact optimum of J.
"""

from __future__ import annotations

import heapq

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import as_strided

from ._mapping import FloatArray, MappedStage, Mapping, StageTables, mapping_objective

# Cells of the skewed buffer below which a (min, +) step is one vectorised op per GPU count instead of one
# per stage length: fewer numpy calls on small models, bounded memory (32 MB) on large ones.
_SKEW_CELLS = 4_000_000

# A bound within this factor of the incumbent counts as reaching it: objectives are float sums, and two caps
# one rounding apart (the same stage length computed from different prefix sums) must not cost a pass each.
# The result is thus optimal to 1e-12 relative, far below the estimator's own rounding.
_SAME = 1.0 - 1e-12


class _Pass:
    """One (min, +) or (min, max) pass at a cap and toll: per-node bands and the chain over nodes."""

    def __init__(self, blocks: FloatArray, stages: FloatArray, bottleneck: bool) -> None:
        self.blocks = blocks  # [o, u, k]: layers [u, u + k) on o GPUs of one node
        self.stages = stages  # [d - 1, u, j]: one stage [u, u + j) on d GPUs (rows padded with inf)
        self.bottleneck = bottleneck
        layers, width = blocks.shape[1] - 1, blocks.shape[2] - 1
        rows = np.arange(layers + 1)[:, None]
        columns = rows + np.arange(width + 1)[None, :]
        inside = columns <= layers
        node = np.full((layers + 1, layers + 1), np.inf)
        node[np.broadcast_to(rows, columns.shape)[inside], columns[inside]] = blocks[-1][inside]
        self.node: FloatArray = node  # dense [u, w] of the whole-node block, for the chain
        start = np.full(layers + 1, np.inf)
        start[0] = -np.inf if bottleneck else 0.0
        self.vectors: list[FloatArray] = [start]

    def combine(self, left: FloatArray, right: FloatArray) -> FloatArray:
        return np.maximum(left, right) if self.bottleneck else left + right

    def chain(self, nodes: int) -> FloatArray:
        """[w]: least cost of layers [0, w) on `nodes` whole nodes (earlier counts are kept for reuse)."""
        while len(self.vectors) <= nodes:
            self.vectors.append(self.combine(self.vectors[-1][:, None], self.node).min(axis=0))
        return self.vectors[nodes]

    def value(self, nodes: int) -> float:
        return float(self.chain(nodes)[-1])

    def reconstruct(self, nodes: int, times: FloatArray) -> Mapping:
        """One mapping attaining value(nodes): walk back node by node, then stage by stage in a node."""
        layers, gpus = self.node.shape[0] - 1, self.blocks.shape[0] - 1
        width, reach = self.blocks.shape[2] - 1, self.stages.shape[2] - 1
        self.chain(nodes)
        chosen: list[MappedStage] = []
        end = layers
        for node in range(nodes - 1, -1, -1):
            start = int(np.argmin(self.combine(self.vectors[node], self.node[:, end])))
            right, free = end, gpus
            while free > 0:  # the node's last stage sits on its last GPUs
                lefts = np.arange(max(start, right - reach), min(right, start + width + 1))
                counts = np.arange(1, free + 1)[:, None]
                options = self.combine(
                    self.blocks[free - counts, start, lefts[None, :] - start],
                    self.stages[counts - 1, lefts[None, :], right - lefts[None, :]],
                )
                d_index, at = np.unravel_index(int(np.argmin(options)), options.shape)
                d, left = int(d_index) + 1, int(lefts[at])
                chosen.append(MappedStage(left, right, node, free - d, d))
                right, free = left, free - d
            end = start
        chosen.reverse()
        stage_times = [float(times[s.gpus - 1, s.start, s.end]) for s in chosen]
        return Mapping(
            nodes, tuple(chosen), mapping_objective(stage_times), max(stage_times), float(sum(stage_times))
        )


class NodeSearch:
    """Exact search through node blocks for one `StageMapper`; passes are cached across template sizes."""

    def __init__(self, mapper: StageTables) -> None:
        self.mapper = mapper
        gpus, layers = mapper.gpus, mapper.layers
        # band[d-1, u, j]: stage [u, u + j) on d GPUs within memory at r = 1; inf for j = 0, beyond the last
        # layer and on the L padding rows that let a sliding window read T[u + k, j] for every k <= L.
        loose = mapper.memory_limit(1)
        band = np.full((gpus, 2 * layers + 1, layers + 1), np.inf)
        for u in range(layers):
            span = layers - u
            ends = np.arange(u + 1, layers + 1)
            allowed = ends[None, :] <= loose[:, u, None]
            band[:, u, 1 : span + 1] = np.where(allowed, mapper.times[:, u, u + 1 :], np.inf)
        self.band: FloatArray = band
        # Some stage holds the slowest layer, at best on the GPU count that runs it fastest.
        single = mapper.times[:, np.arange(layers), np.arange(1, layers + 1)]
        self.slowest_layer = float(single.min(axis=0).max())
        self._passes: dict[tuple[bool, float, float], _Pass] = {}

    def run(self, bottleneck: bool, cap: float, toll: float) -> _Pass:
        """The pass for stages at most `cap`, each costing its time plus `toll` (sum) or its time (max)."""
        key = (bottleneck, cap, toll)
        found = self._passes.get(key)
        if found is not None:
            return found
        gpus, layers = self.mapper.gpus, self.mapper.layers
        allowed = self.band <= cap
        # lengths[d - 1, j]: some stage of j layers on d GPUs fits under the cap.
        lengths: npt.NDArray[np.bool_] = np.asarray(allowed.any(axis=1))
        reaches = [int(np.max(np.nonzero(lengths[d])[0], initial=0)) for d in range(gpus)]
        reach = max(reaches)
        stages = np.where(allowed[:, :, : reach + 1], self.band[:, :, : reach + 1], np.inf)
        if not bottleneck and toll:
            stages += toll
        # The most layers one node can cover: a knapsack of per-GPU-count reaches (bands stay this narrow).
        span = [0] * (gpus + 1)
        for used in range(1, gpus + 1):
            span[used] = max(span[used - d] + reaches[d - 1] for d in range(1, used + 1))
        width = min(layers, max(span))
        blocks = np.full((gpus + 1, layers + 1, width + 1), np.inf)
        blocks[0, :, 0] = -np.inf if bottleneck else 0.0
        # windows[d, u, k, j] = T_d[u + k, j]: the stage of j layers that follows a cover of [u, u + k).
        step_d, step_u, step_j = stages.strides
        windows = as_strided(
            stages,
            shape=(gpus, layers + 1, width + 1, reach + 1),
            strides=(step_d, step_u, step_u, step_j),
            writeable=False,
        )
        combine = np.maximum if bottleneck else np.add
        skewed = (layers + 1) * (width + 1) * (width + reach + 1) <= _SKEW_CELLS
        if skewed:
            # shifted[u, k, k + j] holds cover [u, u + k) followed by a stage of j layers, so a min over k
            # gives every end u + k + j at once.
            buffer = np.full((layers + 1, width + 1, width + reach + 1), np.inf)
            b_u, b_k, b_m = buffer.strides
            shifted = as_strided(
                buffer, shape=(layers + 1, width + 1, reach + 1), strides=(b_u, b_k + b_m, b_m)
            )
        for used in range(1, gpus + 1):
            before = blocks[used - 1 :: -1] if used > 1 else blocks[:1]  # A_{used-d}, d = 1..used
            if skewed:
                shifted[...] = combine(before[:, :, :, None], windows[:used]).min(axis=0)
                blocks[used] = buffer[:, :, : width + 1].min(axis=1)
                continue
            product = np.full((layers + 1, width + reach + 1), np.inf)
            for j in range(1, reach + 1):
                target = product[:, j : j + width + 1]
                np.minimum(target, combine(before, windows[:used, :, :, j]).min(axis=0), out=target)
            blocks[used] = product[:, : width + 1]
        made = _Pass(blocks, stages, bottleneck)
        self._passes[key] = made
        return made

    # ---- search --------------------------------------------------------------------------------------------
    def memory_free(self, cap: float, nodes: int) -> bool:
        """Whether memory admits the same stages at every stage count r <= R once stages are capped at `cap`
        (then r = 1, which the passes use, is exact)."""
        mapper = self.mapper
        most = min(mapper.layers, nodes * mapper.gpus)
        tight, loose = mapper.memory_limit(most), mapper.memory_limit(1)
        return bool(np.all((mapper.time_limit(cap) <= tight) | (tight == loose)))

    def one_stage_per_node(self, nodes: int) -> Mapping | None:
        """The best mapping with one full-node stage per node: min-max split, each stage's exact memory."""
        mapper = self.mapper
        gpus, layers = mapper.gpus, mapper.layers
        ends = np.arange(layers + 1)
        full = mapper.times[gpus - 1]
        matrices = []
        vector = np.full(layers + 1, np.inf)
        vector[0] = -np.inf
        vectors = [vector]
        for node in range(nodes):
            limit = mapper.memory_limit(nodes - node)[gpus - 1]
            matrix = np.full((layers + 1, layers + 1), np.inf)
            matrix[:-1] = np.where(
                (ends[None, :] <= limit[:, None]) & (ends[None, :] > ends[:-1, None]), full[:-1], np.inf
            )
            matrices.append(matrix)
            vector = np.maximum(vector[:, None], matrix).min(axis=0)
            vectors.append(vector)
        if not np.isfinite(vector[-1]):
            return None
        chosen: list[MappedStage] = []
        end = layers
        for node in range(nodes - 1, -1, -1):
            start = int(np.argmin(np.maximum(vectors[node], matrices[node][:, end])))
            chosen.append(MappedStage(start, end, node, 0, gpus))
            end = start
        chosen.reverse()
        stage_times = [float(full[s.start, s.end]) for s in chosen]
        return Mapping(
            nodes, tuple(chosen), mapping_objective(stage_times), max(stage_times), float(sum(stage_times))
        )

    def fewest_stages(self, nodes: int, sum_floor: float, incumbent: Mapping | None) -> int | None:
        """The least S > n whose lower bound (4S - 1) max(W / most speed-up of S stages, slowest layer) +
        least sum is below the incumbent, or None when there is none."""
        mapper = self.mapper
        most = min(mapper.layers, nodes * mapper.gpus)
        if incumbent is None:
            return nodes + 1 if most > nodes else None
        budget = mapper.speedup_budget(nodes)[nodes + 1 : most + 1]
        counts = np.arange(nodes + 1, most + 1)
        with np.errstate(divide="ignore"):
            slowest = np.maximum(mapper.work / budget, self.slowest_layer)
        below = np.nonzero((4 * counts - 1) * slowest + sum_floor < incumbent.objective * _SAME)[0]
        return int(counts[below[0]]) if below.size else None

    def best(self, nodes: int) -> tuple[bool, Mapping | None]:
        """(True, the exact optimum or None if nothing fits) for a `nodes`-node template, or (False, None)
        when memory binds differently per stage count at the caps that matter (the caller then runs the
        stage-count DP)."""
        mapper, candidates = self.mapper, self.mapper.candidates
        incumbent = self.one_stage_per_node(nodes)  # exact over S = n: one stage per node is all G GPUs
        sum_floor = mapper.work / float(mapper.speedups.max())
        fewest = self.fewest_stages(nodes, sum_floor, incumbent)
        if fewest is None:
            return True, incumbent  # no stage count above n can beat it
        weight = 4 * fewest - 1  # every mapping still in play has at least `fewest` stages

        def top_index(best: Mapping | None) -> int:
            if best is None:
                return len(candidates) - 1
            return int(np.searchsorted(candidates, (best.objective - sum_floor) / weight, side="right")) - 1

        high = top_index(incumbent)
        if high < 0:
            return True, incumbent
        c_min = self.run(True, float(candidates[high]), 0.0).value(nodes)
        if not np.isfinite(c_min):
            return True, incumbent  # nothing fits below the useful caps, even with r = 1 memory
        if incumbent is None:
            if not self.memory_free(c_min, nodes):
                return False, None
            incumbent = self.run(False, c_min, 4 * c_min).reconstruct(nodes, mapper.times)
            high = top_index(incumbent)
        low = int(np.searchsorted(candidates, c_min, side="left"))
        if high < low:
            return True, incumbent  # every mapping's slowest stage is too slow to beat it
        if not self.memory_free(float(candidates[high]), nodes):
            return False, None
        heap: list[tuple[float, int, int]] = [(sum_floor + weight * float(candidates[low]), low, high)]
        while heap:
            parent, i, j = heapq.heappop(heap)
            if parent >= incumbent.objective * _SAME:
                break
            j = min(j, top_index(incumbent))
            if j < i:
                continue
            floor = float(candidates[i])
            run = self.run(False, float(candidates[j]), 4 * floor)
            bound = run.value(nodes) - floor
            if not np.isfinite(bound):
                continue  # nothing fits below C[j]: every cap in the interval is infeasible
            if bound >= incumbent.objective * _SAME:
                continue  # its own mapping has J >= bound too
            found = run.reconstruct(nodes, mapper.times)
            if found.objective < incumbent.objective:
                incumbent = found
            if i == j:
                continue  # exact at one cap: J(found) <= F(C[i]) = bound
            split = int(np.searchsorted(candidates, found.bottleneck_s, side="left"))
            if not i < split <= j:
                split = (i + j + 1) // 2
            # A mapping whose slowest stage is C[split] or more has J >= sum + (4S - 1) C[i] + (4S - 1)
            # (C[split] - C[i]) >= bound + weight (C[split] - C[i]): the upper part inherits that floor.
            heapq.heappush(heap, (bound, i, split - 1))
            heapq.heappush(heap, (bound + weight * (float(candidates[split]) - floor), split, j))
        return True, incumbent
