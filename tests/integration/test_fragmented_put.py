"""PUTs and GETs in a fragmented CPU tier: chunks whose pages are several runs, in a real daemon.

4 MiB tier of 64 KiB pages (64 pages) that evicts only when full (both watermarks 1.0).
Single-page chunks fill it and every other one is deleted, so the free pages are 32 holes of one
page: every chunk stored next is several runs. The PUT's copy job takes them in one compiled call
(``copy_hash_chunks``), whether a chunk is longer than a copy piece (256 KiB) or not, and the
GET's job copies all their ranges out in one call (``copy_out_many``). Each must come back
byte-exact into poisoned staging, and the daemon's own checks must pass.
"""

from __future__ import annotations

import os

import pytest
from helpers.bad_input import Session, names, namespace, write_toml

from kvtierd.protocol import Op

pytestmark = pytest.mark.timeout(120)

PAGE = 64 * 1024
POISON = 0xA7


def test_chunks_spanning_scattered_pages_come_back_byte_exact(daemon_factory, memfd, tmp_path):
    config = write_toml(tmp_path / "full.toml", "high_watermark = 1.0\nlow_watermark = 1.0\n")
    d = daemon_factory("--config", str(config), cpu_bytes="4MiB", page_bytes="64KiB",
                       nvme_bytes="0")
    staging = memfd(8 * 1024**2)
    session = Session(d.address, namespace(), staging=staging)
    try:
        singles = [b"single-%02d" % i for i in range(64)]
        for i in range(64):
            staging.write(i * PAGE, os.urandom(PAGE))
        assert names(session.put([[key, i * PAGE, PAGE] for i, key in enumerate(singles)])[
            "results"]) == ["OK"] * 64
        reply, _ = session.request(Op.DELETE, keys=singles[::2])
        assert names(reply["results"]) == ["OK"] * 32, reply
        assert d.cpu()["used_bytes"] == 32 * PAGE

        # 5 + 1 + 3 + 2 + 9 + 7 = 27 pages into 32 one-page holes: each chunk spans several runs
        sizes = [5 * PAGE - 11, PAGE // 3, 3 * PAGE, 2 * PAGE - 1, 9 * PAGE - 4096, 7 * PAGE]
        keys = [b"scattered-%d" % i for i in range(len(sizes))]
        offsets, pos = [], 0
        for nbytes in sizes:
            offsets.append(pos)
            pos += nbytes + 13
        payloads = [os.urandom(n) for n in sizes]
        for offset, data in zip(offsets, payloads):
            staging.write(offset, data)
        items = [[key, offset, n] for key, offset, n in zip(keys, offsets, sizes)]
        assert names(session.put(items)["results"]) == ["OK"] * len(keys)
        assert session.lookup(keys + singles[1::2]) == [1] * (len(keys) + 32)  # nothing evicted

        staging.fill(POISON)
        reply, _ = session.get(items)
        assert names(reply["results"]) == ["OK"] * len(keys), reply
        for offset, data in zip(offsets, payloads):
            assert staging.read(offset, len(data)) == data
        assert d.cpu()["used_bytes"] == (32 + 27) * PAGE
        d.check()  # the daemon's invariants, the index against the pages
    finally:
        session.close()
