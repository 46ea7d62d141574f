"""The one error every invalid configuration value raises (its own module so that the config's
parts can share it without importing each other)."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """An invalid configuration value: names the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        super().__init__(f"config key {key!r}: invalid value {value!r}; allowed: {allowed}")
        self.key = key
