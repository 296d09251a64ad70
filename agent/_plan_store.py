"""The plans as the job's store holds them (`store_keys`: `generation`, `plan/<g>`): read by the worker's loop
and by its final export, which the worker module imports."""

from __future__ import annotations

from torch._C._distributed_c10d import Store

from resilientjob.planner.plan import Plan
from resilientjob.protocol.store_keys import GENERATION_KEY, plan_key


def read_generation(store: Store) -> int:
    """The newest published plan generation."""
    return int(store.add(GENERATION_KEY, 0))


def read_plan(store: Store, generation: int) -> Plan:
    """The plan of `generation`."""
    return Plan.model_validate_json(store.get(plan_key(generation)))
