"""The process kubelet's copies of the pod contract agree with the operator that writes it and the agent that
reads it (the local stack imports neither: `resilientjob.localstack.kubelet` repeats the names)."""

from __future__ import annotations

from resilientjob.agent import store_host
from resilientjob.localstack import kubelet
from resilientjob.operator import _manifests


def test_the_kubelet_uses_the_operators_labels_and_env_names() -> None:
    assert kubelet.LABEL_MANAGED_BY == _manifests.LABEL_MANAGED_BY
    assert kubelet.MANAGER == _manifests.MANAGER
    assert kubelet.AGENT_METRICS_ENV == _manifests.AGENT_METRICS_ENV
    assert kubelet.STORE_PORT_ENV == store_host.STORE_PORT_ENV


def test_the_downward_api_file_is_one_quoted_line_per_key_sorted() -> None:
    text = kubelet.downward_annotations_text({"b": 'say "hi"', "a": "1"})
    assert text == 'a="1"\nb="say \\"hi\\""\n'
