"""The Grafana dashboard and the PrometheusRule reference only metrics (and labels) that the operator and the
agent really export: the names are read from prometheus_client's registry after importing
operator/metrics.py and agent/telemetry.py, not from a list kept by hand; the agents' per-worker labels are
the ones the chart's PodMonitor adds. No series is labelled `job`, Prometheus's own target label."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from _chart import CHART, objects, one
from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

import resilientjob.agent.telemetry
import resilientjob.operator.metrics  # noqa: F401  (registers the metrics)

DASHBOARD = CHART / "files" / "grafana-dashboard.json"
METRIC = re.compile(r"\b(rjob_[a-z0-9_]+)")
BY = re.compile(r"\b(?:by|on)\s*\(([^)]*)\)")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
SELECTOR = re.compile(r"\{([^}]*)\}")
# Labels Prometheus adds at scrape time, and the histogram bucket label.
SCRAPE_LABELS = {"le", "instance", "pod", "namespace"}


def pod_monitor_labels() -> set[str]:
    """The labels the chart's PodMonitor gives every agent series (from the pods' labels)."""
    monitor = one(objects(sets={"metrics.podMonitor.enabled": "true"}), "PodMonitor")
    return {r["targetLabel"] for e in monitor["spec"]["podMetricsEndpoints"] for r in e["relabelings"]}


def exported() -> dict[str, set[str]]:
    """Every sample name the code exports (with _total/_bucket/_sum/_count) -> its label names."""
    out: dict[str, set[str]] = {}
    for collector in list(REGISTRY._collector_to_names):
        if not isinstance(collector, MetricWrapperBase):
            continue
        for family in collector.describe():
            if not family.name.startswith("rjob_"):
                continue
            labels = set(collector._labelnames)
            if family.name.startswith("rjob_agent_"):
                labels |= pod_monitor_labels()
            names = {family.name}
            if family.type == "counter":
                names = {family.name + "_total"}
            elif family.type == "histogram":
                names = {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
            for name in names:
                out[name] = labels
    return out


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    queries += [
        v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)
    ]
    return queries


def rule_queries() -> list[str]:
    rule = one(objects(sets={"metrics.prometheusRule.enabled": "true"}), "PrometheusRule")
    return [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]


def test_code_exports_the_expected_families() -> None:
    names = exported()
    # A sanity floor, so that an empty registry cannot make the tests below pass vacuously.
    assert {"rjob_active_workers", "rjob_recovery_seconds_bucket", "rjob_agent_heartbeats_total"} <= set(
        names
    )


@pytest.mark.parametrize("source", ["dashboard", "rules"])
def test_every_referenced_metric_and_label_exists(source: str) -> None:
    names = exported()
    queries = dashboard_queries() if source == "dashboard" else rule_queries()
    assert queries
    for query in queries:
        metrics = set(METRIC.findall(query))
        assert metrics, f"no rjob metric in {query!r}"
        unknown = metrics - set(names)
        assert not unknown, f"{source} uses {sorted(unknown)}, which the code does not export: {query!r}"
        available = set().union(*(names[m] for m in metrics)) | SCRAPE_LABELS
        for group in BY.findall(query):
            labels = {label.strip() for label in group.split(",") if label.strip()}
            assert labels <= available, f"{source} groups by {sorted(labels - available)} in {query!r}"


def test_dashboard_covers_the_issue() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels: list[dict[str, Any]] = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    text = " ".join(p["title"].lower() for p in panels)
    for topic in ("throughput", "active workers", "plan generation", "recovery time", "fail-slow"):
        assert topic in text, topic
    used = {m for q in dashboard_queries() for m in METRIC.findall(q)}
    assert {"rjob_recovery_seconds_sum", "rjob_reconfigurations_total", "rjob_fail_slow_events_total"} <= used
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["gridPos"]["w"] <= 24


def test_rules_are_parameterised_by_values() -> None:
    rule = one(
        objects(
            sets={"metrics.prometheusRule.enabled": "true", "metrics.prometheusRule.recoveriesPerHour": "7"}
        ),
        "PrometheusRule",
    )
    by_name = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    assert "> 7" in by_name["ResilientJobRepeatedRecoveries"]["expr"]
    assert by_name["ResilientJobDegraded"]["for"] == "15m"
    assert by_name["ResilientJobWorkersNotRunning"]["for"] == "10m"
    assert "rjob_workers_not_ready" in by_name["ResilientJobWorkersNotRunning"]["expr"]
    for alert in by_name.values():
        assert alert["labels"]["severity"] in {"info", "warning", "critical"}
        # An alert per job names the job in its summary.
        if "by (rjob" in alert["expr"]:
            assert "{{ $labels.rjob }}" in alert["annotations"]["summary"], alert["alert"]
