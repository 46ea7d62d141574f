"""The daemon's tiers below the arena, and the arena's crash-safe index: built from the config.

Kept apart from ``kvtierd.server.daemon`` (which wires and runs the parts): what each tier needs
from the config, the order of the chain (cpu → nvme → remote) and the publishing policy of each
link are decided here, in one place.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kvtierd.config import Config
from kvtierd.remote import build_remote_tier
from kvtierd.remote.mooncake import RemoteSetupError
from kvtierd.server.startup import StartupError
from kvtierd.tiers.arena import SHM_DIR, Arena
from kvtierd.tiers.cpu import CpuTier
from kvtierd.tiers.index_db import ChunkIndexDB
from kvtierd.tiers.lower import LowerTier, Publish, PublishPolicy
from kvtierd.tiers.nvme_lower import NvmeLowerTier

log = logging.getLogger(__name__)


def remote_policy(cfg: Config) -> PublishPolicy:
    """The remote tier's publishing policy (``remote_publish``, ``remote_publish_after_reads``)."""
    return PublishPolicy(Publish(cfg.remote_publish), cfg.remote_publish_after_reads)


def attach_arena_index(cfg: Config, tier: CpuTier, arena: Arena) -> None:
    """A persistent arena's index (SQLite beside it in /dev/shm), its chunks recovered."""
    if not cfg.cpu_persistent:
        return
    db = ChunkIndexDB(
        SHM_DIR / f"{arena.name}.index",
        {"page_bytes": str(cfg.page_bytes), "cpu_bytes": str(cfg.cpu_bytes)},
        synchronous="NORMAL",  # tmpfs: survives a daemon crash, not a reboot (nor does the arena)
    )
    recovered = tier.attach_index(db, arena.attached)
    log.info("persistent arena %s: %s, %d chunks re-attached (checked on first read)",
             arena.path, "re-attached" if arena.attached else "new", recovered)


def lower_tiers(cfg: Config, arena: Arena) -> list[tuple[LowerTier, PublishPolicy]]:
    """The tiers below the arena, in chain order, each with its publishing policy. Opened one
    by one; a failure closes the ones already open (the start fails with its message)."""
    tiers: list[tuple[LowerTier, PublishPolicy]] = []
    try:
        nvme = open_nvme(cfg)
        if nvme is not None:
            when = (Publish.ON_COMMIT if cfg.nvme_write_policy == "write-through"
                    else Publish.ON_EVICT)
            tiers.append((nvme, PublishPolicy(when, cfg.nvme_publish_after_reads)))
        try:
            remote = build_remote_tier(cfg, arena)
        except RemoteSetupError as exc:
            raise StartupError("remote.backend", cfg.remote.backend, str(exc)) from None
        if remote is not None:
            tiers.append((remote, remote_policy(cfg)))
    except BaseException:
        for tier, _ in tiers:
            tier.close()
        raise
    return tiers


def open_nvme(cfg: Config) -> NvmeLowerTier | None:
    if not cfg.nvme_bytes:
        log.info("NVMe tier off (nvme_bytes = 0)")
        return None
    fault_file = Path(cfg.nvme_fault_file) if cfg.nvme_fault_file else None
    if fault_file is not None:
        log.warning("NVMe fault injection is ON (%s): a test setting", fault_file)
    return NvmeLowerTier(cfg.resolved_nvme_dir(), cfg.nvme_bytes, cfg.page_bytes,
                         policy=cfg.eviction_policy, fault_file=fault_file,
                         instance=cfg.instance_id, dir_mode=cfg.state_dir_bits,
                         queue_depth=cfg.io_queue_depth)
