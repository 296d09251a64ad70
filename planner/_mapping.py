"""What the two halves of the template mapping share: the mapping types, the objective J, and the stage
tables (`StageTables`) that the node-level search (`_node_mapping`) reads from the stage-count search
(`_stage_mapping.StageMapper`), so that neither module imports the other."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class MappedStage:
    """Layers [start, end) on GPUs first_gpu .. first_gpu + gpus - 1 of template node `node`."""

    start: int
    end: int
    node: int
    first_gpu: int
    gpus: int


@dataclass(frozen=True, slots=True)
class Mapping:
    """The optimal mapping of one template size and the objective terms that rank it."""

    nodes: int
    stages: tuple[MappedStage, ...]
    objective: float
    bottleneck_s: float
    sum_s: float

    @property
    def num_stages(self) -> int:
        return len(self.stages)


def mapping_objective(stage_times: Sequence[float]) -> float:
    """J = sum t + (4S - 1) max t: the iteration-time objective every template minimises."""
    count = len(stage_times)
    return float(sum(stage_times) + (4 * count - 1) * max(stage_times))


class StageTables(Protocol):
    """The precomputed stage times and limits of one model on one node shape (`StageMapper` provides them)."""

    gpus: int
    """GPUs per node."""
    layers: int
    """Layers of the model."""
    times: FloatArray
    """[d-1, u, v]: time of stage [u, v) on d GPUs (-inf for v <= u)."""
    candidates: FloatArray
    """Every distinct admissible stage time, sorted."""
    speedups: FloatArray
    """[d-1]: speed-up of a stage on d GPUs over one GPU."""
    work: float
    """Forward plus backward time of the whole model on one GPU."""

    def memory_limit(self, remaining: int) -> IntArray:
        """[d-1, u]: last end layer v with stage [u, v) on d GPUs within memory, `remaining` stages left."""
        ...

    def time_limit(self, cap: float) -> IntArray:
        """[d-1, u]: last end layer v with t(u, v, d) <= cap (u itself when none)."""
        ...

    def speedup_budget(self, nodes: int) -> FloatArray:
        """[S]: the largest sum of speed-ups over S stages on `nodes` full nodes (bounds the slowest)."""
        ...
