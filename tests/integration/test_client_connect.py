"""``KVTierClient.connect`` with the daemon down: returns at once (a missing ipc socket is seen
without a reply timeout), every call answers False with a warning, and the session opens on the
first call after the daemon starts. A daemon that is up and refuses still raises."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.daemon import DaemonProcess
from helpers.kv import (
    assert_chunk_equals,
    chunk_pages,
    poison,
    random_kv,
    random_tokens,
    simple_layout,
)

from kvtier_client import KVTierClient
from kvtier_client.transport import DaemonError

pytestmark = pytest.mark.timeout(120)


def test_connect_with_the_daemon_down_answers_misses_then_opens_the_session(tmp_path, caplog):
    layout = simple_layout(page_bytes=4096, layers=2, blocks_per_chunk=4, model="connect-down")
    gen = torch.Generator().manual_seed(10)
    kv = random_kv(layout, [16], gen)
    chunks = layout.plan(random_tokens(gen, 2 * 64), [list(range(8))])
    expected = {c.key: chunk_pages(layout, kv, c) for c in chunks}
    daemon = DaemonProcess(tmp_path / "d", [])
    # timeout_s=60: a call that waited for replies instead of seeing "no socket" would time out
    # the test (120 s) long before; nothing here measures time.
    with caplog.at_level(logging.WARNING, logger="kvtier_client"):
        client = KVTierClient.connect(daemon.address, layout=layout, kv_caches=kv, timeout_s=60)
    try:
        assert client.session_id is None
        assert "not reachable" in caplog.text and "no socket at" in caplog.text, caplog.text
        assert client.store(chunks).result(timeout=30) == [False] * len(chunks)
        assert client.lookup(chunks) == [False] * len(chunks)
        daemon.start()
        assert client.store(chunks).result(timeout=30) == [True] * len(chunks)
        assert client.session_id is not None
        poison(kv)
        assert client.load(chunks).result(timeout=30) == [True] * len(chunks)
        for chunk in chunks:
            assert_chunk_equals(layout, kv, chunk, expected[chunk.key], "after the late start")
    finally:
        client.close()
        daemon.stop_and_verify()
        daemon.remove_nvme_data()


def test_connect_to_a_daemon_that_refuses_raises(tmp_path):
    layout = simple_layout(page_bytes=4096, layers=1, blocks_per_chunk=2, model="connect-refused")
    kv = random_kv(layout, [4], torch.Generator().manual_seed(11))
    daemon = DaemonProcess(tmp_path / "d", [], env={"KVTIERD_AUTH_TOKEN": "right"})
    daemon.start()
    try:
        with pytest.raises(DaemonError, match="HELLO"):
            KVTierClient.connect(daemon.address, layout=layout, kv_caches=kv, token="wrong")
    finally:
        daemon.stop_and_verify()
        daemon.remove_nvme_data()
