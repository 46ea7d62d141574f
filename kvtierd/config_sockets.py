"""Validation of the endpoint keys: the request socket (ipc or loopback tcp unless
``allow_remote``), the socket files' mode and the handshake socket's path (a Unix socket path
has a hard length limit the kernel would otherwise report as a bare EINVAL at bind), and the
metrics address. Each refusal names the key, the value and what is allowed."""

from __future__ import annotations

import ipaddress
import os
from typing import Any

from kvtierd.config_error import ConfigError


def validate_sockets(cfg: Any) -> None:
    _validate_socket(cfg)
    _validate_socket_files(cfg)
    _validate_metrics_addr(cfg.metrics_addr)


def _validate_socket(cfg: Any) -> None:
    if cfg.socket.startswith("ipc://"):
        if len(cfg.socket) <= len("ipc://"):
            raise ConfigError("socket", cfg.socket, "ipc://PATH with a non-empty path")
        return
    if not cfg.socket.startswith("tcp://"):
        raise ConfigError("socket", cfg.socket, "ipc://PATH, tcp://HOST:PORT or a plain path")
    host, _, port = cfg.socket[len("tcp://") :].rpartition(":")
    host = host.strip("[]")
    if not port.isdigit() or not host or not 0 < int(port) <= 65535:
        raise ConfigError("socket", cfg.socket, "tcp://HOST:PORT with a port in 1..65535")
    if cfg.allow_remote:
        return
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(
            "socket", cfg.socket, "a loopback tcp address (127.0.0.1, ::1) unless allow_remote"
        )


SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes, NUL included


def _validate_socket_files(cfg: Any) -> None:
    mode = cfg.socket_mode
    if not (3 <= len(mode) <= 4 and all(c in "01234567" for c in mode)) or (
            len(mode) == 4 and mode[0] != "0") or int(mode, 8) & 0o600 != 0o600:
        raise ConfigError("socket_mode", mode, "an octal mode string such as \"0600\", \"0660\" "
                          "or \"0666\" (the owner needs read and write)")
    if int(mode, 8) & 0o111:
        raise ConfigError("socket_mode", mode, "a mode without execute bits (0600, 0660, 0666)")
    path = str(cfg.handshake_path)
    if cfg.handshake_socket and not os.path.isabs(path):
        raise ConfigError("handshake_socket", path, "an absolute path (or empty for the default)")
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        raise ConfigError("handshake_socket" if cfg.handshake_socket else "socket", path,
                          f"a handshake socket path of at most {SUN_PATH_MAX} bytes (a Unix "
                          "socket's limit); choose a shorter socket path or set handshake_socket")


def _validate_metrics_addr(addr: str) -> None:
    if addr == "off":
        return
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError("metrics_addr", addr, "HOST:PORT (port 0 picks a free one) or 'off'")
