"""docs/grafana/kvshelf.json queries only what ``/metrics`` exports: every metric name in its queries has samples
in a real scrape of a ``kvshelf serve`` that served puts, gets, prefix lookups, evictions and vLLM-format KV
events, and every label its queries group by, filter on or name in a legend is a label of those samples."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

from dashboard_helpers import traffic
from service_helpers import InProcessServe, free_port, scrape

from kvshelf.service.serve import ServeConfig

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "kvshelf.json"
_METRIC = re.compile(r"\bkvshelf_[a-z0-9_]+\b")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="')


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    """``(expression, legend format)`` of every panel target and query variable."""
    found = [(target["expr"], target.get("legendFormat", "")) for panel in dashboard["panels"]
             for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            found.append((query["query"] if isinstance(query, dict) else query, ""))
    return found


def _labels_used(expr: str, legend: str) -> set[str]:
    """The labels an expression groups by or matches on, and those its legend names."""
    used = {name.strip() for group in re.findall(r"\bby \(([^)]*)\)", expr) for name in group.split(",")}
    used |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*=~?\s*\"", expr))
    used |= set(re.findall(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}", legend))
    used |= set(re.findall(r"label_values\([^,]+,\s*([a-zA-Z_][a-zA-Z0-9_]*)\)", expr))
    return used - {""}


def _scrape_samples(body: str) -> dict[str, set[str]]:
    """Sample name -> the label names its samples carry."""
    samples: dict[str, set[str]] = defaultdict(set)
    for line in body.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            samples[match.group(1)] |= set(_LABEL.findall(match.group(2) or ""))
    return samples


def test_every_metric_and_label_the_grafana_dashboard_queries_is_in_a_real_scrape(tmp_path, capsys):
    dashboard = json.loads(DASHBOARD.read_text())
    queries = _queries(dashboard)
    assert len(queries) >= 15
    config = ServeConfig.from_settings(listen="127.0.0.1:0", data_dir=str(tmp_path / "data"), memory="64KiB",
                                       max_disk="64MiB", metrics_port=free_port(), grace=0,
                                       kv_events_endpoint=f"tcp://*:{free_port()}")
    running = InProcessServe(config, capsys)
    try:
        traffic(running.grpc, "tenant-a", 3)
        traffic(running.grpc, "tenant-b", 120, seed=1)  # more than the 64 KiB memory tier holds: evictions
        status, body = scrape(f"http://127.0.0.1:{running.metrics_port}/metrics")
    finally:
        running.close()
    assert status == 200
    samples = _scrape_samples(body)
    assert any(name == "kvshelf_tier_evictions_total" for name in samples), "no eviction happened"
    missing, unlabelled = [], []
    for expr, legend in queries:
        names = set(_METRIC.findall(expr))
        assert names, f"a query that names no kvshelf metric: {expr}"
        missing += [f"{name} (in {expr})" for name in sorted(names - set(samples))]
        carried = set.union(*(samples.get(name, set()) for name in names))
        unlabelled += [f"{label} (in {expr} / {legend!r})" for label in sorted(_labels_used(expr, legend) - carried)]
    assert not missing, "queried but not in /metrics:\n" + "\n".join(missing)
    assert not unlabelled, "labels the metrics do not carry:\n" + "\n".join(unlabelled)


def test_the_dashboard_is_importable_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "kvshelf" and isinstance(dashboard["schemaVersion"], int)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert [t["refId"] for t in panel["targets"]] == [chr(65 + i) for i in range(len(panel["targets"]))]
    assert any(v["name"] == "datasource" and v["type"] == "datasource" for v in dashboard["templating"]["list"])
