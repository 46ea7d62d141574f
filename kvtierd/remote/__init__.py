"""The remote tier: kvtierd's chunks in a distributed store shared by many nodes (Mooncake Store).

``objects`` names and heads every object, ``mooncake`` talks to the store, ``tier`` is the link of
the tier chain (``kvtierd.tiers.lower.LowerTier``). Built only when the config has a ``[remote]``
table; see README "Across nodes".
"""

from __future__ import annotations

from kvtierd.config import Config
from kvtierd.tiers.arena import Arena


def build_remote_tier(cfg: Config, arena: Arena):
    """The remote tier for ``cfg.remote`` (None without a ``[remote]`` table). Fails at start
    (``RemoteSetupError``) when the backend's client is not installed; connecting to the store
    happens later, in the tier's first job, so a master that is down never stops the start."""
    if cfg.remote is None:
        return None
    from kvtierd.remote.mooncake import _import_store
    from kvtierd.remote.tier import RemoteTier

    _import_store()
    return RemoteTier(cfg.remote, arena, cfg.page_bytes)
