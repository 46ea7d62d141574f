"""The scheduler-side manager in-process against a real daemon: RETRY while a step's batch is in
flight, one LOOKUP per rank per step whatever the number of keys, hits leased, misses while the
daemon is down, vLLM 0.33's hooks."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

with warnings.catch_warnings():  # vLLM's imports warn (torch.jit deprecations); not ours
    warnings.simplefilter("ignore")
    pytest.importorskip("vllm")
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    from kvtier_client import Chunk, KVGroup, KVLayout, KVTierClient
    from kvtier_client.vllm.geometry import layout_path, publish
    from kvtier_client.vllm.manager import UNAVAILABLE_METRIC, KVTierOffloadingManager
    from kvtier_client.vllm.settings import KVTierSettings

pytestmark = pytest.mark.vllm
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def config(world_size: int = 1) -> OffloadingConfig:
    parallel = OffloadingParallelConfig(
        rank=0, world_size=world_size, tp_size=world_size, pp_size=1, pcp_size=1, dcp_size=1,
        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
        is_parallelism_agnostic=False)
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=0, enable_kv_cache_events=False, extra_config={},
        engine_id="mgr-test", model=OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1), parallel=parallel)


def rank_layout(rank: int, world_size: int) -> KVLayout:
    return KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=4096, layer_names=("l0",))],
                    blocks_per_chunk=1, tokens_per_hash=16, model="tiny", dtype="bfloat16",
                    world_size=world_size, rank=rank)


def lookups_sent(daemon) -> float:
    for family in text_string_to_metric_families(daemon.metrics_text()):
        if family.name == "kvtierd_requests":
            return sum(s.value for s in family.samples
                       if s.name == "kvtierd_requests_total" and s.labels["op"] == "lookup")
    return 0.0


def settle(manager, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while manager.has_pending_work():
        assert time.monotonic() < deadline, "the lookup batch never landed"
        time.sleep(0.01)


def test_one_batched_lookup_per_rank_per_step_then_hits_from_every_rank(daemon, tmp_path):
    world = 2
    settings = KVTierSettings(address=daemon.address, layout_dir=str(tmp_path))
    keys = [b"chunk-%03d" % i for i in range(50)]
    for rank in range(world):  # both ranks store the first 30 keys; rank 1 also has key 40
        lay = rank_layout(rank, world)
        publish(lay, layout_path(settings, "mgr-test", rank))
        kv = {"l0": torch.randint(0, 256, (64, 4096), dtype=torch.uint8)}
        held = keys[:30] + ([keys[40]] if rank else [])
        chunks = [Chunk(k, 0, (i,), 0, 0, lay.chunk_nbytes(0)) for i, k in enumerate(held)]
        with KVTierClient.connect(daemon.address, layout=lay, kv_caches=kv) as client:
            assert all(client.store(chunks).result(timeout=30))
    manager = KVTierOffloadingManager(config(world), settings)
    try:
        req = ReqContext(req_id="r1")
        before = lookups_sent(daemon)
        with manager.lock:  # vLLM 0.33 holds it around a step's calls
            assert {manager.lookup(k, req) for k in keys} == {LookupResult.RETRY}
            manager.on_schedule_end(END)
        settle(manager)
        assert lookups_sent(daemon) - before == world  # 50 keys: one LOOKUP per rank
        got = [manager.lookup(k, req) for k in keys]
        assert got == [LookupResult.HIT] * 30 + [LookupResult.MISS] * 20  # key 40: one rank only
        assert lookups_sent(daemon) - before == world
        out = manager.prepare_store(keys[25:35], req)  # asks the daemon: only the new ones
        assert out.keys_to_store == keys[30:35] and out.store_spec.keys == keys[30:35]
        assert manager.get_stats() is None
        assert manager.config_info()[0]["world_size"] == world
    finally:
        manager.shutdown()


def test_a_down_daemon_answers_misses_at_once_and_counts_them(tmp_path):
    settings = KVTierSettings(address=f"ipc://{tmp_path}/nobody.sock", layout_dir=str(tmp_path),
                              timeout_s=0.2, retry_s=60)
    publish(rank_layout(0, 1), layout_path(settings, "mgr-test", 0))
    manager = KVTierOffloadingManager(config(), settings)
    try:
        req = ReqContext(req_id="r")
        assert manager.lookup(b"k0", req) == LookupResult.RETRY  # not known to be down yet
        manager.on_schedule_end(END)
        settle(manager)
        assert manager.lookup(b"k0", req) == LookupResult.MISS  # the batch failed: a miss
        assert manager.lookup(b"k1", req) == LookupResult.MISS  # backing off: not even asked
        assert not manager.has_pending_work()
        stats = manager.get_stats()
        assert stats is not None and UNAVAILABLE_METRIC in str(stats.data), stats
        out = manager.prepare_store([b"k2"], req)
        assert out.keys_to_store == []  # nothing stored while the daemon is down
    finally:
        manager.shutdown()
