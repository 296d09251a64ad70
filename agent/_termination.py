"""A worker that stops because of the job's spec says so in its pod's termination message, so that the
operator fails the job naming the field instead of replacing node after node.

Node 0's pre-flight finds what it can before the first step (`_model_profile`), but some of it only shows
while training: a token beyond the model's vocabulary on a sample the pre-flight did not read, an output
directory that became unwritable. Such an error kills every worker that meets it; read as a node failure,
it was replanned, the replacements died the same way, and the one line that said what to fix sat in a
traceback in each pod's log. Kubernetes keeps the last words of a container (`/dev/termination-log`, up to
4 KiB) in its status; the agent writes the error's line there and the operator reads it
(`operator._decide.workload_error`).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from pathlib import Path

from resilientjob.protocol.messages import WORKLOAD_TERMINATION_PREFIX

TERMINATION_LOG_ENV = "RJOB_TERMINATION_LOG"
"""Where the termination message goes (the local kubelet points it into the pod's directory)."""
DEFAULT_TERMINATION_LOG = "/dev/termination-log"


class WorkloadError(ValueError):
    """A worker cannot go on because of the job's spec (not its node): names the field to change."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


_WORKLOAD_ERRORS = ("DataError", "WorkloadError")
"""Exceptions of the runtime that name a spec field (`DataError` of the data files, `WorkloadError`)."""
_LINE = re.compile(r"^(?:[\w.]+\.)?(?P<kind>\w+): (?P<line>spec(?:\.[A-Za-z]+)+: .+)$")


def workload_line(failure_message: object) -> str | None:
    """The `spec.<field>: ...` line of a worker's failure (torch elastic's `ProcessFailure.message`: the
    exception as `Name: text`, or the error file's record holding it under "message"), when it is one of the
    runtime's workload errors; None otherwise."""
    if isinstance(failure_message, dict):
        failure_message = failure_message.get("message", "")
    text = str(failure_message).strip()
    first = text.splitlines()[0] if text else ""
    found = _LINE.match(first)
    if found is None or found["kind"] not in _WORKLOAD_ERRORS:
        return None
    return " ".join(found["line"].split())


def write_termination_message(line: str, environ: Mapping[str, str] | None = None) -> None:
    """Leave `line` as the container's last words (best effort: a pod without the file loses nothing)."""
    env = os.environ if environ is None else environ
    path = Path(env.get(TERMINATION_LOG_ENV) or DEFAULT_TERMINATION_LOG)
    with contextlib.suppress(OSError):
        path.write_text((WORKLOAD_TERMINATION_PREFIX + line)[:4096])
