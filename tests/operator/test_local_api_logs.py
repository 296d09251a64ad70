"""A pod's log as the local API server answers `kubectl logs`: the times the process kubelet noted per line
(`kubelet.capture_log`), `--timestamps`, `--since`, `--tail`, `--limit-bytes` (`_local_api_logs`)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
from kmock._internal.k8s import KubernetesError

from resilientjob.localstack import _local_api_logs as logs
from resilientjob.localstack.kubelet import LOG_TIMES, capture_log


def _captured(tmp_path: Path, *outputs: bytes) -> Path:
    """`outputs` captured one after the other into one log (a pod's containers, restarted)."""
    log = tmp_path / "log"
    for output in outputs:
        capture_log(io.BytesIO(output), log, tmp_path / LOG_TIMES)
    return log


def test_each_line_keeps_the_time_it_started(tmp_path: Path) -> None:
    log = _captured(tmp_path, b"one\ntwo\nhalf", b"-done\nthree\n")
    lines, end = logs.read_lines(log)
    assert [line for _, line in lines] == [b"one\n", b"two\n", b"half-done\n", b"three\n"]
    assert end == log.stat().st_size
    times = [at for at, _ in lines]
    assert times == sorted(times) and times[0] > 1.7e9
    # The line the second run finished began with the first run: one line, one time.
    starts = (tmp_path / LOG_TIMES).read_text().splitlines()
    assert [int(entry.split()[0]) for entry in starts] == [0, 4, 8, 18]
    # A follow reads on from an offset and leaves a line without its end for later.
    more, _ = logs.read_lines(log, start=8, whole_only=True)
    assert [line for _, line in more] == [b"half-done\n", b"three\n"]


def test_a_real_process_output_is_captured_through_a_pipe(tmp_path: Path) -> None:
    code = "import sys, time; print('a', flush=True); time.sleep(0.3); sys.stdout.write('b\\nc')"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert process.stdout is not None
    capture_log(process.stdout, tmp_path / "log", tmp_path / LOG_TIMES)
    process.wait(10)
    lines, _ = logs.read_lines(tmp_path / "log")
    assert [line for _, line in lines] == [b"a\n", b"b\n", b"c"]
    assert lines[1][0] - lines[0][0] >= 0.25  # b was written 0.3 s after a


def test_options_select_stamp_and_cut_the_lines() -> None:
    lines = [(100.0, b"early\n"), (200.5, b"late\n"), (300.25, b"last\n")]
    assert logs.render(lines, logs.LogOptions()) == b"early\nlate\nlast\n"
    assert logs.render(lines, logs.LogOptions(since=200.5)) == b"late\nlast\n"
    assert logs.render(lines, logs.LogOptions(tail=1)) == b"last\n"
    assert logs.render(lines, logs.LogOptions(tail=0)) == b""
    assert logs.render(lines, logs.LogOptions(since=150, tail=5, limit_bytes=3)) == b"lat"
    stamped = logs.render(lines[2:], logs.LogOptions(timestamps=True))
    assert stamped == b"1970-01-01T00:05:00.250000000Z last\n"
    options = logs.LogOptions.of(
        {"sinceSeconds": "60", "timestamps": "true", "tailLines": "3", "follow": "1"}, now=1000.0
    )
    assert options == logs.LogOptions(tail=3, timestamps=True, since=940.0, follow=True)
    since_time = logs.LogOptions.of({"sinceTime": "1970-01-01T00:03:20Z"}, now=0.0)
    assert since_time.since == 200.0


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"tailLines": "-1"}, "tailLines"),
        ({"sinceSeconds": "0"}, "sinceSeconds"),
        ({"sinceTime": "yesterday"}, "sinceTime"),
        ({"sinceSeconds": "5", "sinceTime": "2026-01-01T00:00:00Z"}, "at most one"),
    ],
)
def test_a_bad_option_is_a_400_naming_it(params: dict[str, str], says: str) -> None:
    with pytest.raises(KubernetesError) as refused:
        logs.LogOptions.of(params, now=0.0)
    assert refused.value.status == 400 and says in str(refused.value.message)
