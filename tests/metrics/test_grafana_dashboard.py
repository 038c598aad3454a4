"""deploy/grafana/perseus.json queries only metrics Perseus exports (perseus.metrics.collectors,
whose families the scrape tests check against real endpoints)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")
from perseus.metrics.collectors import exported_metrics

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "perseus.json"
METRIC = re.compile(r"\bperseus_[a-z0-9_]+\b")


def queries(node: object) -> list[str]:
    """Every PromQL expression in the dashboard (panel targets and template queries)."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "query", "definition") and isinstance(value, str):
                found.append(value)
            else:
                found += queries(value)
    elif isinstance(node, list):
        for item in node:
            found += queries(item)
    return found


def test_every_metric_the_dashboard_queries_is_exported():
    dashboard = json.loads(DASHBOARD.read_text())
    used = {name for q in queries(dashboard) for name in METRIC.findall(q)}
    assert len(used) >= 20  # the dashboard covers the service, jobs, pipelines, stages and GPUs
    assert used <= exported_metrics(), sorted(used - exported_metrics())


def test_every_panel_queries_something_on_the_prometheus_datasource():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "Perseus"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["type"] == "prometheus"
        assert all(METRIC.search(t["expr"]) for t in panel["targets"]), panel["title"]
