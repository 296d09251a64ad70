"""What a process loads at start, where every start counts: a pod's agent before its first heartbeat
(`_bridge.preload`, which its forked workers inherit) loads no tensor-parallel or checkpoint machinery unless
the job uses it (`torch.distributed.checkpoint`, which loads `torch.distributed.tensor`, was 1.1 s of the
3.8 s of CPU each agent spent importing, replacement pods included); the planner package, which every `rjob`
command and pod imports, loads no `scipy.optimize` (0.4 s) until a replan matches or the operator warms up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HEAVY = ("torch.distributed.tensor", "torch.distributed.checkpoint", "scipy.optimize")


def _loaded_after(code: str, lines: int = 1) -> Any:
    """The heavy modules loaded once `code` ran in a fresh interpreter; with `lines` > 1, a list of the
    lists `code` printed before that as well."""
    probe = f"import json, sys\n{code}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    printed = [json.loads(line) for line in done.stdout.strip().splitlines()[-lines:]]
    return printed if lines > 1 else printed[0]


def test_an_agent_starts_without_tensor_parallel_or_checkpoint_modules_and_a_checkpointer_loads_dcp(
    tmp_path: Path,
) -> None:
    # One interpreter for both: what preload leaves, then what making a Checkpointer adds (at the worker's
    # start, so that no training step waits for the import).
    code = (
        "from resilientjob.agent import _bridge\n_bridge.preload()\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
        "from resilientjob.agent.checkpoint import Checkpointer\n"
        f"Checkpointer({str(tmp_path)!r}, interval=10)"
    )
    preloaded, checkpointing = _loaded_after(code, lines=2)
    assert preloaded == []
    assert checkpointing == ["torch.distributed.tensor", "torch.distributed.checkpoint"]


def test_the_planner_loads_its_matching_solver_at_the_operators_warm_up_not_at_import() -> None:
    code = "import resilientjob.planner, resilientjob.cli._common"
    assert _loaded_after(code) == []
    warm = (
        "from resilientjob.planner import ClusterSpec, JobSpec, ModelProfile\n"
        "from resilientjob.planner.search import warm_up\n"
        "job = JobSpec(global_batch=8, microbatch_size=1)\n"
        "warm_up(ModelProfile.load('bert-large'), ClusterSpec(nodes=4), job)"
    )
    assert _loaded_after(warm) == ["scipy.optimize"]


def test_the_chaos_commands_write_and_clear_an_order_without_torch() -> None:
    # `rjob chaos slow|clear` and `rjob local chaos slow|clear` import what they run inside the command: the
    # order's writers must not pull in the agent's injector (torch.distributed, ~2 s of CPU per command).
    probe = (
        "import sys, time\n"
        "import resilientjob.cli._chaos, resilientjob.cli._local\n"
        "from resilientjob.protocol.chaos import ChaosOrder, clear_order, write_order\n"
        "from resilientjob.protocol.keys import JobKeys\n"
        "class Store:\n"
        "    def set(self, name, value, *, px): self.kept = (name, value, px)\n"
        "    def delete(self, *names): return len(names)\n"
        "store, keys = Store(), JobKeys('default', 'job')\n"
        "write_order(store, keys, 3, ChaosOrder(factor=2.0, until=time.time() + 30))\n"
        "assert store.kept[0] == keys.chaos(3) and 30_000 < store.kept[2] <= 90_000, store.kept\n"
        "assert clear_order(store, keys, 3)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('resilientjob.agent')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]"
