"""Polling for a condition a daemon reaches asynchronously (never a timed assertion)."""

from __future__ import annotations

import time
from typing import Any, Callable


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str,
             interval_s: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); fail after the timeout."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"{what}: not reached within {timeout_s} s (last: {last!r})")
