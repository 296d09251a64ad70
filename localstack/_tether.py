"""The local stack's processes end with the process that started them, however it ends.

In a cluster a pod's processes live in its container and the kubelet outlives them; here they are children of
one Python process (the `rjob local up` supervisor, or a test run). Killed with SIGKILL, it could run no
clean-up, and redis-server, the operator and every pod's agent went on as orphans, holding ports and CPU. So
each child is started through a short prologue that asks the kernel for SIGKILL when its parent dies
(`PR_SET_PDEATHSIG`, kept across `exec`) and then `exec`s the real command: the same pid, nothing left
running in between. Linux only; elsewhere the command runs as given.
"""

from __future__ import annotations

import os
import sys

_PROLOGUE = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    os._exit(137)  # the parent died before the request took effect
os.execvp(sys.argv[2], sys.argv[2:])
"""


def tethered(command: list[str]) -> list[str]:
    """`command`, to be started by this process (on its current thread: the kernel ties the signal to the
    creating thread) and killed when this process dies."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-c", _PROLOGUE, str(os.getpid()), *command]
