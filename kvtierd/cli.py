"""``kvtierd serve | stats | ping | check-config | demo``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from kvtierd import __version__
from kvtierd.config import ENV_PREFIX, Config, ConfigError, load_config
from kvtierd.sizes import format_size

# Flags that override config keys (flag > env > file > default); None means "not given".
_CONFIG_FLAGS = (
    ("--socket", "socket", "ZeroMQ endpoint: ipc://PATH, tcp://127.0.0.1:PORT or a path"),
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
    ("--io-threads", "io_threads", "threads doing NVMe I/O"),
    ("--cpu-persistent", "cpu_persistent", "true: keep the arena across restarts (warm restart)"),
    ("--socket-mode", "socket_mode", "octal mode of the ipc and handshake sockets, e.g. 0660"),
    ("--handshake-socket", "handshake_socket", "path of the staging handshake socket"),
)


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default=os.environ.get(ENV_PREFIX + "CONFIG"),
        help=f"TOML config file (env {ENV_PREFIX}CONFIG)",
    )
    for flag, key, text in _CONFIG_FLAGS:
        parser.add_argument(flag, dest=key, default=None, help=text)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {key: getattr(args, key, None) for _, key, _ in _CONFIG_FLAGS}


def _load(args: argparse.Namespace) -> Config:
    return load_config(args.config, overrides=_overrides(args))


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from kvtierd.cuda_health import EXIT_CUDA_CONTEXT_LOST, CudaContextLost
    from kvtierd.server.daemon import AlreadyServing, Daemon

    cfg = _load(args)
    _setup_logging(cfg.log_level)
    try:
        Daemon(cfg).serve()
    except AlreadyServing as exc:
        logging.getLogger("kvtierd").error("%s", exc)
        return 1
    except CudaContextLost as exc:  # systemd Restart=on-failure / Kubernetes restart it
        logging.getLogger("kvtierd").critical("%s", exc)
        return EXIT_CUDA_CONTEXT_LOST
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    cfg = load_config(args.file, overrides=_overrides(args))
    for key, value in cfg.public_dict().items():
        print(f"{key:<18} {value}")
    print(f"config OK: {args.file}")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from kvtierd.control import call
    from kvtierd.protocol import Op

    cfg = _load(args)
    stats = call(cfg.socket, Op.STATS, timeout_s=args.timeout, token=admin_token(cfg))["stats"]
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

    cfg = _load(args)
    call(cfg.socket, Op.PING, timeout_s=args.timeout)
    print(f"kvtierd at {cfg.socket} is alive")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvtierd.demo import run_demo

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
    parser = argparse.ArgumentParser(prog="kvtierd", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvtierd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    _add_config_flags(serve)
    serve.set_defaults(func=cmd_serve)

    stats = sub.add_parser("stats", help="print a running daemon's tiers, chunks and hit rates")
    _add_config_flags(stats)
    stats.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    stats.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    stats.set_defaults(func=cmd_stats)

    ping = sub.add_parser("ping", help="exit 0 if the daemon answers (health checks)")
    _add_config_flags(ping)
    ping.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for an answer")
    ping.set_defaults(func=cmd_ping)

    check = sub.add_parser("check-config", help="validate a TOML config file and print it")
    check.add_argument("file", help="TOML file")
    for flag, key, text in _CONFIG_FLAGS:
        check.add_argument(flag, dest=key, default=None, help=text)
    check.set_defaults(func=cmd_check_config)

    demo = sub.add_parser(
        "demo", help="start a daemon, run a simulated engine worker against it, print a table"
    )
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
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # CLI boundary: one clear line (--log-level DEBUG: the traceback)
        if str(getattr(args, "log_level", "") or "").upper() == "DEBUG":
            raise
        print(f"kvtierd {args.command}: {exc}", file=sys.stderr)
        return 1
