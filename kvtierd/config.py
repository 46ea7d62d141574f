"""The daemon's one typed, frozen configuration, loaded once and validated at start.

Precedence: command-line flag > ``KVTIERD_<KEY>`` environment variable > TOML file > default.
Every key of the TOML file is a field name below; every invalid value fails at start with the key,
the value and what is allowed. Defaults run on any laptop: a small CPU tier and an ipc socket in a
private runtime directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import math
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from kvtierd.config_error import ConfigError
from kvtierd.config_events import validate_events
from kvtierd.config_remote import RemoteConfig, parse_remote
from kvtierd.config_sockets import validate_sockets
from kvtierd.config_tenants import TenantConfig, parse_tenants, validate_access
from kvtierd.paths import default_runtime_dir, default_socket
from kvtierd.sizes import parse_size

ENV_PREFIX = "KVTIERD_"
# Kubernetes injects these for a Service named "kvtierd" into every pod of its namespace
# (service links: KVTIERD_SERVICE_HOST, KVTIERD_PORT_9464_TCP_ADDR, ...). They are not ours.
_SERVICE_LINK = re.compile(
    r"(SERVICE_HOST|SERVICE_PORT(_.+)?|PORT|PORT_\d+_(TCP|UDP|SCTP)(_.+)?)"
)
_INSTANCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SOURCES = ("flag", "env", "file", "default")


def default_state_dir() -> Path:
    """Where persistent tiers live by default: $XDG_STATE_HOME/kvtierd or ~/.local/state/kvtierd."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "state")
    return Path(base) / "kvtierd"


@dataclass(frozen=True)
class Config:
    # ZeroMQ endpoint of the ROUTER socket: ipc://PATH (default: see kvtierd.paths, the same rule
    # the CLI and clients use) or tcp://HOST:PORT (loopback only unless allow_remote). A bare path
    # means ipc://PATH.
    socket: str = field(default_factory=default_socket)
    # Name of this daemon among several on one node; names its arena and default NVMe directory.
    # Empty: derived from the socket (a hash), so two daemons on different sockets never share.
    instance: str = ""
    # Capacity of the pinned-CPU tier (the shared-memory arena).
    cpu_bytes: int = 512 * 1024**2
    # Allocation unit of the arena; a chunk spans ceil(nbytes / page_bytes) pages, not necessarily
    # contiguous. Multiple of 4096 so that the NVMe tier can do O_DIRECT I/O with the same pages.
    page_bytes: int = 64 * 1024
    # Name of the arena file under /dev/shm; empty = "kvtierd-<instance id>". Never a pid: in a
    # container the daemon is always PID 1, and a restart must find (and reclaim) the old one.
    arena_name: str = ""
    # Touch every arena page at start: the first touch of fresh shm pages runs at ~1 GB/s, which
    # would otherwise land on the first PUTs.
    prefault: bool = True
    # Keep the arena and its index in /dev/shm across restarts (warm restart); off: private arena,
    # removed at exit.
    cpu_persistent: bool = False
    # A clean stop writes each persistent tier's index snapshot beside its SQLite index, so that
    # the next start loads it instead of reading every row (1M chunks: ~0.5 s instead of ~1.4 s).
    # Off for the last stop before rolling back to a kvtierd without snapshots (before 0.1.0 of
    # 2 December 2026): such a daemon reads the snapshot's token in the index as a changed index
    # and starts empty.
    index_snapshot: bool = True
    # Directory of the NVMe tier (data file, index, lock); one daemon per directory. Empty:
    # <state dir>/<instance id>/nvme, so that daemons on different sockets never share one.
    nvme_dir: str = ""
    # Capacity of the NVMe tier; 0 disables the tier.
    nvme_bytes: int = 4 * 1024**3
    # "write-back": chunks reach NVMe when the CPU tier evicts them; "write-through": every commit
    # is also written to NVMe at once.
    nvme_write_policy: str = "write-back"
    # Admission filter of the NVMe tier: a chunk is written there only once it was read (GET) this
    # many times (vLLM's store_threshold); 0 = every chunk.
    nvme_publish_after_reads: int = 0
    # When chunks reach the remote tier (when one is configured): "on-commit" (every committed
    # chunk, asynchronously) or "on-evict" (only what leaves the local tiers).
    remote_publish: str = "on-commit"
    # Admission filter of the remote tier, as nvme_publish_after_reads.
    remote_publish_after_reads: int = 0
    # Threads running NVMe jobs (a demotion batch: writes + fdatasync + index; a promotion: read +
    # checksum). Promotions of chunks <= 2 MiB are one read each: as many threads as
    # io_queue_depth keep the queue full.
    io_threads: int = 8
    # Reads/writes in flight on the NVMe data file at most, across all jobs; each is <= 2 MiB (a
    # larger chunk is cut into pieces), so one job keeps several requests at the device.
    io_queue_depth: int = 8
    # Test-only: a JSON file naming errnos to inject into NVMe ops ({"write": "ENOSPC"}); empty = off.
    nvme_fault_file: str = ""
    # Register the arena with cudaHostRegister (in the background) when CUDA is present, so that
    # staging <-> arena copies are DMA; costs a CUDA context on device 0. No effect without CUDA.
    cuda_pin_arena: bool = True
    # Try to mlock the arena (needs RLIMIT_MEMLOCK); a refusal is a warning, not an error.
    mlock: bool = True
    # Eviction starts when used bytes pass high_watermark * capacity and stops at low_watermark.
    high_watermark: float = 0.95
    low_watermark: float = 0.90
    # Name of the eviction policy (see kvtierd.eviction.POLICIES).
    eviction_policy: str = "lru"
    # A LOOKUP lease keeps a chunk from eviction until its GET or this many seconds pass.
    lease_timeout_s: float = 30.0
    # A session that sends nothing (not even a PING) for this long is dead: its reservations are
    # aborted and its leases released.
    session_timeout_s: float = 30.0
    # host:port of the Prometheus /metrics exporter; "off" disables it.
    metrics_addr: str = "127.0.0.1:9464"
    # Largest header frame the daemon decodes (larger ones are answered TOO_LARGE).
    max_header_bytes: int = 1024**2
    # Largest frame ZeroMQ accepts at all; above it libzmq drops the connection (cannot be answered).
    max_frame_bytes: int = 512 * 1024**2
    # Largest inline payload frame (sessions without shared staging); answered TOO_LARGE above it.
    max_inline_bytes: int = 256 * 1024**2
    # Largest staging buffer a client may register in HELLO.
    max_staging_bytes: int = 64 * 1024**3
    # Most items (keys) in one LOOKUP/PUT/GET/DELETE.
    max_batch: int = 8192
    # Threads that copy bytes between staging buffers and tiers (memcpy releases the GIL).
    copy_threads: int = 2
    # If non-empty, HELLO must carry this token (or one of a configured tenant's tokens), and
    # STATS/CHECK need it (or admin_token, or a session opened with it); only PING answers without.
    auth_token: str = ""
    # If non-empty, a token that grants STATS and CHECK only (monitoring, health checks), never a
    # session. With either token set, STATS/CHECK without one are answered AUTH_FAILED.
    admin_token: str = ""
    # Most client connections the daemon keeps at once; newer ones are shut down at once (and the
    # ipc socket is hidden until some close). Lowered at start to fit under RLIMIT_NOFILE.
    max_connections: int = 4096
    # Most sessions alive at once; a HELLO beyond it is answered BUSY.
    max_sessions: int = 1024
    # Most sessions, and most connections, of one uid (an uncredentialed tcp peer: of its
    # address), so one user cannot starve another; 0 = a quarter of max_sessions /
    # max_connections (at least 1).
    max_sessions_per_uid: int = 0
    max_connections_per_uid: int = 0
    # Sessions with neither staging-handshake credentials nor a configured tenant's token share
    # the tenant "anonymous": "auto" allows it on a tcp:// socket (remote clients cannot do the
    # handshake) and refuses it on ipc:// (every local client can), "allow", or "refuse".
    anonymous_tenant: str = "auto"
    # Show per-tenant figures (STATS "tenants", /metrics kvtierd_tenant_* and quota rejections by
    # tenant) to anyone who reaches them; off: only to requests with admin_token or auth_token
    # (a /metrics scrape: "Authorization: Bearer TOKEN"). Aggregates stay open either way.
    expose_tenant_stats: bool = False
    # Most PUT/GET batches one session may have in flight (copies pending); more are answered BUSY.
    max_in_flight_requests: int = 64
    # Most payload bytes one inline session's GET replies may hold in the daemon at once (being
    # built or queued for a peer that has not read them yet); items past it are TOO_LARGE.
    max_inline_reply_bytes: int = 64 * 1024**2
    # Configured tenants ([tenants.NAME] tables of the TOML file only): peers matched by token,
    # then uid, then gid. A peer that matches none is its own tenant "uid:N" ("anonymous" without
    # credentials). See README "Security model".
    tenants: tuple[TenantConfig, ...] = ()
    # CPU-tier quota of each tenant without its own max_bytes (implicit ones included); 0 = only
    # the tier's capacity bounds a tenant.
    tenant_max_bytes: int = 0
    # Mode of the state directories the daemon creates or owns (the NVMe directory): "0700", or
    # "0750" to let the daemon's group read them (e.g. a backup or monitoring agent).
    state_dir_mode: str = "0700"
    # Accept a tcp:// socket on a non-loopback address.
    allow_remote: bool = False
    # Permission bits (octal) of the ZeroMQ ipc socket and of the staging handshake socket; their
    # directory gets the matching search bits. "0660": the daemon's group (engines running as
    # other users in it) may connect; tenants keep them apart. "0600": the daemon's user only.
    socket_mode: str = "0660"
    # Path of the staging handshake Unix socket. Empty: beside an ipc socket (PATH.hs), else
    # kvtierd-PORT.hs in the runtime directory. Clients learn it from PING.
    handshake_socket: str = ""
    # A staging handshake's one-time ticket must be presented in HELLO this soon; an unused one's
    # mapping is then closed.
    ticket_timeout_s: float = 10.0
    # Python logging level name.
    log_level: str = "INFO"
    # KV events (kvtierd.events, README "KV events"): ZeroMQ endpoint the PUB socket binds,
    # tcp://HOST:PORT or ipc://PATH, publishing stores and removals in vLLM's KV-event format for
    # KV-aware routers. Empty: off.
    events_addr: str = ""
    # Endpoint of the replay ROUTER (vLLM's replay protocol: missed batches by sequence number);
    # empty: no replay.
    events_replay_addr: str = ""
    # Topic of every batch; {node} and {model} (the namespace's model id) are filled in. The
    # default is the kv@<pod>@<model> form llm-d's KV-cache manager parses.
    events_topic: str = "kv@{node}@{model}"
    # {node} of the topic; empty: the host name.
    events_node: str = ""
    # Batches waiting for the publisher thread at most; a fuller queue drops (counted).
    events_max_queued_batches: int = 10000
    # Batches kept for replay.
    events_replay_batches: int = 10000
    # Publish block hashes as uint64 (the hash's last 8 bytes, big-endian), as vLLM does by default
    # (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), so they match the engines' own events; Dynamo's
    # relay decodes only ints. Off: the bytes the client sent.
    events_int_hashes: bool = True
    # The remote tier on a Mooncake Store ([remote] table of the TOML file only; see
    # kvtierd.config_remote and README "Across nodes"). None: no remote tier.
    remote: RemoteConfig | None = None

    @property
    def cpu_pages(self) -> int:
        return self.cpu_bytes // self.page_bytes

    @property
    def ipc_path(self) -> Path | None:
        return Path(self.socket[len("ipc://") :]) if self.socket.startswith("ipc://") else None

    @property
    def instance_id(self) -> str:
        """``instance``, else a stable hash of the socket: the same across restarts (and PID 1
        in every container), different for every daemon of a node (sockets are unique)."""
        return self.instance or hashlib.sha256(self.socket.encode()).hexdigest()[:16]

    @property
    def allows_anonymous(self) -> bool:
        """Whether a session without credentials or a tenant token may be ``anonymous``."""
        if self.anonymous_tenant == "auto":
            return self.ipc_path is None
        return self.anonymous_tenant == "allow"

    @property
    def socket_mode_bits(self) -> int:
        return int(self.socket_mode, 8)

    @property
    def handshake_path(self) -> Path:
        """The staging handshake socket (``kvtierd.server.handshake``)."""
        if self.handshake_socket:
            return Path(self.handshake_socket)
        if self.ipc_path is not None:
            return self.ipc_path.with_name(self.ipc_path.name + ".hs")
        port = self.socket.rpartition(":")[2]
        return default_runtime_dir() / f"kvtierd-{port}.hs"

    def resolved_arena_name(self) -> str:
        return self.arena_name or f"kvtierd-{self.instance_id}"

    def resolved_nvme_dir(self) -> Path:
        if self.nvme_dir:
            return Path(self.nvme_dir)
        return default_state_dir() / self.instance_id / "nvme"

    @property
    def state_dir_bits(self) -> int:
        return int(self.state_dir_mode, 8)

    def public_dict(self) -> dict[str, Any]:
        """The config as plain values, with every token masked (for logs and check-config)."""
        data = dataclasses.asdict(self)
        for key in ("auth_token", "admin_token"):
            if data[key]:
                data[key] = "***"
        for tenant in data["tenants"]:
            tenant["tokens"] = ["***"] * len(tenant["tokens"])
        return data


_SIZE_KEYS = {
    "cpu_bytes",
    "page_bytes",
    "max_header_bytes",
    "max_frame_bytes",
    "max_inline_bytes",
    "max_staging_bytes",
    "max_inline_reply_bytes",
    "nvme_bytes",
    "tenant_max_bytes",
}
_TABLE_KEYS = {"tenants", "remote"}  # TOML tables: file only (no env variable or flag can express them)
_FIELD_TYPES = {f.name: f.type for f in fields(Config)}


def _coerce(key: str, value: Any) -> Any:
    kind = _FIELD_TYPES[key]
    if key == "tenants":
        return parse_tenants(value)
    if key == "remote":
        return parse_remote(value)
    try:
        if key in _SIZE_KEYS:
            return parse_size(value)
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind == "int":
            if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(str(value).strip()) if isinstance(value, str) else int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
            if not math.isfinite(number):
                raise ValueError
            return number
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError
        return str(value)
    except ValueError as exc:
        detail = str(exc)
        raise ConfigError(key, value, detail if key in _SIZE_KEYS else f"a finite {kind}") from None


def _validate(cfg: Config) -> None:
    from kvtierd.eviction import POLICIES  # local: keeps config importable without tier modules

    if cfg.page_bytes <= 0 or cfg.page_bytes % 4096:
        raise ConfigError("page_bytes", cfg.page_bytes, "a positive multiple of 4096 bytes")
    if cfg.cpu_bytes < cfg.page_bytes:
        raise ConfigError("cpu_bytes", cfg.cpu_bytes, f"at least page_bytes ({cfg.page_bytes})")
    if cfg.cpu_bytes % cfg.page_bytes:
        raise ConfigError(
            "cpu_bytes", cfg.cpu_bytes, f"a multiple of page_bytes ({cfg.page_bytes})"
        )
    if not 0.0 < cfg.low_watermark <= cfg.high_watermark <= 1.0:
        raise ConfigError(
            "low_watermark/high_watermark",
            (cfg.low_watermark, cfg.high_watermark),
            "0 < low_watermark <= high_watermark <= 1",
        )
    if cfg.eviction_policy not in POLICIES:
        raise ConfigError("eviction_policy", cfg.eviction_policy, ", ".join(sorted(POLICIES)))
    for key in ("lease_timeout_s", "session_timeout_s", "ticket_timeout_s"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(key, getattr(cfg, key), "a positive number of seconds")
    if cfg.nvme_write_policy not in ("write-back", "write-through"):
        raise ConfigError("nvme_write_policy", cfg.nvme_write_policy, "write-back, write-through")
    if cfg.remote_publish not in ("on-commit", "on-evict"):
        raise ConfigError("remote_publish", cfg.remote_publish, "on-commit, on-evict")
    for key in ("nvme_publish_after_reads", "remote_publish_after_reads"):
        if getattr(cfg, key) < 0:
            raise ConfigError(key, getattr(cfg, key), "0 (every chunk) or a positive number of "
                              "reads")
    if cfg.nvme_bytes and cfg.nvme_bytes < cfg.page_bytes:
        raise ConfigError("nvme_bytes", cfg.nvme_bytes, f"0 (off) or at least page_bytes "
                          f"({cfg.page_bytes})")
    for key in ("io_threads", "io_queue_depth", "max_batch", "copy_threads", "max_header_bytes",
                "max_inline_bytes", "max_staging_bytes", "max_connections", "max_sessions",
                "max_in_flight_requests", "max_inline_reply_bytes"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(key, getattr(cfg, key), "a positive integer")
    if cfg.max_frame_bytes < max(cfg.max_inline_bytes, cfg.max_header_bytes):
        raise ConfigError(
            "max_frame_bytes", cfg.max_frame_bytes, "at least max_inline_bytes and max_header_bytes"
        )
    if cfg.state_dir_mode not in ("0700", "0750"):
        raise ConfigError("state_dir_mode", cfg.state_dir_mode, '"0700" or "0750"')
    if "/" in cfg.arena_name or cfg.arena_name.startswith("."):
        raise ConfigError("arena_name", cfg.arena_name, "a file name without '/' (under /dev/shm)")
    if cfg.instance and not _INSTANCE.fullmatch(cfg.instance):
        raise ConfigError("instance", cfg.instance, "1-64 letters, digits, '_', '.', '-' "
                          "(starting with a letter or digit), or empty")
    validate_sockets(cfg)
    validate_events(cfg)
    validate_access(cfg)
    import logging

    if not isinstance(logging.getLevelName(cfg.log_level.upper()), int):
        raise ConfigError("log_level", cfg.log_level, "DEBUG, INFO, WARNING, ERROR")


def _normalise(data: dict[str, Any]) -> dict[str, Any]:
    sock = data.get("socket")
    if isinstance(sock, str) and "://" not in sock:
        data["socket"] = f"ipc://{os.path.abspath(sock)}"
    if "log_level" in data:
        data["log_level"] = str(data["log_level"]).upper()
    return data


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("config", str(path), "an existing TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", str(path), f"valid TOML ({exc})") from None
    # A [kvtierd] table is accepted so that the daemon's keys can share a file with other tools.
    if isinstance(data.get("kvtierd"), dict):
        others = sorted(k for k in data if k != "kvtierd")
        if others:
            raise ConfigError("config", str(path), f"keys either at the top level or in [kvtierd], "
                              f"not both (top-level: {', '.join(others)})")
        data = data["kvtierd"]
    return data


@dataclass(frozen=True)
class LoadedConfig:
    """A validated Config with where each value came from, and what was ignored on the way."""

    config: Config
    # key -> "flag", "env", "file" or "default"
    sources: Mapping[str, str]
    # unknown KVTIERD_* variables (typos): reported, never fatal
    warnings: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        """``key = value (source)`` for every key, token masked, derived defaults shown."""
        values = self.config.public_dict()
        if not values["arena_name"]:
            values["arena_name"] = f"{self.config.resolved_arena_name()} (derived)"
        if not values["nvme_dir"]:
            values["nvme_dir"] = f"{self.config.resolved_nvme_dir()} (derived)"
        width = max(map(len, values))
        return [f"{key:<{width}} = {value}  ({self.sources[key]})" for key, value in values.items()]


def _env_values(env: Mapping[str, str], warnings: list[str]) -> dict[str, str]:
    """Our keys from ``KVTIERD_<KEY>`` variables. Kubernetes service links are skipped; any other
    unknown variable is a warning naming the closest key: an environment is shared with other
    software, so a stray variable must never stop the daemon or its health checks."""
    out: dict[str, str] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX + "CONFIG":
            continue
        suffix = name[len(ENV_PREFIX):]
        key = suffix.lower()
        if key in _FIELD_TYPES:
            out[key] = value
        elif not _SERVICE_LINK.fullmatch(suffix):
            warnings.append(f"environment variable {name} is not a kvtierd setting and is ignored"
                            + _closest(key, ENV_PREFIX))
    return out


def _closest(key: str, prefix: str = "") -> str:
    match = difflib.get_close_matches(key, list(_FIELD_TYPES), n=1)
    return f"; did you mean {prefix}{match[0].upper() if prefix else match[0]}?" if match else ""


def resolve_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> LoadedConfig:
    """Merge file, environment and flags (in rising precedence) into a validated Config, keeping
    each value's source. An unknown key in a file or flag is an error; in the environment a
    warning."""
    env = os.environ if env is None else env
    warnings: list[str] = []
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if path is not None:
        layers.append(("file", read_toml(path)))
    layers.append(("env", _env_values(env, warnings)))
    layers.append(("flag", {k: v for k, v in (overrides or {}).items() if v is not None}))
    merged: dict[str, Any] = {}
    sources = {key: "default" for key in _FIELD_TYPES}
    for origin, values in layers:
        for key, value in values.items():
            if key not in _FIELD_TYPES:
                raise ConfigError(key, value, "one of " + ", ".join(sorted(_FIELD_TYPES))
                                  + _closest(key))
            if key in _TABLE_KEYS and origin != "file":
                name = ENV_PREFIX + key.upper() if origin == "env" else key
                raise ConfigError(name, value, f"[{key}] tables in the TOML file only")
            merged[key] = _coerce(key, value)
            sources[key] = origin
    cfg = Config(**_normalise(merged))
    _validate(cfg)
    return LoadedConfig(cfg, sources, tuple(warnings))


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """The validated Config alone (see resolve_config)."""
    return resolve_config(path, env, overrides).config
