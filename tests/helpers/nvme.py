"""Helpers for NVMe-tier tests: raw inline sessions, deterministic payloads, metrics, the index
file (read-only), fault injection and waiting for the tiers to settle."""

from __future__ import annotations

import json
import os
import random
import re
import sqlite3
from pathlib import Path
from typing import Any, Iterable

from helpers.handshake import ticket
from helpers.raw import RawClient
from helpers.wait import wait_for  # noqa: F401  (re-exported for the NVMe tests)

from kvtierd.protocol import Op, Status
from kvtierd.tiers.index_db import unpack_runs

DATA_NAME = "chunks.data"
INDEX_NAME = "index.sqlite"


def payload(seed: Any, nbytes: int) -> bytes:
    """Deterministic random bytes for ``seed`` (never zeros): a test can recompute them."""
    return random.Random(f"kvtierd-nvme/{seed}").randbytes(nbytes)


# -- a raw inline session --------------------------------------------------------------------------

class InlineSession:
    """One HELLO'd raw DEALER with inline payload frames (no shared memory)."""

    def __init__(self, address: str, namespace: str = "nvme", fingerprint: str = "fp-nvme",
                 rank: int = 0, timeout_s: float = 30.0) -> None:
        self.raw = RawClient(address, timeout_s=timeout_s)
        # The inline ticket carries our credentials: the same tenant (uid) as a KVTierClient of
        # this process, whose chunks these sessions read back.
        staging = {"kind": "inline", "ticket": ticket(address, "inline")}
        rep, _ = self.raw.request(Op.HELLO, namespace=namespace, rank=rank, world_size=rank + 1,
                                  fingerprint=fingerprint, staging=staging)
        assert rep["status"] == Status.OK, rep
        self.session = rep["session"]

    def put(self, items: dict[bytes, bytes]) -> list[int]:
        rep, _ = self.raw.request(Op.PUT, frames=list(items.values()),
                                  items=[[k, 0, len(v)] for k, v in items.items()])
        assert rep["status"] == Status.OK, rep
        return rep["results"]

    def get(self, sizes: dict[bytes, int]) -> tuple[list[int], list[bytes], list]:
        """GET ``{key: nbytes}``: (per-item statuses, payload frames, error entries)."""
        rep, frames = self.raw.request(Op.GET, items=[[k, 0, n] for k, n in sizes.items()])
        assert rep["status"] == Status.OK, rep
        assert len(frames) == len(sizes), (len(frames), rep)
        return rep["results"], frames, rep["errors"]

    def lookup(self, keys: list[bytes], lease: bool = False) -> list[int]:
        rep, _ = self.raw.request(Op.LOOKUP, keys=keys, lease=lease)
        assert rep["status"] == Status.OK, rep
        return rep["tiers"]

    def delete(self, keys: list[bytes]) -> list[int]:
        rep, _ = self.raw.request(Op.DELETE, keys=keys)
        assert rep["status"] == Status.OK, rep
        return rep["results"]

    def close(self) -> None:
        try:
            self.raw.request(Op.BYE)
        finally:
            self.raw.close()

    def __enter__(self) -> InlineSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- metrics ---------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)$")


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0.0 if none)."""
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


# -- the tier's files ------------------------------------------------------------------------------

def index_rows(nvme_dir: Path) -> dict[tuple[str, int, bytes], dict]:
    """The NVMe index as committed on disk, opened read-only: {(ns, rank, key): row}."""
    db = sqlite3.connect(f"file:{nvme_dir / INDEX_NAME}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT namespace, rank, key, fingerprint, nbytes, checksum, runs "
                          "FROM chunks").fetchall()
    finally:
        db.close()
    return {(ns, rank, bytes(key)): {"fingerprint": fp, "nbytes": nbytes,
                                     "checksum": bytes(checksum), "runs": unpack_runs(runs)}
            for ns, rank, key, fp, nbytes, checksum, runs in rows}


def flip_byte(path: Path, page_bytes: int, runs: list, offset_in_chunk: int = 0) -> None:
    """Flip one byte of a chunk stored in pages ``runs`` of the file ``path`` (the NVMe data file
    or an arena), in place and durably."""
    pos = offset_in_chunk
    for start, count in runs:
        if pos < count * page_bytes:
            file_pos = start * page_bytes + pos
            break
        pos -= count * page_bytes
    else:
        raise ValueError(f"offset {offset_in_chunk} is past the chunk's pages")
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, file_pos)
        assert os.pwrite(fd, bytes([old[0] ^ 0xFF]), file_pos) == 1
        os.fsync(fd)
    finally:
        os.close(fd)


def write_faults(path: Path, faults: dict[str, str] | None) -> None:
    """Set (or with None, clear) the faults a daemon started with ``nvme_fault_file`` injects."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(faults or {}))
    os.replace(tmp, path)  # atomic: the daemon never reads half a file


def fault_config(workdir: Path, fault_file: Path, **extra: Any) -> Path:
    """A TOML config that names ``fault_file`` (and any ``extra`` keys)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "faults.toml"
    lines = [f"nvme_fault_file = {json.dumps(str(fault_file))}"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


# -- tier state ------------------------------------------------------------------------------------

def tiers(d) -> dict:
    return d.stats()["tiers"]


def settled(d) -> dict | None:
    """The tiers if nothing moves between them any more (no demotion, write or delete pending)."""
    t = tiers(d)
    cpu, nvme = t["cpu"], t.get("nvme")
    if cpu["demoting_bytes"] or cpu["pending_chunks"]:
        return None
    if nvme is not None and (nvme["pending_chunks"]
                             or nvme["used_bytes"] != nvme["committed_bytes"]):
        return None
    return t


def wait_settled(d, timeout_s: float = 30.0) -> dict:
    return wait_for(lambda: settled(d), timeout_s, "tiers settled (no demotion or delete pending)")


def split_tiers(session: InlineSession, keys: Iterable[bytes]) -> dict[int, list[bytes]]:
    """LOOKUP ``keys`` and group them by the tier reported (0 = miss)."""
    keys = list(keys)
    out: dict[int, list[bytes]] = {}
    for key, tier in zip(keys, session.lookup(keys)):
        out.setdefault(tier, []).append(key)
    return out


# -- chunks through the client library -------------------------------------------------------------

def nvme_layout(model: str = "nvme-tier", *, page_bytes: int = 128 * 1024 + 4108, layers: int = 2,
                blocks_per_chunk: int = 4, dtype: str = "bfloat16"):
    """A one-group layout whose chunks (~1 MiB here) end inside a daemon page."""
    from kvtier_client import KVGroup, KVLayout

    return KVLayout(
        groups=[KVGroup(tokens_per_block=16, page_bytes=page_bytes,
                        layer_names=tuple(f"l{i}" for i in range(layers)))],
        blocks_per_chunk=blocks_per_chunk, tokens_per_hash=16, model=model, dtype=dtype)


class ChunkSet:
    """``n`` chunks of one request: stored from block table A, loaded into table B (disjoint), so a
    load proves the bytes came from the daemon, not from the blocks they were stored from."""

    def __init__(self, layout, n: int, seed: int) -> None:
        import torch
        from helpers.kv import chunk_pages, random_kv, random_tokens

        self.layout = layout
        gen = torch.Generator().manual_seed(seed)
        bpc, tpc = layout.blocks_per_chunk[0], layout.tokens_per_chunk[0]
        need = n * bpc
        num_blocks = 2 * need + 3
        tokens = random_tokens(gen, n * tpc)
        self.kv = random_kv(layout, [num_blocks], gen)
        self.stored = layout.plan(tokens, [list(range(need))], trim_sliding_window=False)
        self.loaded = layout.plan(tokens, [[num_blocks - 1 - i for i in range(need)]],
                                  trim_sliding_window=False)
        assert len(self.stored) == len(self.loaded) == n
        self.keys = [c.key for c in self.stored]
        self.first_load_block = need  # blocks need.. hold table B and 3 spares: poisoned for loads
        self.nbytes = layout.chunk_nbytes(0)
        self.expected = [chunk_pages(layout, self.kv, c) for c in self.stored]

    def __len__(self) -> int:
        return len(self.stored)

    def store(self, client, idx: Iterable[int] | None = None) -> list[bool]:
        idx = range(len(self)) if idx is None else list(idx)
        return client.store([self.stored[i] for i in idx]).result(timeout=120)

    def load(self, client, idx: Iterable[int] | None = None, what: str = "",
             per_request: int | None = 2) -> list[bool]:
        """Poison every block of table B, load ``idx`` into it; hits must be byte-exact and misses
        must leave their blocks poisoned. Returns the hits.

        ``per_request`` chunks go in one GET (None: all at once). Small by default: a GET whose
        own chunks fill a small arena gets NO_SPACE misses for its NVMe items (see
        test_get_whose_cpu_hits_fill_the_arena_still_promotes_its_nvme_items).
        """
        from helpers.kv import POISON, assert_chunk_equals, assert_chunk_poisoned

        idx = range(len(self)) if idx is None else list(idx)
        for t in self.kv.values():  # table A keeps the source bytes for later stores
            t[self.first_load_block:].fill_(POISON)
        step = per_request or max(1, len(idx))
        hits: list[bool] = []
        for i in range(0, len(idx), step):
            part = [self.loaded[j] for j in idx[i:i + step]]
            hits += client.load(part).result(timeout=120)
        for i, hit in zip(idx, hits, strict=True):
            if hit:
                assert_chunk_equals(self.layout, self.kv, self.loaded[i], self.expected[i],
                                    f"{what} chunk #{i}")
            else:
                assert_chunk_poisoned(self.layout, self.kv, self.loaded[i], f"{what} chunk #{i}")
        return hits

    def raw(self, address: str) -> InlineSession:
        """A raw session that sees this layout's keys (same namespace, rank and fingerprint)."""
        return InlineSession(address, namespace=self.layout.namespace,
                             fingerprint=self.layout.fingerprint, rank=self.layout.rank)


def sigterm(d) -> None:
    """Stop a daemon with SIGTERM, keeping a persistent arena (``stop_and_verify`` removes it):
    it must exit 0 without a traceback."""
    import signal

    d.check()
    d.proc.send_signal(signal.SIGTERM)
    code = d.proc.wait(timeout=30)
    d._log.close()
    assert code == 0, f"kvtierd exited with {code}:\n{d.log()}"
    assert "Traceback" not in d.log(), d.log()


# -- numbered chunks whose key and bytes a test can recompute (crash tests) ------------------------

def numbered_layout():
    """~257 KiB chunks (5 daemon pages of 64 KiB, the last one partly used)."""
    return nvme_layout("numbered", page_bytes=32 * 1024 + 100)


def numbered_chunk(layout, n: int, blocks: list[int]):
    """Chunk number ``n`` (its own request of one chunk) planned onto ``blocks``."""
    rng = random.Random(f"numbered-tokens/{n}")
    tokens = [rng.randrange(150_000) for _ in range(layout.tokens_per_chunk[0])]
    (chunk,) = layout.plan(tokens, [blocks], trim_sliding_window=False)
    return chunk


def numbered_payload(layout, n: int) -> bytes:
    return payload(("numbered", n), layout.chunk_nbytes(0))


def fill_numbered(layout, kv: dict, n: int, blocks: list[int]) -> None:
    """Write chunk ``n``'s payload into ``blocks`` of ``kv`` ([layer][block][page] order)."""
    import torch

    group = layout.groups[0]
    data = torch.frombuffer(bytearray(numbered_payload(layout, n)), dtype=torch.uint8)
    pages = data.view(len(group.layer_names), len(blocks), group.page_bytes)
    for li, name in enumerate(group.layer_names):
        kv[name][blocks] = pages[li]


def numbered_bytes_in(layout, kv: dict, blocks: list[int]) -> bytes:
    group = layout.groups[0]
    return b"".join(kv[name][blocks].numpy().tobytes() for name in group.layer_names)
