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

HEAVY = ("torch.distributed.tensor", "torch.distributed.checkpoint", "scipy.optimize")


def _loaded_after(code: str) -> list[str]:
    probe = f"import json, sys\n{code}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    loaded: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return loaded


def test_an_agent_and_its_workers_start_without_tensor_parallel_or_checkpoint_modules() -> None:
    assert _loaded_after("from resilientjob.agent import _bridge\n_bridge.preload()") == []


def test_a_checkpointer_loads_dcp_as_it_is_made_so_no_step_waits_for_the_import(tmp_path: Path) -> None:
    code = (
        "from resilientjob.agent._bridge import preload\npreload()\n"
        "from resilientjob.agent.checkpoint import Checkpointer\n"
        f"Checkpointer({str(tmp_path)!r}, interval=10)"
    )
    assert _loaded_after(code) == ["torch.distributed.tensor", "torch.distributed.checkpoint"]


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
