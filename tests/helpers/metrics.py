"""Reading one sample of a daemon's /metrics by URL (works while its socket refuses connections)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def sample(url: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` with exactly ``labels``; 0.0 when the series is absent."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0
