"""Check kvtier_client.vllm against the vLLM on sys.path; print one JSON report (run as a script).

Usage: ``python contract.py [SITE_DIR]``: with SITE_DIR (a ``pip install --no-deps --target`` of
another vLLM wheel) first on sys.path, that vLLM's real Python interfaces are checked, not the
installed one's. Report: ``version``, ``import_failures`` (vLLM module -> error: what cannot be
imported on this machine, and why) and ``checks`` (name -> "ok" or what is wrong).
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import traceback
import warnings

VLLM_MODULES = (
    "vllm.v1.kv_offload.base",
    "vllm.v1.kv_offload.config",
    "vllm.v1.kv_cache_interface",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    "vllm.distributed.kv_transfer.kv_transfer_state",
)
CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def compatible(ours, theirs) -> str | None:
    """None if ``ours`` accepts every call vLLM makes to ``theirs``, else what differs."""
    mine = inspect.signature(ours).parameters
    for name, p in inspect.signature(theirs).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        q = mine.get(name)
        if q is None:
            return f"lacks parameter {name!r}"
        if q.kind != p.kind and not (p.kind == p.POSITIONAL_OR_KEYWORD
                                     and q.kind == q.POSITIONAL_OR_KEYWORD):
            return f"parameter {name!r} is {q.kind.description}, vLLM's is {p.kind.description}"
        if p.default is not p.empty and q.default != p.default:
            return f"parameter {name!r} defaults to {q.default!r}, vLLM's to {p.default!r}"
    extra = [n for n, q in mine.items() if n not in inspect.signature(theirs).parameters
             and q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]
    return f"requires parameters vLLM does not pass: {extra}" if extra else None


def overrides_match(ours: type, base: type) -> None:
    left = sorted(getattr(ours, "__abstractmethods__", ()))
    assert not left, f"{ours.__name__} leaves abstract methods unimplemented: {left}"
    for name in dir(base):
        theirs = inspect.getattr_static(base, name)
        ours_member = inspect.getattr_static(ours, name)
        if name.startswith("_") or ours_member is theirs:
            continue  # inherited unchanged
        if isinstance(theirs, property):
            assert isinstance(ours_member, property), f"{name}: vLLM's is a property"
            continue
        if not callable(theirs) and not isinstance(theirs, (classmethod, staticmethod)):
            continue
        if isinstance(theirs, (classmethod, staticmethod)):
            assert isinstance(ours_member, type(theirs)), f"{name}: vLLM's is a {type(theirs)}"
            ours_member, theirs = ours_member.__func__, theirs.__func__
        problem = compatible(ours_member, theirs)
        assert problem is None, f"{ours.__name__}.{name} {problem}"


@check
def spec_manager_worker_connector_implement_vllms_interfaces():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.kv_offload.base import OffloadingManager, OffloadingSpec, OffloadingWorker

    from kvtier_client.vllm import (
        KVTierConnector,
        KVTierOffloadingManager,
        KVTierOffloadingSpec,
        KVTierOffloadingWorker,
    )
    overrides_match(KVTierOffloadingSpec, OffloadingSpec)
    overrides_match(KVTierOffloadingManager, OffloadingManager)
    overrides_match(KVTierOffloadingWorker, OffloadingWorker)
    overrides_match(KVTierConnector, OffloadingConnector)


@check
def the_version_check_accepts_this_vllm():
    import vllm

    from kvtier_client.vllm.spec import check_vllm_version
    check_vllm_version(vllm.__version__)


@check
def lookups_can_defer_with_retry():
    from vllm.v1.kv_offload.base import LookupResult
    assert {"HIT", "MISS", "RETRY", "HIT_PENDING"} <= set(LookupResult.__members__)


def offloading_config():
    """vLLM's own OffloadingConfig for a one-group engine (fields this version defaults kept)."""
    from vllm.v1.kv_offload import config as c
    parallel = c.OffloadingParallelConfig(
        rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
        is_parallelism_agnostic=False)
    return c.OffloadingConfig(
        groups=(c.OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=0, enable_kv_cache_events=False,
        extra_config={"kvtierd_address": "ipc:///nonexistent/kvtierd.sock"}, engine_id="contract",
        model=c.OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=c.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2), parallel=parallel)


@check
def the_manager_lock_config_info_and_reset_hooks_work():
    from kvtier_client.vllm import KVTierOffloadingSpec
    spec = KVTierOffloadingSpec(offloading_config())
    manager = spec.get_manager()
    try:
        with manager.lock:  # vLLM 0.33 enters it around every call; it must be a real lock
            assert manager.lock.locked()
        info = manager.config_info()
        keys = KVTierOffloadingSpec.config_info_keys(spec.extra_config)
        assert len(info) == 1 and tuple(info[0]) == keys, (info, keys)
        assert info[0]["kvtierd_address"] == "ipc:///nonexistent/kvtierd.sock"
        manager.reset_cache()
        manager.on_reset_flushed()
        assert manager.has_pending_work() is False
    finally:
        manager.shutdown()


@check
def kinds_come_from_this_vllms_spec_classes():
    import torch
    from vllm.v1 import kv_cache_interface as k

    from kvtier_client.vllm.specs import translate

    def attn(cls, **kw):
        return cls(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, **kw)

    cases = [
        (attn(k.FullAttentionSpec), "full_attention", None),
        (attn(k.SlidingWindowSpec, sliding_window=64), "sliding_window", 64),
        (attn(k.ChunkedLocalAttentionSpec, attention_chunk_size=8192),
         "chunked_local_attention", 8192),
        (attn(k.MLAAttentionSpec, head_size_v=0), "mla", None),
        (attn(k.MLAAttentionSpec, head_size_v=0, cache_role=k.SparseCacheRole.INDEXER),
         "mla_indexer", None),
        (k.MambaSpec(block_size=16, shapes=((2, 8),), dtypes=(torch.bfloat16,)), "mamba", None),
    ]
    for spec, kind, window in cases:
        got = translate(0, spec, ("l0",))
        assert (got.kind, got.sliding_window) == (kind, window), (type(spec).__name__, got)
    for cls in (k.CrossAttentionSpec, k.EncoderOnlyAttentionSpec):
        try:
            translate(0, attn(cls), ("l0",))
        except ValueError:
            continue
        raise AssertionError(f"{cls.__name__} was accepted")


@check
def kvtierds_plan_keeps_the_chunks_vllms_window_function_keeps():
    """Sliding, chunked-local and state groups against this vLLM's own window function."""
    import torch
    from vllm.v1 import kv_cache_interface as k
    try:  # 0.33 moved it next to the group config it fills
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
            get_sliding_window_size_in_chunks,
        )
    except ImportError:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
            get_sliding_window_size_in_chunks,
        )

    from kvtier_client import KVGroup, KVLayout
    from kvtier_client.vllm.geometry import check_windows
    from kvtier_client.vllm.specs import translate

    def attn(cls, **kw):
        return cls(block_size=32, num_kv_heads=1, head_size=8, dtype=torch.bfloat16, **kw)

    specs = [attn(k.FullAttentionSpec)]
    specs += [attn(k.SlidingWindowSpec, sliding_window=w) for w in (1, 31, 32, 33, 100, 512)]
    specs += [attn(k.ChunkedLocalAttentionSpec, attention_chunk_size=c) for c in (64, 96, 8192)]
    specs += [k.MambaSpec(block_size=32, shapes=((2, 8),), dtypes=(torch.bfloat16,),
                          mamba_cache_mode="align")]
    for bpc in (1, 2, 3):
        for spec in specs:
            g = translate(0, spec, ("l0",))
            layout = KVLayout(groups=[KVGroup(tokens_per_block=32, page_bytes=64,
                                              layer_names=("l0",), kind=g.kind,
                                              sliding_window=g.sliding_window)],
                              blocks_per_chunk=bpc, tokens_per_hash=16, model="m",
                              dtype="bfloat16")
            check_windows(layout, [get_sliding_window_size_in_chunks(spec, 32 * bpc)])


def main() -> None:
    if len(sys.argv) > 1:
        sys.path.insert(0, sys.argv[1])
    report: dict = {"import_failures": {}, "checks": {}}
    with warnings.catch_warnings():  # vLLM's imports warn about torch deprecations: not ours
        warnings.simplefilter("ignore")
        import vllm
        report["version"] = vllm.__version__
        report["vllm_path"] = vllm.__file__
        for name in VLLM_MODULES:
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - the report says what and why
                report["import_failures"][name] = f"{type(exc).__name__}: {exc}"
        if not report["import_failures"]:
            for name, fn in CHECKS.items():
                try:
                    fn()
                    report["checks"][name] = "ok"
                except Exception:  # noqa: BLE001
                    report["checks"][name] = traceback.format_exc(limit=3)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
