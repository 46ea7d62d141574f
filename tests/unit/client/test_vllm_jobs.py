"""A vLLM transfer job (keys + per-group blocks) as client chunks, and the vLLM extra-config keys."""

import pytest

from kvtier_client import KVGroup, KVLayout
from kvtier_client.vllm.jobs import job_chunks, neighbour_keys
from kvtier_client.vllm.settings import KVTierSettings


def gemma4_like():
    return KVLayout(groups=[KVGroup(tokens_per_block=256, page_bytes=64, layer_names=("s0", "s2"),
                                    sliding_window=128),
                            KVGroup(tokens_per_block=128, page_bytes=64, layer_names=("f1", "f3"))],
                    blocks_per_chunk=2, tokens_per_hash=128, model="m", dtype="bfloat16")


def test_blocks_fill_consecutive_chunks_per_group_with_their_own_tokens_per_chunk():
    layout = gemma4_like()
    chunks = job_chunks(layout, [b"s0", b"f0", b"f1"], [7, 8, 1, 2, 3, 4], [2, 4], [0, 0])
    assert [(c.key, c.group, c.block_ids) for c in chunks] == [
        (b"s0", 0, (7, 8)), (b"f0", 1, (1, 2)), (b"f1", 1, (3, 4))]
    assert [(c.token_start, c.token_end) for c in chunks] == [(0, 512), (0, 256), (256, 512)]
    assert all(c.nbytes == 2 * 2 * 64 for c in chunks)


def test_a_job_starting_mid_chunk_and_ending_mid_chunk_leaves_those_slots_empty():
    # a sliding window freed block 2 (the head of chunk 1); the job's last chunk is partial
    chunks = job_chunks(gemma4_like(), [b"f1", b"f2"], [5, 6], [0, 2], [0, 3])
    assert [(c.key, c.block_ids, c.token_start) for c in chunks] == [
        (b"f1", (-1, 5), 256), (b"f2", (6, -1), 512)]


def test_a_job_whose_keys_and_blocks_disagree_is_refused():
    with pytest.raises(ValueError, match="keys"):
        job_chunks(gemma4_like(), [b"s0"], [7, 8, 1, 2], [2, 2], [0, 0])
    with pytest.raises(ValueError, match="one per group"):
        job_chunks(gemma4_like(), [b"s0"], [7, 8], [2], [0])


def test_neighbour_keys_swap_within_a_group_and_a_lone_chunk_takes_a_same_sized_one():
    chunks = job_chunks(gemma4_like(), [b"s0", b"f0", b"f1"], [7, 8, 1, 2, 3, 4], [2, 4], [0, 0])
    moved = neighbour_keys(chunks)
    # s0 is its group's only chunk: it takes group 1's chunk ending where it ends (512 tokens)
    assert [c.key for c in moved] == [b"f1", b"f1", b"f0"]
    assert [c.block_ids for c in moved] == [c.block_ids for c in chunks]


def test_vllms_null_block_is_never_copied():
    # block 0 is vLLM's null block: an old Mamba state in align mode, a freed sliding block
    chunks = job_chunks(gemma4_like(), [b"s0", b"f0"], [0, 8, 0, 2], [2, 2], [0, 0])
    assert [c.block_ids for c in chunks] == [(-1, 8), (-1, 2)]


def test_settings_read_only_kvtierd_keys_and_fail_on_bad_ones():
    s = KVTierSettings.from_extra_config({
        "spec_name": "KVTierOffloadingSpec", "blocks_per_chunk": 2,
        "kvtierd_address": "ipc:///tmp/x.sock", "kvtierd_timeout_s": "0.5"})
    assert (s.address, s.timeout_s, s.retry_s) == ("ipc:///tmp/x.sock", 0.5, 5.0)
    with pytest.raises(ValueError, match="kvtierd_adress"):
        KVTierSettings.from_extra_config({"kvtierd_adress": "ipc:///x"})
    with pytest.raises(ValueError, match="kvtierd_timeout_s"):
        KVTierSettings.from_extra_config({"kvtierd_timeout_s": 0})
    with pytest.raises(ValueError, match="kvtierd_address"):
        KVTierSettings.from_extra_config({"kvtierd_address": "/run/kvtierd.sock"})
    with pytest.raises(ValueError, match="kvtierd_staging_bytes"):
        KVTierSettings.from_extra_config({"kvtierd_staging_bytes": 1.5})
