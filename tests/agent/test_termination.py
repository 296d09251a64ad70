"""A worker stopped by the job's spec says so in its pod's termination message (`agent/_termination.py`),
which the operator reads back (`protocol.messages.workload_termination`)."""

from __future__ import annotations

from pathlib import Path

from resilientjob.agent._termination import workload_line, write_termination_message
from resilientjob.protocol.messages import workload_termination

BAD_TOKEN = (
    "DataError: spec.data.path: /d/t.bin: sample 7 holds token 53, outside the model's vocabulary (48)"
)


def test_a_workload_error_of_a_worker_is_its_line_as_torch_elastic_records_it() -> None:
    line = "spec.data.path: /d/t.bin: sample 7 holds token 53, outside the model's vocabulary (48)"
    assert workload_line(BAD_TOKEN) == line
    # The error file's record, as ProcessFailure.message holds it.
    assert workload_line({"message": BAD_TOKEN, "extraInfo": {"py_callstack": "..."}}) == line
    assert workload_line(
        "resilientjob.agent._termination.WorkloadError: spec.output.path: /o: read-only"
    ) == ("spec.output.path: /o: read-only")


def test_other_failures_are_the_nodes() -> None:
    for message in (
        "RuntimeError: spec.data.path: looks like a field but is no workload error",
        "ValueError: sample_ids: outside [0, 10)",
        "Signal 9 (SIGKILL) received by PID 12",
        "",
        {"message": "RuntimeError: Connection reset by peer"},
    ):
        assert workload_line(message) is None, message


def test_the_operator_reads_back_what_the_agent_wrote(tmp_path: Path) -> None:
    path = tmp_path / "termination-log"
    write_termination_message("spec.data.path: /d/t.bin: bad", {"RJOB_TERMINATION_LOG": str(path)})
    assert workload_termination(path.read_text()) == ("spec.data.path", "spec.data.path: /d/t.bin: bad")
    write_termination_message(
        "x", {"RJOB_TERMINATION_LOG": str(tmp_path / "no" / "dir")}
    )  # no file: no error
    for last_words in ("spec.data.path: no prefix", "workload: notspec: x", "workload: spec.: x", "Error"):
        assert workload_termination(last_words) is None, last_words
