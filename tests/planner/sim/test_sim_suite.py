"""The results suite's plumbing (tables, plots, markdown) on the stub planner; the real numbers come from
`rjob simulate --suite paper` on the real planner."""

from __future__ import annotations

from pathlib import Path

from sim_stub_planner import StubPlanner

from resilientjob.planner.sim.suite import run_suite


def test_quick_suite_writes_every_section_and_plot(tmp_path: Path) -> None:
    stub = StubPlanner()
    report = run_suite(tmp_path, quick=True, planner=stub.as_planner())
    text = (tmp_path / "results.md").read_text()
    for heading in ("## 1. Odyssey", "## 2. Oobleck", "## 3. Falcon", "## 4. Sweep"):
        assert heading in text
    for image in ("odyssey_timeline", "odyssey_bars", "oobleck_bert-large", "falcon_timeline"):
        assert (tmp_path / "img" / f"{image}.png").read_bytes()[:4] == b"\x89PNG"
        assert f"img/{image}.png" in text
    assert report["planner_calls"] == len(stub.calls)
    assert 0 <= report["falcon"]["slowdown_removed"] <= 1
