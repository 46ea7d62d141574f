"""The ``[remote]`` table of the configuration: the remote tier on a shared Mooncake Store.

Parsed from the TOML file only (like ``[tenants]``: an environment variable or a flag cannot express
a table). No ``[remote]`` table: no remote tier. Every key is checked at start, so that a typo in a
master address fails the daemon's start instead of silently turning the tier off. When chunks are
published is the chain's business (top-level keys ``remote_publish``,
``remote_publish_after_reads``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvtierd.config_error import ConfigError
from kvtierd.sizes import parse_size

BACKENDS = ("mooncake",)
PROTOCOLS = ("tcp", "rdma")
#: Part of every object's name: letters, digits and ``_.-`` only, so that it never needs quoting
#: and two clusters' prefixes can never be confused.
CLUSTER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HOST = re.compile(r"^[A-Za-z0-9_.:\[\]-]{1,253}$")


@dataclass(frozen=True)
class RemoteConfig:
    """One ``[remote]`` table. Sizes take units (``"256MiB"``)."""

    # Which distributed store: only "mooncake" (Mooncake Store) today.
    backend: str = "mooncake"
    # host:port of mooncake_master's RPC service.
    master_addr: str = "127.0.0.1:50051"
    # Mooncake's metadata service: http://HOST:PORT/metadata (the master's embedded HTTP metadata
    # server, or a standalone one), or "P2PHANDSHAKE".
    metadata_url: str = "http://127.0.0.1:8080/metadata"
    # Transfer protocol of Mooncake's transfer engine: "tcp" (any machine) or "rdma".
    protocol: str = "tcp"
    # RDMA device names (comma-separated, e.g. "mlx5_0,mlx5_1"); required with protocol "rdma",
    # empty with "tcp".
    device: str = ""
    # The address other nodes reach this daemon's transfer engine at (this node's IP or name).
    local_hostname: str = "127.0.0.1"
    # Memory this daemon contributes to the shared pool (Mooncake's global segment); 0 = a pure
    # client that stores into other nodes' segments.
    global_segment_bytes: int = 256 * 1024**2
    # Mooncake's local transfer buffer (used for copies that are not zero-copy).
    local_buffer_bytes: int = 64 * 1024**2
    # Names every object (kvtierd/v2/<cluster_id>/...): daemons of two clusters sharing one
    # Mooncake never see each other's chunks. Daemons meant to share chunks use the same id.
    cluster_id: str = "default"
    # After the store fails as a whole (master down, timeout), the remote tier is skipped for this
    # long before it is tried again; local tiers serve meanwhile.
    retry_s: float = 10.0
    # Longest a connection attempt waits for the master's and the metadata server's ports (each)
    # before the tier counts as unavailable for retry_s (the daemon serves its local tiers).
    connect_timeout_s: float = 2.0
    # Threads of the remote tier's own I/O pool (the chain gives it one, so that network waits
    # never queue NVMe jobs behind them); also the most promotions from the store in flight, and
    # the tier's verifier threads (each running read job keeps one call's check in flight).
    io_threads: int = 4
    # Most keys in one Mooncake batch call; longer LOOKUP/GET/PUT batches are split.
    max_batch: int = 1024
    # Most names the tier remembers from existence checks (LRU), so that a LOOKUP followed by its
    # GET asks the master once.
    known_keys: int = 65536
    # Copies Mooncake keeps of each object (each in another node's segment, as the pool allows).
    # 1, Mooncake's default: a node whose segment dies takes its share of every tenant's objects
    # with it (a miss on every node, then recomputed). At most MAX_REPLICAS.
    replicas: int = 1


_SIZE_KEYS = ("global_segment_bytes", "local_buffer_bytes")
_FLOAT_KEYS = ("retry_s", "connect_timeout_s")
_INT_KEYS = ("io_threads", "max_batch", "known_keys", "replicas")
MAX_REPLICAS = 8
_KEYS = tuple(RemoteConfig.__dataclass_fields__)


def parse_remote(table: Any) -> RemoteConfig:
    """The ``[remote]`` table as a validated RemoteConfig."""
    if not isinstance(table, dict):
        raise ConfigError("remote", table, "a [remote] table")
    unknown = sorted(set(table) - set(_KEYS))
    if unknown:
        raise ConfigError(f"remote.{unknown[0]}", table[unknown[0]], "one of " + ", ".join(_KEYS))
    values: dict[str, Any] = {}
    for key, value in table.items():
        values[key] = _coerce(key, value)
    cfg = RemoteConfig(**values)
    _validate(cfg)
    return cfg


def _coerce(key: str, value: Any) -> Any:
    name = f"remote.{key}"
    if key in _SIZE_KEYS:
        try:
            return parse_size(value)
        except ValueError as exc:
            raise ConfigError(name, value, str(exc)) from None
    if key in _FLOAT_KEYS:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
                value) or value <= 0:
            raise ConfigError(name, value, "a positive number of seconds")
        return float(value)
    if key in _INT_KEYS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(name, value, "a non-negative integer")
        return value
    if not isinstance(value, str):
        raise ConfigError(name, value, "a string")
    return value


def _validate(cfg: RemoteConfig) -> None:
    _one_of("backend", cfg.backend, BACKENDS)
    _one_of("protocol", cfg.protocol, PROTOCOLS)
    host, _, port = cfg.master_addr.rpartition(":")
    if not host or not _HOST.match(host) or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ConfigError("remote.master_addr", cfg.master_addr, "HOST:PORT with a port in "
                          "1..65535")
    if cfg.metadata_url != "P2PHANDSHAKE":
        url = urlsplit(cfg.metadata_url)
        if url.scheme != "http" or not url.hostname or url.port is None:
            raise ConfigError("remote.metadata_url", cfg.metadata_url,
                              "http://HOST:PORT/PATH (Mooncake's HTTP metadata server) or "
                              "P2PHANDSHAKE")
    if not _HOST.match(cfg.local_hostname):
        raise ConfigError("remote.local_hostname", cfg.local_hostname,
                          "this node's address or host name as other nodes reach it")
    if cfg.protocol == "rdma" and not cfg.device:
        raise ConfigError("remote.device", cfg.device, "RDMA device names (e.g. \"mlx5_0\") with "
                          "protocol \"rdma\"")
    if cfg.protocol == "tcp" and cfg.device:
        raise ConfigError("remote.device", cfg.device, "empty with protocol \"tcp\"")
    if not CLUSTER_ID.match(cfg.cluster_id):
        raise ConfigError("remote.cluster_id", cfg.cluster_id, "1-64 letters, digits, '_', '.', "
                          "'-', starting with a letter or digit")
    if cfg.local_buffer_bytes <= 0:
        raise ConfigError("remote.local_buffer_bytes", cfg.local_buffer_bytes, "a positive size")
    for key in ("io_threads", "max_batch", "known_keys"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"remote.{key}", getattr(cfg, key), "a positive integer")
    if not 1 <= cfg.replicas <= MAX_REPLICAS:
        raise ConfigError("remote.replicas", cfg.replicas, f"1..{MAX_REPLICAS}")


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"remote.{key}", value, ", ".join(allowed))
