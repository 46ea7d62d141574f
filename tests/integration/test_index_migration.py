"""A daemon restarted onto indexes of schema 3 (the persistent arena's and the NVMe tier's, as a
schema-3 daemon left them) migrates both at start and serves every chunk byte-exact from the
tier it was in, with nothing else changed: the same chunks, pages and LRU victims."""

from __future__ import annotations

import functools
import sqlite3
from pathlib import Path

import pytest
from helpers.index_schema3 import downgrade_to_schema_3
from helpers.nvme import ChunkSet, index_rows, nvme_layout, sigterm, split_tiers, tiers, wait_settled

from kvtier_client import KVTierClient
from kvtierd.protocol import Tier
from kvtierd.tiers.index_db import SCHEMA_VERSION
from kvtierd.tiers.nvme import INDEX_NAME

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def daemon_factory(daemon_factory):
    return functools.partial(daemon_factory, nvme_bytes="128MiB")


def schema_of(path: Path) -> str:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT v FROM meta WHERE k = 'schema'").fetchone()[0]
    finally:
        conn.close()


def arena_view(path: Path) -> dict:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {bytes(k): (fp, n, bytes(c), bytes(r)) for k, fp, n, c, r in conn.execute(
            "SELECT key, fingerprint, nbytes, checksum, runs FROM chunks")}
    finally:
        conn.close()


def test_restart_onto_schema_3_indexes_migrates_them_and_serves_every_chunk(daemon_factory):
    d = daemon_factory("--cpu-persistent", cpu_bytes="4MiB")  # 14 chunks: about half demoted
    layout = nvme_layout("schema3")
    cs = ChunkSet(layout, 14, seed=23)
    arena_index = Path(f"/dev/shm/{d.arena_name}.index")
    nvme_index = d.workdir / "nvme" / INDEX_NAME
    with KVTierClient.connect(d.address, layout=layout, kv_caches=cs.kv) as client:
        assert cs.store(client) == [True] * len(cs)
        wait_settled(d)
        with cs.raw(d.address) as raw:
            where = split_tiers(raw, cs.keys)
            before = raw.lookup(cs.keys)
        assert where[Tier.CPU] and where[Tier.NVME], where
        t_before = tiers(d)
        sigterm(d)
        arena_rows, nvme_rows = arena_view(arena_index), index_rows(d.workdir / "nvme")
        assert downgrade_to_schema_3(arena_index) == len(arena_rows)
        assert downgrade_to_schema_3(nvme_index) == len(nvme_rows)
        assert schema_of(arena_index) == schema_of(nvme_index) == "3"

        d.restart()
        log = d.log()
        assert log.count(f"from schema 3 to {SCHEMA_VERSION}") == 2, log
        assert schema_of(arena_index) == schema_of(nvme_index) == str(SCHEMA_VERSION)
        assert arena_view(arena_index) == arena_rows and index_rows(d.workdir / "nvme") == nvme_rows
        t = tiers(d)
        for tier in ("cpu", "nvme"):
            assert t[tier]["chunks"] == t_before[tier]["chunks"], (t, t_before)
            assert t[tier]["used_bytes"] == t_before[tier]["used_bytes"], (t, t_before)
        with cs.raw(d.address) as raw:
            assert raw.lookup(cs.keys) == before
        assert cs.load(client, what="after the migration") == [True] * len(cs)
    d.check()
