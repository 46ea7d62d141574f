"""The worker's translation of vLLM's real KV cache specs and canonical caches into a ``KVLayout``,
the window check against vLLM's own window function, the version check, and expedited loads.

These build vLLM 0.32's own spec, config and cache dataclasses (no engine), so each case is cheap;
the end-to-end tests (test_offloading_spec, test_hybrid_models) run the same code inside real vLLM.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

with warnings.catch_warnings():  # vLLM's imports warn (torch.jit deprecations); not ours
    warnings.simplefilter("ignore")
    vllm_kv = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    from kvtier_client.vllm.geometry import check_windows, vllm_window_chunks, worker_layout
    from kvtier_client.vllm.manager import KVTierLoadStoreSpec
    from kvtier_client.vllm.settings import KVTierSettings
    from kvtier_client.vllm.spec import check_vllm_version
    from kvtier_client.vllm.specs import translate
    from kvtier_client.vllm.worker import KVTierOffloadingWorker
    import vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler  # noqa: F401

pytestmark = pytest.mark.vllm
BF16 = torch.bfloat16
NUM_BLOCKS = 12


def attn(cls=vllm_kv.FullAttentionSpec, block_size=16, heads=2, head=32, **kw):
    return cls(block_size=block_size, num_kv_heads=heads, head_size=head, dtype=BF16, **kw)


def mamba(block_size=64):
    return vllm_kv.MambaSpec(block_size=block_size, shapes=((3, 40), (4, 8, 8)),
                             dtypes=(BF16, BF16), mamba_cache_mode="align")


MLA = dict(cls=vllm_kv.MLAAttentionSpec, block_size=64, heads=1, head=576, head_size_v=0)
INDEXER = dict(cls=vllm_kv.MLAAttentionSpec, block_size=64, heads=1, head=66, head_size_v=0,
               cache_role=vllm_kv.SparseCacheRole.INDEXER)

KINDS = [
    (attn(), "full_attention", None),
    # hybrid KV cache manager off: vLLM caches every token of a sliding layer, so it is full
    (attn(sliding_window=128), "full_attention", None),
    (attn(vllm_kv.SlidingWindowSpec, sliding_window=128), "sliding_window", 128),
    (attn(vllm_kv.ChunkedLocalAttentionSpec, attention_chunk_size=8192),
     "chunked_local_attention", 8192),
    (attn(vllm_kv.SlidingWindowMLASpec, block_size=64, heads=1, head=512, head_size_v=0,
          sliding_window=128), "sliding_window", 128),
    (attn(**MLA), "mla", None),
    (attn(**INDEXER), "mla_indexer", None),
    (mamba(), "mamba", None),
]


@pytest.mark.parametrize(("spec", "kind", "window"), KINDS,
                         ids=[f"{type(s).__name__}-{k}" for s, k, _ in KINDS])
def test_each_vllm_spec_type_gives_its_kind_window_and_unpadded_pages(spec, kind, window):
    got = translate(3, spec, ("a", "b"))
    assert (got.kind, got.sliding_window) == (kind, window)
    unpadded = (spec.page_size_bytes if isinstance(spec, vllm_kv.MambaSpec)
                else spec.unpadded_page_size_bytes)
    assert got.layer_page_bytes == (unpadded, unpadded)


def test_padded_pages_are_not_copied_as_data():
    spec = attn(page_size_padded=4096)
    assert spec.page_size_bytes == 4096
    assert translate(0, spec, ("a",)).layer_page_bytes == (spec.unpadded_page_size_bytes,)


@pytest.mark.parametrize(("spec", "why"), [
    (attn(vllm_kv.CrossAttentionSpec), "encoder input"),
    (attn(vllm_kv.EncoderOnlyAttentionSpec), "encoder-only"),
])
def test_cross_attention_and_encoder_only_caches_are_refused_naming_the_kind(spec, why):
    with pytest.raises(ValueError, match=why) as err:
        translate(5, spec, ("x",))
    assert type(spec).__name__ in str(err.value) and "group 5" in str(err.value)
    assert "allowed kinds" in str(err.value)


def test_uniform_type_group_of_mla_and_indexer_layers_keeps_each_layers_page_size():
    mla, idx = attn(**MLA), attn(**INDEXER)
    group = vllm_kv.UniformTypeKVCacheSpecs(block_size=64, kv_cache_specs={
        "l0.mla": mla, "l0.idx": idx, "l1.mla": mla, "l1.idx": idx})
    got = translate(0, group, ("l0.mla", "l0.idx", "l1.mla", "l1.idx"))
    assert got.kind == "mla"  # the indexer caches belong to the MLA layers' group
    assert got.layer_page_bytes == (mla.unpadded_page_size_bytes, idx.unpadded_page_size_bytes) * 2
    assert len(set(got.layer_page_bytes)) == 2
    with pytest.raises(ValueError, match="no spec for layers"):
        translate(0, group, ("l0.mla", "l2.mla"))


# -- worker_layout with vLLM's own config, cache config and canonical caches ----------------------
def offloading_config(groups, blocks_per_chunk=2, tokens_per_hash=16):
    parallel = OffloadingParallelConfig(
        rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
        is_parallelism_agnostic=False)
    return OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(tokens_per_block=spec.block_size,
                                           layer_names=tuple(names), group_id=g)
                     for g, (names, spec) in enumerate(groups)),
        worker_kv_bytes_per_block=0, enable_kv_cache_events=False, extra_config={},
        engine_id="e", model=OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_hash,
                                    blocks_per_chunk=blocks_per_chunk),
        parallel=parallel)


def cache_config(groups):
    return vllm_kv.KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        vllm_kv.KVCacheGroupSpec(layer_names=list(names), kv_cache_spec=spec)
        for names, spec in groups])


def per_layer_caches(groups, pages=None):
    """One random uint8 [NUM_BLOCKS, page] tensor per layer, as vLLM's canonical caches."""
    tensors, refs = [], []
    for names, spec in groups:
        group_refs = []
        for name in names:
            page = translate(0, spec, (name,)).layer_page_bytes[0] if pages is None else pages[name]
            tensors.append(CanonicalKVCacheTensor(
                torch.randint(0, 256, (NUM_BLOCKS, page), dtype=torch.uint8), page))
            group_refs.append(CanonicalKVCacheRef(tensor_idx=len(tensors) - 1,
                                                  page_size_bytes=page))
        refs.append(group_refs)
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def build(groups, caches=None, **config):
    return worker_layout(offloading_config(groups, **config), caches or per_layer_caches(groups),
                         KVTierSettings(), cache_config(groups))


def test_worker_layout_reads_kind_and_window_from_the_specs_not_layer_attributes():
    groups = [(["f0", "f1"], attn(block_size=32)),
              (["s0", "s1"], attn(vllm_kv.SlidingWindowSpec, block_size=32, sliding_window=48))]
    layout, tensors = build(groups)
    assert [(g.kind, g.sliding_window) for g in layout.groups] == [
        ("full_attention", None), ("sliding_window", 48)]
    assert set(tensors) == {"f0", "f1", "s0", "s1"}
    assert layout.kv_layout == "default"


def test_registered_pages_that_disagree_with_the_specs_are_refused():
    groups = [(["f0", "f1"], attn())]
    page = translate(0, groups[0][1], ("f0",)).layer_page_bytes[0]
    caches = per_layer_caches(groups, pages={"f0": page, "f1": page // 2})
    with pytest.raises(ValueError, match="specs say"):
        build(groups, caches)


def test_a_packed_layout_moves_each_groups_whole_blocks_as_one_region():
    # vLLM's packed (block-outermost) layout: one tensor backs every group, one region per group
    groups = [(["a0", "a1"], attn()), (["b0", "b1"], attn(vllm_kv.SlidingWindowSpec,
                                                         sliding_window=32))]
    stride = 4 * translate(0, groups[0][1], ("a0",)).layer_page_bytes[0]
    tensor = torch.randint(0, 256, (NUM_BLOCKS, stride), dtype=torch.uint8)
    caches = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(tensor, stride)],
                               group_data_refs=[[CanonicalKVCacheRef(0, stride)]] * 2)
    layout, tensors = build(groups, caches)
    assert [g.layer_names for g in layout.groups] == [("group0.packed",), ("group1.packed",)]
    assert [g.page_bytes for g in layout.groups] == [stride, stride]
    assert [g.kind for g in layout.groups] == ["full_attention", "sliding_window"]
    assert layout.kv_layout == "default+packed"  # the fingerprint tells packed bytes apart
    assert tensors["group0.packed"] is tensor and tensors["group1.packed"] is tensor
    assert layout.fingerprint != build([(["a0", "a1"], attn()), groups[1]])[0].fingerprint


def test_vllms_window_in_chunks_agrees_with_kvtierds_plan_for_sliding_windows():
    for window in (16, 32, 48, 100, 128):
        groups = [(["f0"], attn()), (["s0"], attn(vllm_kv.SlidingWindowSpec,
                                                  sliding_window=window))]
        cfg, kcc = offloading_config(groups), cache_config(groups)
        theirs = [vllm_window_chunks(gc, kcc, 2) for gc in cfg.groups]
        assert theirs[0] is None and theirs[1] == -(-window // 32)
        build(groups)  # checked inside worker_layout


def test_a_window_vllm_extends_beyond_kvtierds_plan_is_refused():
    # speculative decoding retains extra tokens: vLLM keeps more chunks than the window needs
    groups = [(["s0"], attn(vllm_kv.SlidingWindowSpec, sliding_window=32,
                            extra_retained_tokens=64))]
    with pytest.raises(ValueError, match="vLLM keeps 3 chunk"):
        build(groups)
    layout = build([(["s0"], attn(vllm_kv.SlidingWindowSpec, sliding_window=32))])[0]
    with pytest.raises(ValueError, match="vLLM keeps every chunk"):
        check_windows(layout, [None])


def test_only_the_supported_vllm_versions_start():
    check_vllm_version("0.32.0")
    check_vllm_version("0.33.0")
    check_vllm_version("0.32.0+cpu")
    with pytest.raises(RuntimeError, match=r"vLLM 0.31.2 is not supported.*0\.32\.0, 0\.33\.0"):
        check_vllm_version("0.31.2")


# -- the worker: an expedited load skips the queue ------------------------------------------------
def test_an_expedited_load_runs_while_regular_jobs_wait_and_fills_its_blocks(daemon):
    groups = [(["f0", "f1"], attn())]
    caches = per_layer_caches(groups)
    layout, tensors = build(groups, caches)
    settings = KVTierSettings(address=daemon.address)
    keys = [b"expedited-%d" % i for i in range(2)]
    src = GPULoadStoreSpec(list(range(1, 5)), [4], [0])
    worker = KVTierOffloadingWorker(layout, tensors, settings)
    gate = threading.Event()
    try:
        assert worker.submit_store(1, src, KVTierLoadStoreSpec(keys))
        worker.wait({1})
        assert [(r.job_id, r.transfer_size) for r in worker.get_finished()] == [
            (1, 2 * layout.chunk_nbytes(0))]
        expected = {n: t[1:5].clone() for n, t in tensors.items()}
        for t in tensors.values():
            t[5:9] = 0xAB  # poison the destination blocks
        worker._executor.submit(gate.wait)  # hold the regular queue (test only)
        dst = GPULoadStoreSpec(list(range(5, 9)), [4], [0])
        assert worker.submit_load(2, KVTierLoadStoreSpec(keys), dst)
        assert worker.submit_load(3, KVTierLoadStoreSpec(keys), dst, expedited=True)
        worker.wait({3})  # returns although job 2 still waits behind the gate
        assert [r.job_id for r in worker.get_finished()] == [3]
        for name, t in tensors.items():
            assert torch.equal(t[5:9], expected[name])
    finally:
        gate.set()
    worker.wait({2})
    assert [r.job_id for r in worker.get_finished()] == [2]
    worker.shutdown()
    assert worker.load_failures == 0


def test_a_packed_layout_round_trips_each_groups_whole_blocks_byte_for_byte(daemon):
    # one tensor backs both groups; group 0 owns blocks 1-2, group 1 blocks 3-4 (vLLM's shared pool)
    groups = [(["a0", "a1"], attn()), (["b0", "b1"], attn(vllm_kv.SlidingWindowSpec,
                                                         sliding_window=32))]
    stride = 4 * translate(0, groups[0][1], ("a0",)).layer_page_bytes[0]
    tensor = torch.randint(0, 256, (NUM_BLOCKS, stride), dtype=torch.uint8)
    caches = CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(tensor, stride)],
                               group_data_refs=[[CanonicalKVCacheRef(0, stride)]] * 2)
    layout, tensors = build(groups, caches)
    worker = KVTierOffloadingWorker(layout, tensors, KVTierSettings(address=daemon.address))
    try:
        keys = [b"packed-a", b"packed-b"]
        assert worker.submit_store(1, GPULoadStoreSpec([1, 2, 3, 4], [2, 2], [0, 0]),
                                   KVTierLoadStoreSpec(keys))
        worker.wait({1})
        assert [r.transfer_size for r in worker.get_finished()] == [4 * stride]
        expected = tensor[1:5].clone()
        tensor[5:9] = 0xAB
        untouched = torch.cat([tensor[:5], tensor[9:]]).clone()
        assert worker.submit_load(2, KVTierLoadStoreSpec(keys),
                                  GPULoadStoreSpec([5, 6, 7, 8], [2, 2], [0, 0]))
        worker.wait({2})
        assert [r.job_id for r in worker.get_finished()] == [2]
        assert torch.equal(tensor[5:9], expected)
        assert torch.equal(torch.cat([tensor[:5], tensor[9:]]), untouched)
        assert worker.load_failures == 0
    finally:
        worker.shutdown()
