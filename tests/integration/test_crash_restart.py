"""Crashes and restarts: kill -9 in the middle of PUT bursts and demotions, warm restarts from the
persistent arena, cold restarts from NVMe, and a changed layout after a restart.

What must hold after every restart: every chunk whose PUT was acknowledged loads byte-exact (with
a persistent arena), any other chunk that is visible loads byte-exact too (a PUT whose reply was
lost may well be complete), nothing half-written is visible, CHECK passes and no page is held by
a chunk that does not exist (used == committed in both tiers; NVMe used == the pages its index
rows name).
"""

from __future__ import annotations

import functools

import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers.kv import POISON
from helpers.nvme import (
    ChunkSet,
    InlineSession,
    flip_byte,
    index_rows,
    metric,
    numbered_bytes_in,
    numbered_chunk,
    numbered_layout,
    numbered_payload,
    nvme_layout,
    sigterm,
    split_tiers,
    tiers,
    wait_for,
    wait_settled,
)

from kvtier_client import KVTierClient
from kvtierd.protocol import Status, Tier

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def daemon_factory(daemon_factory):
    """These tests fill the NVMe tier: give it the room they were written for (the shared
    default is smaller, to keep a whole test run's preallocated files small)."""
    return functools.partial(daemon_factory, nvme_bytes="256MiB")

TESTS_DIR = Path(__file__).resolve().parent.parent
PAGE = 64 * 1024
SMALL_CPU = "4MiB"


def rows_bytes(d, page_bytes: int = PAGE) -> int:
    rows = index_rows(d.workdir / "nvme")
    return sum(count for row in rows.values() for _, count in row["runs"]) * page_bytes


def assert_clean_after_restart(d) -> dict:
    """Right after a restart: nothing pending, no page owned by a chunk that does not exist."""
    t = tiers(d)
    cpu, nvme = t["cpu"], t["nvme"]
    assert cpu["pending_chunks"] == 0 and cpu["used_bytes"] == cpu["committed_bytes"], cpu
    assert nvme["pending_chunks"] == 0 and nvme["used_bytes"] == nvme["committed_bytes"], nvme
    assert nvme["used_bytes"] == rows_bytes(d), "NVMe pages held that no index row names"
    assert len(index_rows(d.workdir / "nvme")) == nvme["chunks"]
    d.check()
    return t


# -- (a) kill -9 during a burst of PUTs and demotions ----------------------------------------------

WRITER = """
import torch
from helpers.nvme import fill_numbered, numbered_chunk, numbered_layout
from kvtier_client import KVTierClient


address, first, count, record = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
BATCH = 8
layout = numbered_layout()
bpc = layout.blocks_per_chunk[0]
kv = {name: torch.empty((BATCH * bpc, layout.groups[0].page_bytes), dtype=torch.uint8)
      for name in layout.groups[0].layer_names}
with KVTierClient.connect(address, layout=layout, kv_caches=kv, timeout_s=5) as client, \\
        open(record, "a") as out:
    for start in range(first, first + count, BATCH):
        numbers = list(range(start, min(start + BATCH, first + count)))
        chunks = []
        for j, n in enumerate(numbers):
            blocks = list(range(j * bpc, (j + 1) * bpc))
            fill_numbered(layout, kv, n, blocks)
            chunks.append(numbered_chunk(layout, n, blocks))
        out.write("try " + " ".join(map(str, numbers)) + "\\n")
        out.flush()
        stored = client.store(chunks).result()
        out.write("ack " + " ".join(str(n) for n, ok in zip(numbers, stored) if ok) + "\\n")
        out.flush()
"""


def start_writer(tmp_path: Path, address: str, first: int, count: int, record: Path):
    script = tmp_path / "writer.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(TESTS_DIR)!r})\n"
                      + textwrap.dedent(WRITER))
    log = open(tmp_path / f"writer-{first}.log", "wb")
    proc = subprocess.Popen([sys.executable, str(script), address, str(first), str(count),
                             str(record)], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc


def read_record(record: Path) -> tuple[set[int], set[int]]:
    tried: set[int] = set()
    acked: set[int] = set()
    if not record.exists():
        return tried, acked
    for line in record.read_text().splitlines():
        what, *numbers = line.split()
        (tried if what == "try" else acked).update(int(n) for n in numbers)
    return tried, acked


def verify_numbered(d, numbers: list[int], acked: set[int]) -> int:
    """Load chunks ``numbers`` into poisoned blocks: every acknowledged one must hit, every hit
    must be byte-exact, every miss must leave its blocks poisoned. Returns the hits."""
    layout = numbered_layout()
    bpc = layout.blocks_per_chunk[0]
    per_load = 4  # fewer than the arena's slots (see ChunkSet.load)
    kv = {name: torch.empty((per_load * bpc, layout.groups[0].page_bytes), dtype=torch.uint8)
          for name in layout.groups[0].layer_names}
    hits = 0
    lost: list[int] = []
    with KVTierClient.connect(d.address, layout=layout, kv_caches=kv) as client:
        for i in range(0, len(numbers), per_load):
            part = numbers[i:i + per_load]
            for t in kv.values():
                t.fill_(POISON)
            blocks = [list(range(j * bpc, (j + 1) * bpc)) for j in range(len(part))]
            loaded = client.load([numbered_chunk(layout, n, b)
                                  for n, b in zip(part, blocks)]).result(timeout=60)
            for n, b, hit in zip(part, blocks, loaded):
                got = numbered_bytes_in(layout, kv, b)
                if hit:
                    assert got == numbered_payload(layout, n), f"chunk {n}: wrong bytes served"
                    hits += 1
                else:
                    assert got == bytes([POISON]) * len(got), f"chunk {n}: a miss wrote blocks"
                    if n in acked:
                        lost.append(n)
    if lost:
        m = d.metrics_text()
        raise AssertionError(
            f"acknowledged chunks {lost} are gone after the restart; "
            f"integrity failures {metric(m, 'kvtierd_integrity_failures_total')}, "
            f"I/O failures {metric(m, 'kvtierd_io_failures_total')}, "
            f"GET results {[l for l in m.splitlines() if l.startswith('kvtierd_get_results')]}, "
            f"tiers {tiers(d)}")
    return hits


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_kill9_during_put_burst_and_demotions_loses_no_acknowledged_chunk(daemon_factory,
                                                                          tmp_path):
    d = daemon_factory("--cpu-persistent", "true", cpu_bytes="2MiB")  # ~7 chunks: demote a lot
    rng = random.Random(20240917)
    record = tmp_path / "record.txt"
    per_round = 160
    all_tried: set[int] = set()
    saw_demoting = 0
    for rnd, mode in enumerate(["while-demoting", "random", "random"]):
        first = rnd * 1000
        writer = start_writer(tmp_path, d.address, first, per_round, record)
        try:
            wait_for(lambda: writer.poll() is not None or len(read_record(record)[1]) > 0, 30,
                     "the writer's first acknowledged PUT")
            assert writer.poll() is None, (tmp_path / f"writer-{first}.log").read_text()
            if mode == "while-demoting":
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    t = tiers(d)
                    if t["cpu"]["demoting_bytes"] or t["nvme"]["pending_chunks"]:
                        saw_demoting += 1
                        break
            else:
                goal = rng.randint(8, 80)  # acknowledged chunks before the kill
                wait_for(lambda: writer.poll() is not None or
                         len(read_record(record)[1]) >= min(goal, per_round) + rnd * per_round,
                         30, "the writer making progress")
                time.sleep(rng.uniform(0.0, 0.03))
            d.kill9(keep_arena=True)
        finally:
            if writer.poll() is None:
                writer.kill()
            writer.wait(timeout=10)
        tried, acked = read_record(record)
        assert tried - all_tried, f"round {rnd}: the writer tried nothing"
        all_tried |= tried
        assert acked - {n for n in acked if n < first}, f"round {rnd}: nothing acknowledged"

        d.restart()  # same arena (re-attached), same NVMe directory
        t = assert_clean_after_restart(d)
        assert t["cpu"]["chunks"] > 0, "the persistent arena came back empty"
        hits = verify_numbered(d, sorted(all_tried), acked)
        assert hits >= len(acked)
        wait_settled(d)
        d.check()
    assert saw_demoting, "never caught a demotion in flight before kill -9"
    m = d.metrics_text()
    assert metric(m, "kvtierd_integrity_failures_total") == 0
    assert metric(m, "kvtierd_io_failures_total") == 0


# -- (b) warm restart after SIGTERM ----------------------------------------------------------------

def arena_rows(d) -> dict:
    """The persistent arena's own index (a SQLite file next to the arena in /dev/shm)."""
    path = Path(f"/dev/shm/{d.arena_name}.index")
    assert path.exists(), sorted(p.name for p in d.shm_files())
    import sqlite3

    from kvtierd.tiers.index_db import unpack_runs

    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {bytes(k): unpack_runs(r) for k, r in db.execute("SELECT key, runs FROM chunks")}
    finally:
        db.close()


def test_warm_restart_reattaches_the_arena_and_verifies_on_first_read(daemon_factory):
    d = daemon_factory("--cpu-persistent", "true", cpu_bytes="64MiB")
    layout = nvme_layout("warm")
    cs = ChunkSet(layout, 12, seed=11)
    with KVTierClient.connect(d.address, layout=layout, kv_caches=cs.kv) as client:
        assert cs.store(client) == [True] * len(cs)
        assert tiers(d)["cpu"]["chunks"] == len(cs)
        sigterm(d)
        assert Path(f"/dev/shm/{d.arena_name}").exists(), "SIGTERM removed a persistent arena"
        # damage one chunk in the arena while the daemon is down
        victim = 4
        runs = arena_rows(d)[cs.keys[victim]]
        flip_byte(Path(f"/dev/shm/{d.arena_name}"), PAGE, runs, offset_in_chunk=cs.nbytes - 1)

        d.restart()
        t = tiers(d)  # re-attached before any read
        assert t["cpu"]["chunks"] == len(cs) and t["nvme"]["chunks"] == 0, t
        assert_clean_after_restart(d)
        with cs.raw(d.address) as raw:
            assert raw.lookup(cs.keys) == [Tier.CPU] * len(cs)
        hits = cs.load(client, what="after warm restart")
        assert hits == [i != victim for i in range(len(cs))]
        m = d.metrics_text()
        assert metric(m, "kvtierd_integrity_failures_total", tier="cpu") == 1
        assert metric(m, "kvtierd_promotions_total") == 0  # served from the arena, not NVMe
        assert client.lookup([cs.loaded[victim]]) == [False]
        assert cs.keys[victim] not in arena_rows(d)
        # verified chunks stay served; nothing else is dropped later
        assert cs.load(client, what="second read") == hits
        assert metric(d.metrics_text(), "kvtierd_integrity_failures_total", tier="cpu") == 1
    d.check()


# -- (c) a changed layout after a restart ----------------------------------------------------------

def test_changed_layout_after_restart_is_a_miss_in_every_tier(daemon_factory):
    d = daemon_factory("--cpu-persistent", "true", cpu_bytes=SMALL_CPU)
    before = nvme_layout("fp-change", dtype="bfloat16")
    after = nvme_layout("fp-change", dtype="float16")  # same keys and sizes, other bytes
    assert before.fingerprint != after.fingerprint
    assert before.chunk_nbytes(0) == after.chunk_nbytes(0)
    cs_before, cs_after = ChunkSet(before, 12, seed=12), ChunkSet(after, 12, seed=12)
    assert cs_before.keys == cs_after.keys
    ns = "one-namespace"
    with KVTierClient.connect(d.address, layout=before, kv_caches=cs_before.kv,
                              namespace=ns) as client:
        assert cs_before.store(client) == [True] * len(cs_before)
    t = wait_settled(d)
    assert t["cpu"]["chunks"] > 0 and t["nvme"]["chunks"] > 0, t  # both tiers hold some
    sigterm(d)
    d.restart()
    assert tiers(d)["cpu"]["chunks"] == t["cpu"]["chunks"]

    # raw protocol: same namespace and rank, the new fingerprint
    with InlineSession(d.address, namespace=ns, fingerprint=after.fingerprint) as raw:
        keys = cs_before.keys
        assert raw.lookup(keys) == [Tier.NONE] * len(keys)
        results, frames, _ = raw.get({k: cs_before.nbytes for k in keys})
        assert results == [Status.LAYOUT_MISMATCH] * len(keys), results
        assert all(len(f) == 0 for f in frames)
        # and it cannot overwrite them either
        assert raw.put({keys[0]: b"\x5a" * cs_before.nbytes}) == [Status.LAYOUT_MISMATCH]
    m = d.metrics_text()
    assert metric(m, "kvtierd_misses_total", reason="layout_mismatch") == len(keys)  # LOOKUP
    assert metric(m, "kvtierd_get_results_total", result="layout_mismatch") == len(keys)

    # client library: the changed layout loads nothing, its blocks stay poisoned
    with KVTierClient.connect(d.address, layout=after, kv_caches=cs_after.kv,
                              namespace=ns) as client:
        assert client.lookup(cs_after.loaded) == [False] * len(cs_after)
        assert cs_after.load(client, what="changed layout") == [False] * len(cs_after)
    # the original layout still reads every chunk, from whichever tier
    with KVTierClient.connect(d.address, layout=before, kv_caches=cs_before.kv,
                              namespace=ns) as client:
        assert cs_before.load(client, what="original layout") == [True] * len(cs_before)
    assert metric(d.metrics_text(), "kvtierd_integrity_failures_total") == 0
    d.check()


# -- (d) cold restart: the arena is gone, NVMe is not ----------------------------------------------

def test_cold_restart_serves_demoted_chunks_and_forgets_the_rest(daemon_factory):
    d = daemon_factory(cpu_bytes=SMALL_CPU)
    layout = nvme_layout("cold")
    cs = ChunkSet(layout, 14, seed=13)
    with KVTierClient.connect(d.address, layout=layout, kv_caches=cs.kv) as client:
        assert cs.store(client) == [True] * len(cs)
        wait_settled(d)
        with cs.raw(d.address) as raw:
            where = split_tiers(raw, cs.keys)
        on_nvme = [cs.keys.index(k) for k in where[Tier.NVME]]
        cpu_only = [cs.keys.index(k) for k in where[Tier.CPU]]
        assert on_nvme and cpu_only and len(on_nvme) + len(cpu_only) == len(cs)

        d.stop_and_verify()  # SIGTERM: the private arena is removed with the process
        d.restart()
        t = assert_clean_after_restart(d)
        assert t["cpu"]["chunks"] == 0 and t["nvme"]["chunks"] == len(on_nvme), t
        with cs.raw(d.address) as raw:
            assert raw.lookup(cs.keys) == [Tier.NVME if i in on_nvme else Tier.NONE
                                           for i in range(len(cs))]
        hits = cs.load(client, what="after cold restart")
        assert hits == [i in on_nvme for i in range(len(cs))]
        assert metric(d.metrics_text(), "kvtierd_promotions_total") == len(on_nvme)
    d.check()


def test_kill9_mid_demotion_without_persistent_arena(daemon_factory):
    """Cold restart after kill -9 with demotions in flight: the demoted-and-indexed chunks come
    back byte-exact, a chunk whose write was cut off is invisible and its pages are free."""
    d = daemon_factory(cpu_bytes=SMALL_CPU)
    layout = nvme_layout("kill-demote")
    cs = ChunkSet(layout, 40, seed=14)
    settled_part, burst = range(0, 10), range(10, 40)
    with KVTierClient.connect(d.address, layout=layout, kv_caches=cs.kv, timeout_s=3) as client:
        assert cs.store(client, settled_part) == [True] * len(settled_part)
        wait_settled(d)
        with cs.raw(d.address) as raw:
            durable = [cs.keys.index(k) for k in split_tiers(raw, cs.keys[:10])[Tier.NVME]]
        assert durable
        future = client.store([cs.stored[i] for i in burst])
        deadline = time.monotonic() + 10
        caught = False
        while time.monotonic() < deadline and not caught:
            caught = bool(tiers(d)["nvme"]["pending_chunks"])
        d.kill9()
        assert caught, "never saw an NVMe write in flight"
        assert future.result(timeout=60) is not None  # answered False or True; never hangs

        d.restart()
        t = assert_clean_after_restart(d)
        assert t["cpu"]["chunks"] == 0
        rows = index_rows(d.workdir / "nvme")
        with cs.raw(d.address) as raw:
            where = split_tiers(raw, cs.keys)
        visible = {cs.keys.index(k) for k in where.get(Tier.NVME, [])}
        assert set(where) <= {Tier.NONE, Tier.NVME}
        assert visible == {cs.keys.index(key) for (_, _, key) in rows}
        assert set(durable) <= visible, "a chunk demoted before the crash is gone"
        hits = cs.load(client, what="after kill -9")  # hits byte-exact, misses poisoned
        assert {i for i, hit in enumerate(hits) if hit} == visible
        assert metric(d.metrics_text(), "kvtierd_integrity_failures_total") == 0
    d.check()
