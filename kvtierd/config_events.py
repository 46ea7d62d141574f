"""Validation of the ``events_*`` keys (kvtierd.events): the endpoints, the topic template and
the queue bounds, each refusal naming the key, the value and what is allowed."""

from __future__ import annotations

from typing import Any

from kvtierd.config_error import ConfigError

MAX_BATCHES = 1_000_000


def _check_endpoint(key: str, value: str) -> None:
    if value.startswith("ipc://") and len(value) > len("ipc://"):
        return
    if value.startswith("tcp://"):
        host, _, port = value[len("tcp://"):].rpartition(":")
        if host and port.isdigit() and 0 < int(port) <= 65535:
            return
    raise ConfigError(key, value, "tcp://HOST:PORT (HOST may be * for every interface), "
                      "ipc://PATH, or empty (off)")


def validate_events(cfg: Any) -> None:
    if cfg.events_addr:
        _check_endpoint("events_addr", cfg.events_addr)
    if cfg.events_replay_addr:
        if not cfg.events_addr:
            raise ConfigError("events_replay_addr", cfg.events_replay_addr,
                              "empty unless events_addr is set (replay serves published batches)")
        _check_endpoint("events_replay_addr", cfg.events_replay_addr)
        if cfg.events_replay_addr == cfg.events_addr:
            raise ConfigError("events_replay_addr", cfg.events_replay_addr,
                              "an endpoint other than events_addr")
    try:
        rendered = cfg.events_topic.format(node="n", model="m")
    except (KeyError, IndexError, ValueError):
        rendered = None
    if rendered is None or len(cfg.events_topic) > 256:
        raise ConfigError("events_topic", cfg.events_topic,
                          "a string of at most 256 characters with only {node} and {model} "
                          "as placeholders")
    if len(cfg.events_node) > 128 or "@" in cfg.events_node:
        raise ConfigError("events_node", cfg.events_node,
                          "at most 128 characters without '@' (it is one field of the topic)")
    for key in ("events_max_queued_batches", "events_replay_batches"):
        value = getattr(cfg, key)
        if not 1 <= value <= MAX_BATCHES:
            raise ConfigError(key, value, f"an int in 1..{MAX_BATCHES}")
