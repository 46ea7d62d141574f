"""deploy/prometheus/: promtool checks the scrape config and the rules, and runs the rules' unit
tests (kvtierd-rules.test.yml: every alert fires when it should and stays quiet when it should not,
for tier="cpu" and tier="nvme"). KvtierdTierFull is for the CPU tier only: the NVMe tier sits near
full by design, and KvtierdNvmeEvictionPressure says when its evictions cost hits."""

from __future__ import annotations

import re

import pytest
import yaml
from helpers.workload import DEPLOY, REPO

PROM = DEPLOY / "prometheus"
ALERTS = {"KvtierdDown", "KvtierdTierFull", "KvtierdNvmeEvictionPressure",
          "KvtierdIntegrityFailures", "KvtierdRequestErrors", "KvtierdHitRatioCollapse",
          "KvtierdRefusing", "KvtierdLowerTierUnavailable", "KvtierdLowerTierFlapping",
          "KvtierdEvictionsDropped",
          "KvtierdEventsDropped", "KvtierdEventsUnsubscribed"}


def test_promtool_checks_the_scrape_config(promtool):
    result = promtool.run("check", "config", "prometheus.yml", cwd=PROM)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stdout + result.stderr


def test_promtool_checks_the_rules(promtool):
    result = promtool.run("check", "rules", "kvtierd-rules.yml", cwd=PROM)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rule_unit_tests_pass(promtool):
    result = promtool.run("test", "rules", "kvtierd-rules.test.yml", cwd=PROM)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_for_both_outcomes_and_a_readme_entry():
    rules = yaml.safe_load((PROM / "kvtierd-rules.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert alerts == ALERTS
    tests = yaml.safe_load((PROM / "kvtierd-rules.test.yml").read_text())["tests"]
    readme = (REPO / "README.md").read_text()
    for alert in alerts:
        cases = [c for t in tests for c in t.get("alert_rule_test", []) if c["alertname"] == alert]
        assert any(c["exp_alerts"] for c in cases), f"{alert}: no test where it fires"
        assert any(not c["exp_alerts"] for c in cases), f"{alert}: no test where it is quiet"
        assert re.search(rf"\| `{alert}` \|", readme), f"{alert}: not in README's alert table"
    text = (PROM / "kvtierd-rules.test.yml").read_text()
    assert 'tier="cpu"' in text and 'tier="nvme"' in text


@pytest.mark.parametrize("broken", ["kvtierd_tier_used_bytes / ", "up{job="])
def test_promtool_really_rejects_a_broken_rule(promtool, tmp_path, broken):
    path = tmp_path / "rules.yml"
    path.write_text(f"groups:\n  - name: x\n    rules:\n      - alert: X\n        expr: '{broken}'\n")
    assert promtool.run("check", "rules", str(path)).returncode != 0
