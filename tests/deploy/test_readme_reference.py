"""README's "Operating kvtierd" reference tables stay complete: every config key with its env
variable and flag, and every metric a live daemon exports."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest
from helpers.workload import REPO
from prometheus_client.parser import text_string_to_metric_families

from kvtierd.cli import _BOOL_FLAGS, _CONFIG_FLAGS
from kvtierd.config import Config

pytestmark = pytest.mark.timeout(60)


def section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"### {title}\n")
    end = text.find("\n### ", start + 1)
    return text[start:end]


def table_rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ") and "---" not in line]


def test_every_config_key_is_documented_with_its_env_variable_and_flag():
    rows = table_rows(section("Configuration"))
    by_key = {}
    for row in rows[1:]:
        for key in re.findall(r"`(\w+)`", row[0]):
            by_key[key] = row
    flags = {key: flag for flag, key, _ in _CONFIG_FLAGS}
    negated = {key: "--no-" + flag[2:] for flag, key, _ in _BOOL_FLAGS}
    for f in fields(Config):
        assert f.name in by_key, f"config key {f.name} missing from README"
        row = by_key[f.name]
        assert f"KVTIERD_{f.name.upper()}" in row[2], (f.name, row)
        if f.name in flags:
            assert f"`{flags[f.name]}`" in row[3], (f.name, row)
        if f.name in negated:  # boolean flags: both forms
            assert f"`{negated[f.name]}`" in row[3], (f.name, row)


def test_every_exported_metric_is_documented(daemon):
    documented = {row[0].strip("`") for row in table_rows(section("Metrics"))[1:]}
    exported = set()
    for family in text_string_to_metric_families(daemon.metrics_text()):
        if family.name.endswith("_created"):
            continue  # prometheus-client's creation timestamps of counters and histograms
        exported.add(family.name + ("_total" if family.type == "counter" else ""))
    missing = exported - documented
    assert not missing, f"exported but not in README's metrics table: {sorted(missing)}"
