"""`spec.deviceMemory`: the accelerator's memory as a Kubernetes quantity, which the planner keeps every
stage within, so a model that does not fit one device is split into pipeline stages, and a job that cannot
fit at all is refused naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from resilientjob.operator import api
from resilientjob.operator.crd import crd_manifest
from resilientjob.operator.planning import plan_initial, planner_inputs
from resilientjob.planner.errors import PlannerError

ROOT = Path(__file__).resolve().parents[2]


def _demo_spec(**change: Any) -> api.ResilientJobSpec:
    spec = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())["spec"]
    return api.parse_spec({**spec, **change})


@pytest.mark.parametrize(
    ("quantity", "expected"),
    [
        ("80Gi", 80 * 2**30),
        ("64G", 64 * 10**9),
        ("1.5Ti", 3 * 2**39),
        ("0.5Ki", 512),
        ("0.1", 1),  # a fraction of a byte rounds up, as Kubernetes rounds quantities
        ("85899345920", 85899345920),
        (12345, 12345),
    ],
)
def test_quantities_are_bytes(quantity: int | str, expected: int) -> None:
    assert api.quantity_bytes(quantity) == expected
    assert _demo_spec(deviceMemory=quantity).device_memory_bytes == expected


@pytest.mark.parametrize("bad", ["80 GB", "80gi", "-1Gi", "1e9", "0", 0, -4, 1.5, True, [80]])
def test_a_bad_quantity_names_the_field(bad: object) -> None:
    with pytest.raises(PlannerError) as caught:
        _demo_spec(deviceMemory=bad)
    assert caught.value.field == "spec.deviceMemory"
    assert "\n" not in str(caught.value)


def test_without_it_the_planner_takes_80gi() -> None:
    spec = _demo_spec()
    assert spec.device_memory is None
    assert planner_inputs(spec).cluster.device_memory_bytes == 80 * 2**30


def test_the_layout_splits_the_model_to_fit_the_memory() -> None:
    roomy = plan_initial(spec := _demo_spec(), planner_inputs(spec))
    whole = roomy.peak_memory_bytes  # a whole-model replica's peak is the largest stage there is
    assert any(len(p.stages) == 1 for p in roomy.pipelines)
    for memory in (whole - 1, whole // 2 + 1):
        spec = _demo_spec(deviceMemory=memory)
        plan = plan_initial(spec, planner_inputs(spec))
        assert plan.peak_memory_bytes <= memory
        assert all(len(p.stages) >= 2 for p in plan.pipelines), plan.layout
        assert plan.global_batch == roomy.global_batch


def test_a_model_that_cannot_fit_is_refused_naming_the_field() -> None:
    spec = _demo_spec(deviceMemory="100Ki")
    with pytest.raises(PlannerError) as caught:
        plan_initial(spec, planner_inputs(spec))
    assert caught.value.field == "spec.deviceMemory"
    assert "does not fit" in caught.value.message
    # Room for one pipeline but not for the f + 1 the job must keep: the user's knob is faultTolerance.
    spec = _demo_spec(deviceMemory=400_000)
    with pytest.raises(PlannerError) as caught:
        plan_initial(spec, planner_inputs(spec))
    assert caught.value.field == "spec.faultTolerance"


def test_the_crd_takes_an_integer_or_a_quantity_string_and_keeps_it() -> None:
    spec = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    field = spec["properties"]["deviceMemory"]
    assert field["x-kubernetes-int-or-string"] is True
    assert field["anyOf"] == [{"type": "integer"}, {"type": "string"}] and "type" not in field
    assert field["pattern"] == api.QUANTITY_PATTERN
    assert field["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"
    assert "deviceMemory" not in spec.get("required", [])
