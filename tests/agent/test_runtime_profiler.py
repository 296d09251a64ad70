"""`profiler.measure_message_latency`: the per-message cost between two real gloo worker processes."""

from __future__ import annotations

import pytest

from resilientjob.agent.profiler import measure_message_latency

pytestmark = pytest.mark.serial  # measures the per-message latency between two processes


@pytest.mark.torch
def test_message_latency_is_measured_between_two_processes() -> None:
    latency = measure_message_latency(rounds=20)
    # A loopback round trip through gloo and the runtime's waits: above a microsecond, far below a second.
    assert 1e-6 < latency < 0.5
    with pytest.raises(ValueError, match="rounds"):
        measure_message_latency(rounds=3)
