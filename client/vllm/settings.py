"""Our keys in vLLM's ``kv_connector_extra_config``: one frozen, validated settings object.

vLLM passes the whole extra config to the spec; the keys that start with ``kvtierd_`` are ours
(vLLM's own, such as ``blocks_per_chunk`` or ``spec_name``, are read by vLLM). A misspelt
``kvtierd_`` key or a bad value fails at engine start, naming the key, the value and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvtierd.paths import client_socket

PREFIX = "kvtierd_"


@dataclass(frozen=True)
class KVTierSettings:
    # kvtierd_address: the daemon's socket (ipc:// or tcp://); default: the first of the default
    # sockets (kvtierd.paths) that exists, the one a `kvtierd serve` without settings binds
    address: str = field(default_factory=client_socket)
    timeout_s: float = 2.0  # kvtierd_timeout_s: longest wait for one daemon reply
    retry_s: float = 5.0  # kvtierd_retry_s: after a failure, answer misses this long, then retry
    token: str = ""  # kvtierd_token: auth token or a tenant token (README "Security model")
    model: str = ""  # kvtierd_model: model id for the namespace; default: vLLM's model name
    layout_dir: str = "/dev/shm"  # kvtierd_layout_dir: where workers publish their layout
    staging_bytes: int = 0  # kvtierd_staging_bytes: worker staging buffer; 0 = client default
    # kvtierd_events_address: the daemon's events_addr (tcp:// or ipc://); with vLLM's KV events
    # on, the manager reads it to report demotions and removals of its stores (client.vllm.events)
    events_address: str = ""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> KVTierSettings:
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in extra.items():
            if not isinstance(key, str) or not key.startswith(PREFIX):
                continue
            name = key[len(PREFIX):]
            if name not in known:
                raise ValueError(f"kv_connector_extra_config: unknown key {key!r}; allowed: "
                                 f"{sorted(PREFIX + n for n in known)}")
            values[name] = _coerce(key, value, known[name].type)
        settings = cls(**values)
        settings._check()
        return settings

    def _check(self) -> None:
        if not self.address.startswith(("ipc://", "tcp://")):
            raise ValueError(f"kvtierd_address={self.address!r}; allowed: ipc://PATH or tcp://HOST:PORT")
        for name in ("timeout_s", "retry_s"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0 or (name == "timeout_s" and v == 0):
                raise ValueError(f"kvtierd_{name}={v!r}; allowed: a finite number of seconds "
                                 f"{'> 0' if name == 'timeout_s' else '>= 0'}")
        if self.staging_bytes < 0:
            raise ValueError(f"kvtierd_staging_bytes={self.staging_bytes}; allowed: >= 0")
        if self.events_address and not self.events_address.startswith(("ipc://", "tcp://")):
            raise ValueError(f"kvtierd_events_address={self.events_address!r}; allowed: "
                             "ipc://PATH, tcp://HOST:PORT (the daemon's events_addr) or empty")
        if not self.layout_dir:
            raise ValueError("kvtierd_layout_dir is empty; allowed: a directory path")


def _coerce(key: str, value: Any, kind: str) -> Any:
    try:
        if kind == "float":
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if not isinstance(value, str):
            raise TypeError
        return value
    except (TypeError, ValueError):
        raise ValueError(f"kv_connector_extra_config: {key}={value!r}; allowed: a {kind}") from None
