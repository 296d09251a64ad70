"""resilientjob.testing: the test harness, for tests and benchmarks only (never shipped, never imported by the
product).

A miniature control plane on one machine (`Launcher`: torch elastic process contexts, one per node, and the
job's TCPStore), the runtime's planning bound to one job (`RuntimePlanner`), fault injection (`CrashAt`, what
`Launcher(fail_at={node: step})` uses) and the failure-free reference a resilient run must match
(`reference_run`). Installed from `testing/` as its own distribution, `resilientjob-testing` (`make
bootstrap` does it, editable); `pip install resilientjob` does not contain it.
"""

from .faults import FAILURE_EXIT_CODE, CrashAt
from .launcher import JobResult, Launcher, NodeAgent, Recovery
from .plans import LOCAL_COSTS, RuntimePlanner
from .reference import reference_run

__all__ = [
    "FAILURE_EXIT_CODE",
    "LOCAL_COSTS",
    "CrashAt",
    "JobResult",
    "Launcher",
    "NodeAgent",
    "Recovery",
    "RuntimePlanner",
    "reference_run",
]
