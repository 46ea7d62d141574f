"""The ``[tenants]`` table of the configuration: which peers form each named tenant, and its quota.

Parsed from the TOML file only (an environment variable or a flag cannot express a table); every
uid, gid and token names at most one tenant, and tokens are never shown in an error. Also the
keys that decide who may open a session at all (``validate_access``): ``anonymous_tenant`` and the
per-uid caps.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvtierd.config_error import ConfigError
from kvtierd.sizes import parse_size

#: A configured tenant's name: also a metric label value, so short and plain (no ':' — the
#: implicit ``uid:N`` tenants use it — and none of the reserved names below).
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
RESERVED_TENANTS = frozenset({"anonymous", "other"})
MAX_TENANT_TOKEN_CHARS = 256


@dataclass(frozen=True)
class TenantConfig:
    """One ``[tenants.NAME]`` table: which peers belong to the tenant, and its CPU-tier quota."""

    name: str  # also the metric label value
    uids: tuple[int, ...] = ()  # peers whose (kernel-reported) uid is one of these
    gids: tuple[int, ...] = ()  # peers whose primary gid is one of these
    tokens: tuple[str, ...] = ()  # HELLO tokens that select this tenant (compared in constant time)
    # Quota in the CPU tier (pages of its chunks, pending included); None = tenant_max_bytes,
    # 0 = bounded only by the tier's capacity.
    max_bytes: int | None = None


def parse_tenants(table: Any) -> tuple[TenantConfig, ...]:
    """The ``[tenants]`` table as TenantConfigs; every uid, gid and token names one tenant."""
    if not isinstance(table, dict):
        raise ConfigError("tenants", table, "a table of [tenants.NAME] tables")
    out = []
    owners: dict[tuple[str, Any], str] = {}
    for name, spec in table.items():
        key = f"tenants.{name}"
        if not TENANT_NAME.match(name) or name in RESERVED_TENANTS:
            raise ConfigError(key, name, f"a name matching {TENANT_NAME.pattern}, not one of "
                              f"{', '.join(sorted(RESERVED_TENANTS))}")
        if not isinstance(spec, dict):
            raise ConfigError(key, spec, "a table with uids, gids, tokens, max_bytes")
        unknown = sorted(set(spec) - {"uids", "gids", "tokens", "max_bytes"})
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}", spec[unknown[0]],
                              "one of uids, gids, tokens, max_bytes")
        uids = _id_list(f"{key}.uids", spec.get("uids", []))
        gids = _id_list(f"{key}.gids", spec.get("gids", []))
        tokens = spec.get("tokens", [])
        if not isinstance(tokens, list) or not all(
                isinstance(t, str) and 0 < len(t) <= MAX_TENANT_TOKEN_CHARS for t in tokens):
            shown = ["***"] * len(tokens) if isinstance(tokens, list) else tokens
            raise ConfigError(f"{key}.tokens", shown, f"a list of strings of 1.."
                              f"{MAX_TENANT_TOKEN_CHARS} characters")
        if not (uids or gids or tokens):
            raise ConfigError(key, spec, "at least one of uids, gids, tokens (else nobody is in it)")
        max_bytes = spec.get("max_bytes")
        if max_bytes is not None:
            try:
                max_bytes = parse_size(max_bytes)
            except ValueError as exc:
                raise ConfigError(f"{key}.max_bytes", max_bytes, str(exc)) from None
        for kind, values in (("uid", uids), ("gid", gids), ("token", tokens)):
            for value in values:
                other = owners.setdefault((kind, value), name)
                if other != name:
                    shown = "***" if kind == "token" else value
                    raise ConfigError(f"{key}.{kind}s", shown,
                                      f"a {kind} no other tenant names (tenants.{other} has it)")
        out.append(TenantConfig(name, uids, gids, tuple(tokens), max_bytes))
    return tuple(out)


def _id_list(key: str, values: Any) -> tuple[int, ...]:
    if not isinstance(values, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32 for v in values):
        raise ConfigError(key, values, "a list of ids in 0..4294967295")
    return tuple(values)


ANONYMOUS_CHOICES = ("auto", "allow", "refuse")


def per_uid_cap(configured: int, limit: int) -> int:
    """A per-uid cap in force (``max_sessions_per_uid``, ``max_connections_per_uid``) given the
    global cap in force ``limit``: ``configured`` (0: a quarter of ``limit``), never above
    ``limit``."""
    return min(limit, configured) if configured else max(1, limit // 4)


def validate_access(cfg: Any) -> None:
    """Who may open sessions: the anonymous tenant's switch and the per-uid caps."""
    if cfg.anonymous_tenant not in ANONYMOUS_CHOICES:
        raise ConfigError("anonymous_tenant", cfg.anonymous_tenant, ", ".join(ANONYMOUS_CHOICES))
    for key in ("max_sessions_per_uid", "max_connections_per_uid"):
        if getattr(cfg, key) < 0:
            raise ConfigError(key, getattr(cfg, key), "0 (a quarter of the global cap) or a "
                              "positive integer")
