"""kvtierd: a node-local tiered KV-cache store (pinned CPU + NVMe) for LLM inference engines.

Commands: serve (run the daemon), ping and stats (ask a running one), check-config (print the
resolved configuration with each value's source), demo (a simulated engine worker).

Settings: flag > KVTIERD_<KEY> environment variable > TOML file (--config) > default.
Without --socket, ping and stats try the default socket locations (see kvtierd.paths).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from kvtierd import __version__
from kvtierd.config import ENV_PREFIX, Config, ConfigError, LoadedConfig, resolve_config
from kvtierd.sizes import format_size

log = logging.getLogger("kvtierd")

# Flags that override config keys (flag > env > file > default); None means "not given".
_CONFIG_FLAGS = (
    ("--socket", "socket", "ZeroMQ endpoint: ipc://PATH, tcp://127.0.0.1:PORT or a path"),
    ("--instance", "instance", "name of this daemon on the node (names its arena and NVMe dir)"),
    ("--cpu-bytes", "cpu_bytes", "capacity of the pinned-CPU tier, e.g. 4GiB"),
    ("--page-bytes", "page_bytes", "arena page size, a multiple of 4096, e.g. 64KiB"),
    ("--metrics-addr", "metrics_addr", "HOST:PORT of /metrics, or 'off'"),
    ("--arena-name", "arena_name", "file name of the arena under /dev/shm"),
    ("--eviction-policy", "eviction_policy", "eviction policy name (lru)"),
    ("--session-timeout-s", "session_timeout_s", "seconds of client silence before cleanup"),
    ("--lease-timeout-s", "lease_timeout_s", "seconds a LOOKUP lease protects a chunk"),
    ("--copy-threads", "copy_threads", "threads copying between staging buffers and tiers"),
    ("--log-level", "log_level", "DEBUG, INFO, WARNING or ERROR"),
    ("--nvme-dir", "nvme_dir", "directory of the NVMe tier"),
    ("--nvme-bytes", "nvme_bytes", "capacity of the NVMe tier, e.g. 100GiB; 0 turns it off"),
    ("--nvme-write-policy", "nvme_write_policy", "write-back (default) or write-through"),
    ("--io-threads", "io_threads", "threads running NVMe jobs"),
    ("--io-queue-depth", "io_queue_depth", "NVMe reads/writes in flight at most"),
    ("--socket-mode", "socket_mode", "octal mode of the ipc and handshake sockets, e.g. 0660"),
    ("--handshake-socket", "handshake_socket", "path of the staging handshake socket"),
    ("--events-addr", "events_addr", "KV-event PUB socket to bind: tcp://HOST:PORT, ipc://PATH"),
    ("--anonymous-tenant", "anonymous_tenant", "sessions without credentials or tenant token: "
     "auto (allowed on tcp only), allow or refuse"),
)
# Boolean keys are flags with a --no- form (argparse.BooleanOptionalAction).
_BOOL_FLAGS = (
    ("--cpu-persistent", "cpu_persistent", "keep the arena and its index across restarts"),
    ("--index-snapshot", "index_snapshot", "a clean stop writes the index snapshot"),
    ("--prefault", "prefault", "touch every arena page at start"),
    ("--mlock", "mlock", "lock the arena into RAM"),
    ("--cuda-pin-arena", "cuda_pin_arena", "register the arena with CUDA (when present)"),
    ("--expose-tenant-stats", "expose_tenant_stats", "per-tenant figures in STATS and /metrics "
     "for everyone, not only admin/auth token holders"),
)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Plain text as written, plus "(default: X)" for options that have a real default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, argparse.SUPPRESS, False):
            return text
        return f"{text} (default: %(default)s)"


def _config_default(key: str) -> str:
    if key == "socket":
        return "see kvtierd.paths: $XDG_RUNTIME_DIR/kvtierd, /run/kvtierd or /tmp/kvtierd-<uid>"
    derived = {"arena_name": "kvtierd-<instance id>", "instance": "derived from the socket",
               "nvme_dir": "<state dir>/<instance id>/nvme",
               "handshake_socket": "the ipc socket's path + .hs"}
    if key in derived:
        return derived[key]
    value = getattr(Config, key, None)
    return format_size(value) if key.endswith("_bytes") and isinstance(value, int) else str(value)


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default=os.environ.get(ENV_PREFIX + "CONFIG"),
        help=f"TOML config file (env {ENV_PREFIX}CONFIG)",
    )
    _add_key_flags(parser)


def _add_key_flags(parser: argparse.ArgumentParser) -> None:
    for flag, key, text in _CONFIG_FLAGS:
        parser.add_argument(flag, dest=key, default=None,
                            help=f"{text} [config {key}; default: {_config_default(key)}]")
    for flag, key, text in _BOOL_FLAGS:
        parser.add_argument(flag, dest=key, default=None, action=argparse.BooleanOptionalAction,
                            help=f"{text} [config {key}; default: {_config_default(key)}]")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {key: getattr(args, key, None) for _, key, _ in (*_CONFIG_FLAGS, *_BOOL_FLAGS)}


def _resolve(args: argparse.Namespace, path: str | None = None) -> LoadedConfig:
    """``check-config`` names its file positionally (maybe none); the other commands take
    ``--config``."""
    if path is None:
        path = getattr(args, "config", None)
    return resolve_config(path, overrides=_overrides(args))


def _load(args: argparse.Namespace) -> Config:
    """The config for a command; unknown KVTIERD_* variables are reported on stderr, never fatal."""
    loaded = _resolve(args)
    for warning in loaded.warnings:
        print(f"kvtierd: warning: {warning}", file=sys.stderr)
    return loaded.config


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from kvtierd.cuda_health import EXIT_CUDA_CONTEXT_LOST, CudaContextLost
    from kvtierd.server.daemon import AlreadyServing, Daemon, StartupError
    from kvtierd.tiers.arena import ArenaError
    from kvtierd.tiers.capacity import CapacityError

    loaded = _resolve(args)
    _setup_logging(loaded.config.log_level)
    for warning in loaded.warnings:
        log.warning("%s", warning)
    log.info("configuration (value and source):\n  %s", "\n  ".join(loaded.lines()))
    try:
        Daemon(loaded.config).serve()
    except (StartupError, CapacityError, ArenaError, AlreadyServing) as exc:
        log.error("%s", exc)
        return 1
    except CudaContextLost as exc:  # systemd Restart=on-failure / Kubernetes restart it
        logging.getLogger("kvtierd").critical("%s", exc)
        return EXIT_CUDA_CONTEXT_LOST
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    loaded = _resolve(args, args.file)
    for warning in loaded.warnings:
        print(f"kvtierd: warning: {warning}", file=sys.stderr)
    for line in loaded.lines():
        print(line)
    print(f"config OK: {args.file or '(no file: environment and defaults)'}")
    return 0


def _daemon_socket(args: argparse.Namespace) -> tuple[str, Config]:
    """The socket to ask (and the config): the configured one, else the first default candidate
    with a live socket file. Fails at once, saying where it looked, when there is none (no reply
    timeout)."""
    from kvtierd.paths import socket_candidates, unreachable_reason

    loaded = _resolve(args)
    for warning in loaded.warnings:
        print(f"kvtierd: warning: {warning}", file=sys.stderr)
    if loaded.sources["socket"] != "default":
        reason = unreachable_reason(loaded.config.socket)
        if reason is not None:
            raise DaemonNotFound(f"no kvtierd at {loaded.config.socket}: {reason}")
        return loaded.config.socket, loaded.config
    looked = []
    for endpoint in socket_candidates():
        reason = unreachable_reason(endpoint)
        if reason is None:
            return endpoint, loaded.config
        looked.append(reason)
    raise DaemonNotFound("no kvtierd found (give --socket or KVTIERD_SOCKET); looked for: "
                         + "; ".join(looked))


class DaemonNotFound(RuntimeError):
    pass


def cmd_stats(args: argparse.Namespace) -> int:
    from kvtierd.control import call
    from kvtierd.protocol import Op

    socket, cfg = _daemon_socket(args)
    stats = call(socket, Op.STATS, timeout_s=args.timeout, token=admin_token(cfg))["stats"]
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
    else:
        print(format_stats(stats))
    return 0


def admin_token(cfg: Config) -> str:
    """The token STATS/CHECK present: admin_token, else auth_token (config file or
    KVTIERD_ADMIN_TOKEN / KVTIERD_AUTH_TOKEN), else none."""
    return cfg.admin_token or cfg.auth_token


def cmd_ping(args: argparse.Namespace) -> int:
    from kvtierd.control import call
    from kvtierd.protocol import Op

    socket, _ = _daemon_socket(args)
    call(socket, Op.PING, timeout_s=args.timeout)
    print(f"kvtierd at {socket} is alive")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    try:
        from kvtierd.demo import run_demo
    except ModuleNotFoundError as exc:  # a daemon-only install has no torch
        print(f"kvtierd demo needs the client libraries ({exc}); install them with "
              "pip install -e '.[client]'", file=sys.stderr)
        return 1
    return run_demo(args)


def _ratio(hits: int, misses: int) -> str:
    total = hits + misses
    return f"{hits / total:.1%}" if total else "-"


def _connections_line(conns: dict[str, Any]) -> list[str]:
    if not conns:
        return []
    full = ", socket hidden (max_connections reached)" if conns.get("hidden") else ""
    return [f"connections {conns['open']} of {conns['max']}, {conns['refused']} refused{full}"]


def format_stats(stats: dict[str, Any]) -> str:
    """A readable table of a daemon's STATS reply."""
    daemon = stats["daemon"]
    counts = stats.get("counts", {})
    lines = [
        f"kvtierd {daemon['version']} pid {daemon['pid']} up {daemon['uptime_s']:.0f} s, "
        f"protocol {daemon['protocol']}, {stats['sessions']} session(s)",
        f"socket  {daemon['socket']}",
        f"metrics {daemon['metrics'] or 'off'}",
        *_connections_line(stats.get("connections") or {}),
        "",
        f"{'tier':<6}{'capacity':>12}{'used':>12}{'used%':>8}{'chunks':>10}{'pending':>9}"
        f"{'evictions':>11}",
    ]
    for name, tier in stats["tiers"].items():
        pct = tier["used_bytes"] / tier["capacity_bytes"] if tier["capacity_bytes"] else 0
        lines.append(
            f"{name:<6}{format_size(tier['capacity_bytes']):>12}{format_size(tier['used_bytes']):>12}"
            f"{pct:>8.1%}{tier['chunks']:>10}{tier['pending_chunks']:>9}"
            f"{tier.get('evictions', 0):>11}"
        )
    # The hit rate is the LOOKUP answers' (one per chunk the engine asks about, as on /metrics);
    # the GET row says how many of the chunks then asked for were served.
    hits, misses = counts.get("lookup_hits", 0), counts.get("lookup_misses", 0)
    served, failed = counts.get("get_served", 0), counts.get("get_failed", 0)
    lines += [
        "",
        f"{'chunks':<8}{'hits':>10}{'misses':>10}{'hit rate':>10}",
        f"{'lookup':<8}{hits:>10}{misses:>10}{_ratio(hits, misses):>10}",
        "",
        f"{'chunks':<8}{'served':>10}{'failed':>10}{'served%':>10}",
        f"{'get':<8}{served:>10}{failed:>10}{_ratio(served, failed):>10}",
    ]
    lines += format_tenants(stats.get("tenants", {}))
    if stats.get("tenants_hidden"):
        lines += ["", f"tenants: {stats['tenants_hidden']}"]
    lines += format_ghosts(stats.get("ghosts", {}))
    return "\n".join(lines)


def format_tenants(tenants: dict[str, Any]) -> list[str]:
    """CPU-tier bytes per tenant against its quota (kvtierd.tenants)."""
    if not tenants:
        return []
    lines = ["", f"{'tenant':<24}{'cpu used':>12}{'quota':>12}{'used%':>8}{'refused':>9}"]
    for name, t in tenants.items():
        quota = t["quota_bytes"]
        pct = f"{t['used_bytes'] / quota:.1%}" if quota else "-"
        lines.append(f"{name:<24}{format_size(t['used_bytes']):>12}"
                     f"{format_size(quota) if quota else 'none':>12}{pct:>8}"
                     f"{t['quota_rejections']:>9}")
    return lines


def format_ghosts(ghosts: dict[str, Any]) -> list[str]:
    """Capacity planning rows: each tier's hit ratio now and if it were larger (kvtierd.ghost)."""
    if not ghosts:
        return []
    scales = sorted({int(s) for g in ghosts.values() for s in g["hits"]} - {1})
    lines = [
        "",
        "capacity planning: hit ratio of LOOKUP keys if the tier were larger",
        f"{'tier':<6}{'accesses':>10}{'now':>9}" + "".join(f"{f'at {s}x':>9}" for s in scales)
        + f"{'sampled':>9}",
    ]
    for name, ghost in ghosts.items():
        accesses, hits = ghost["accesses"], ghost["hits"]
        cells = [_ratio(hits.get(str(s), 0), accesses - hits.get(str(s), 0))
                 for s in (1, *scales)]
        lines.append(f"{name:<6}{accesses:>10}" + "".join(f"{c:>9}" for c in cells)
                     + f"{ghost['sample_ratio']:>9.1%}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtierd", description=__doc__,
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"kvtierd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, formatter_class=_HelpFormatter)

    serve = add("serve", "run the daemon in the foreground")
    _add_config_flags(serve)
    serve.set_defaults(func=cmd_serve)

    stats = add("stats", "print a running daemon's tiers, chunks and hit rates")
    _add_config_flags(stats)
    stats.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    stats.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    stats.set_defaults(func=cmd_stats)

    ping = add("ping", "exit 0 if the daemon answers (health checks)")
    _add_config_flags(ping)
    ping.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for an answer")
    ping.set_defaults(func=cmd_ping)

    check = add("check-config", "validate the configuration and print each value with its "
                "source (flag, env, file or default)")
    check.add_argument("file", nargs="?", default=os.environ.get(ENV_PREFIX + "CONFIG"),
                       help=f"TOML file (default: ${ENV_PREFIX}CONFIG, else none)")
    _add_key_flags(check)
    check.set_defaults(func=cmd_check_config)

    demo = add("demo", "start a daemon, run a simulated engine worker against it, print a table")
    _add_config_flags(demo)
    demo.add_argument("--tokens", type=int, default=4096, help="prompt length per request")
    demo.add_argument("--requests", type=int, default=4, help="prompts stored and reloaded")
    demo.add_argument(
        "--keep-serving", action="store_true",
        help="leave the daemon running in the foreground after the demo (Ctrl-C stops it)",
    )
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"kvtierd: {exc}", file=sys.stderr)
        return 2
    except DaemonNotFound as exc:
        print(f"kvtierd {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # CLI boundary: one clear line (--log-level DEBUG: the traceback)
        if str(getattr(args, "log_level", "") or "").upper() == "DEBUG":
            raise
        print(f"kvtierd {args.command}: {exc}", file=sys.stderr)
        return 1
