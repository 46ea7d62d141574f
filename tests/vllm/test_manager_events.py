"""vLLM's own KV-event path: the manager's take_events() against a real daemon with events on.
Its stores come out as OffloadingEvents on CPU; the daemon's later demotion, removal and restart
come back from the daemon's event stream; vLLM's own OffloadingEventsTracker turns them into the
BlockStored/BlockRemoved its publisher sends, named by vLLM's block hashes."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.nvme import metric, wait_settled
from helpers.wait import wait_for

with warnings.catch_warnings():  # vLLM's imports warn (torch.jit deprecations); not ours
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
    )
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.kv_offload.base import Medium, OffloadingKVEventsConfig, ReqContext

    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    from kvtier_client import KVGroup, KVLayout, KVTierClient
    from kvtier_client.vllm.jobs import job_chunks
    from kvtier_client.vllm.manager import KVTierOffloadingManager
    from kvtier_client.vllm.settings import KVTierSettings

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(180)]
PAGE = 64 * 1024


def config(events: bool) -> OffloadingConfig:
    parallel = OffloadingParallelConfig(
        rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
        is_parallelism_agnostic=False)
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=0, enable_kv_cache_events=events, extra_config={},
        engine_id="mgr-events", model=OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1), parallel=parallel)


def vllm_key(n: int, group: int = 0) -> bytes:
    """vLLM's OffloadKey: a 32-byte block hash + the group as 4 big-endian bytes."""
    return n.to_bytes(4, "big") * 8 + group.to_bytes(4, "big")


def collect(manager, until, what: str) -> list:
    got: list = []

    def done():
        got.extend(manager.take_events())
        return until(got)
    wait_for(done, 90, what)
    return got


def test_take_events_reports_stores_and_the_daemons_later_moves(daemon_factory, tmp_path):
    events_addr = f"ipc://{tmp_path / 'events.sock'}"
    d = daemon_factory("--events-addr", events_addr, cpu_bytes="1MiB", nvme_bytes="8MiB")
    settings = KVTierSettings(address=d.address, layout_dir=str(tmp_path),
                              events_address=events_addr)
    manager = KVTierOffloadingManager(config(events=True), settings)
    quiet = KVTierOffloadingManager(config(events=False), settings)  # nothing to drain
    layout = KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=PAGE, layer_names=("l0",))],
                      blocks_per_chunk=1, tokens_per_hash=16, model="tiny", dtype="bfloat16")
    keys = [vllm_key(i) for i in range(20)]
    kv = {"l0": torch.randint(0, 256, (32, PAGE), dtype=torch.uint8)}
    try:
        wait_for(lambda: metric(d.metrics_text(), "kvtierd_events_subscribers") >= 1, 30,
                 "the manager subscribed to the daemon's events")
        req = ReqContext(req_id="r")
        with KVTierClient.connect(d.address, layout=layout, kv_caches=kv) as client:
            first = job_chunks(layout, keys[:4], list(range(1, 5)), [4], [0])
            assert all(client.store(first).result(timeout=30))
            manager.complete_store(keys[:4], req)
            quiet.complete_store(keys[:4], req)
            stored = collect(manager, lambda g: g, "the stores")
            assert [(e.medium, e.removed, e.keys) for e in stored] == [
                (Medium.CPU, False, keys[:4])]
            assert list(quiet.take_events()) == []

            # 16 more one-page chunks: the first four are demoted to NVMe, then leave the arena.
            rest = job_chunks(layout, keys[4:], [b % 31 + 1 for b in range(4, 20)], [16], [4])
            assert all(client.store(rest).result(timeout=30))
            wait_settled(d)
            moved = collect(manager, lambda g: sum(len(e.keys) for e in g if e.removed) >= 4,
                            "the demotions")
            demoted = {bytes(k) for e in moved if e.medium == Medium.STORAGE and not e.removed
                       for k in e.keys}
            left_cpu = {bytes(k) for e in moved if e.medium == Medium.CPU and e.removed
                        for k in e.keys}
            assert demoted == left_cpu == set(keys[:4]), moved
            client.delete(first[:1])

        # vLLM's own translation of what take_events yields: what its publisher sends.
        tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, False))
        gone = collect(manager, lambda g: any(e.removed and e.medium == Medium.STORAGE
                                              for e in g), "the DELETE")
        out = list(tracker.take_events(stored + moved + gone))
        named = [maybe_convert_block_hash(k[:-4]) for k in keys[:4]]  # vLLM's own naming
        assert out[:4] == [BlockStored(block_hashes=[n], parent_block_hash=None, token_ids=[],
                                       block_size=0, lora_id=None, medium="CPU", lora_name=None,
                                       group_idx=0) for n in named]
        assert any(isinstance(e, BlockRemoved) and e.block_hashes == named[:1]
                   and e.medium == "STORAGE" for e in out)
        # Keys another engine stored are not this engine's to report; vLLM publishes those.
        assert all(bytes(k) in keys[:4] for e in stored + moved + gone for k in e.keys)
    finally:
        manager.shutdown()
        quiet.shutdown()


def test_a_start_announced_before_a_store_does_not_void_it(tmp_path):
    """A daemon's start (``AllBlocksCleared``) that reached the manager before a store completed
    voids what was announced before it, never that store (seen: a start delivered just after the
    manager subscribed reported the engine's first stores as removed)."""
    from kvtier_client.vllm.events import EventFeed

    from kvtierd.events import EventsSettings, KVEvents

    addr = f"ipc://{tmp_path / 'events.sock'}"
    publisher = KVEvents(EventsSettings(addr=addr))
    publisher.start()
    feed = EventFeed(addr)
    try:
        wait_for(lambda: publisher.counts()["subscribers"] >= 1, 30, "the feed subscribed")
        early, late = vllm_key(1), vllm_key(2)
        feed.stored([early])
        publisher.cleared()
        publisher.flush()
        assert feed._sub is not None and feed._sub.poll(30_000), "the start never arrived"
        feed.stored([late])  # completed after the start arrived: it is in the new run's arena
        events = [(e.medium, e.removed, [bytes(k) for k in e.keys]) for e in feed.take()]
        assert events == [(Medium.CPU, False, [early]), (Medium.CPU, True, [early]),
                          (Medium.CPU, False, [late])], events
    finally:
        feed.close()
        publisher.close()


DECODE_033 = """
import sys, msgspec
from vllm.distributed.kv_events import KVEventBatch
import vllm
batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(sys.stdin.buffer.read())
print(vllm.__version__, [type(e).__name__ for e in batch.events], batch.events[0].block_hashes,
      batch.events[0].medium, batch.events[1].group_idx, batch.events[0].lookahead_token_ids)
"""


@pytest.mark.slow  # imports vLLM 0.33 in a child process (tens of seconds on 2 cores)
def test_vllm_033_decodes_the_daemons_batches_with_its_own_classes():
    """0.33 added a BlockStored field: the daemon's map-encoded events still decode there."""
    import subprocess
    import sys
    from pathlib import Path

    import msgpack

    from kvtierd.event_blocks import BlockInfo
    from kvtierd.events import removed_event, stored_event

    site = Path(__file__).resolve().parents[2] / ".cache" / "vllm-0.33.0-site"
    if not (site / "vllm" / "distributed" / "kv_events.py").exists():
        pytest.skip(f"vLLM 0.33 is not unpacked at {site} (test_vllm_contract makes it)")
    info = BlockInfo((b"\x01" * 32,), None, tuple(range(16)), 16, 1)
    payload = msgpack.packb([1.5, [stored_event(info, "cpu", True), removed_event(info, "nvme"),
                                   {"type": "AllBlocksCleared"}], 0])
    out = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(site)!r})"
                          + DECODE_033], input=payload, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    line = out.stdout.decode().strip().splitlines()[-1]
    named = int.from_bytes(bytes([1]) * 8, "big")
    assert line == (f"0.33.0 ['BlockStored', 'BlockRemoved', 'AllBlocksCleared'] "
                    f"[{named}] CPU 1 None"), line
