"""Fixtures for the deploy/ artefacts: the real tools that consume them."""

from __future__ import annotations

import pytest
from helpers.tools import debian_tool, hadolint, require


@pytest.fixture(scope="session")
def promtool():
    return require(debian_tool, "promtool", "prometheus")


@pytest.fixture(scope="session")
def prometheus_server():
    return require(debian_tool, "prometheus", "prometheus")


@pytest.fixture(scope="session")
def systemd_analyze():
    return require(debian_tool, "systemd-analyze", "systemd")


@pytest.fixture(scope="session")
def hadolint_tool():
    return require(hadolint)
