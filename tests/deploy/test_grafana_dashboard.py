"""deploy/grafana/kvtierd.json: the panels operators need exist, and every metric name any query
uses is one a live daemon really exports (read from its /metrics after a workload)."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
from helpers.workload import DEPLOY, run_workload
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(120)

DASHBOARD = DEPLOY / "grafana" / "kvtierd.json"
NOT_OURS = {"up"}  # Prometheus' own series
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
    "scalar", "by", "on", "ignoring", "group_left", "group_right", "without", "and", "or",
    "unless", "offset", "label_values", "bool", "topk", "bottomk", "avg_over_time", "le",
}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dash: dict) -> list[tuple[str, str]]:
    """(panel title, expr) for every target, plus the template variables' queries."""
    out = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"${var['name']}", var["query"]["query"]))
    return out


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers outside {...}, strings and by/on (...)."""
    expr = re.sub(r'"[^"]*"', '""', expr)
    expr = re.sub(r"label_values\((.*),\s*\w+\)", r"(\1)", expr)  # Grafana: (metric, label)
    expr = re.sub(r"\{[^}]*\}", "{}", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr)) - PROMQL_WORDS
    return {n for n in names if not n.startswith("$") and not re.fullmatch(r"\d.*", n)}


def exported_names(metrics_text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                    "summary": ["_sum", "_count", ""]}.get(family.type, [""])
        names |= {family.name + s for s in suffixes}
    return names


def test_metric_names_are_parsed_from_queries():
    assert metric_names('histogram_quantile(0.99, sum by (op, le) (rate('
                        'kvtierd_request_duration_seconds_bucket{instance=~"$instance"}'
                        '[$__rate_interval])))') == {"kvtierd_request_duration_seconds_bucket"}
    assert metric_names("a_total / on (tier) group_left sum by (tier) (b_total)") == \
        {"a_total", "b_total"}


def test_dashboard_covers_what_operators_watch():
    dash = dashboard()
    assert dash["uid"] == "kvtierd" and dash["schemaVersion"] >= 36
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("tier usage", "tier used / capacity", "hit ratio per tier", "bytes moved",
                  "requests by op", "latency p50", "latency p99", "evictions", "demotions",
                  "promotions", "integrity failures", "sessions",
                  "hit ratio if the tier were larger", "lookup misses by reason", "get results",
                  "time a chunk stays in a tier", "kv events published", "kv events dropped",
                  "lower tiers available", "lower-tier traffic", "lower-tier job latency",
                  "lower-tier i/o failures"):
        assert topic in titles, topic
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance", "tier"} <= variables
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert 'instance=~"$instance"' in target["expr"], panel["title"]
            if "tier" in target.get("legendFormat", "") and "kvtierd_ghost" not in target["expr"]:
                assert 'tier=~"$tier"' in target["expr"] or "hits_total" in target["expr"], \
                    panel["title"]


def test_every_metric_in_every_query_is_exported_by_a_live_daemon(daemon_factory):
    d = daemon_factory(cpu_bytes="4MiB")  # with an NVMe tier: its series are on the dashboard
    run_workload(d.address)
    with urllib.request.urlopen(d.stats()["daemon"]["metrics"], timeout=10) as resp:
        exported = exported_names(resp.read().decode())
    used = {name: title for title, expr in queries(dashboard()) for name in metric_names(expr)}
    assert used, "no metric names found in the dashboard"
    unknown = {n: t for n, t in used.items() if n not in exported | NOT_OURS}
    assert not unknown, f"queries use metrics the daemon does not export: {unknown}"
    assert {"kvtierd_demotions_total", "kvtierd_promotions_total",
            "kvtierd_get_results_total"} <= set(used)
