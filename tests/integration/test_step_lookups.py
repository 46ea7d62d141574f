"""The scheduler's batched asynchronous lookups (kvtier_client.vllm.lookups) against a real daemon:
one LOOKUP per step whatever the number of keys, answers only after the batch landed, and answers
that expire so an evicted chunk is never promised from an old one."""

import torch
from prometheus_client.parser import text_string_to_metric_families

from kvtier_client import Chunk, KVGroup, KVLayout, KVTierClient
from kvtier_client.index import KVTierIndex
from kvtier_client.vllm.lookups import StepLookups
from kvtierd.protocol import Tier


def layout():
    return KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=4096, layer_names=("l0",))],
                    blocks_per_chunk=1, tokens_per_hash=16, model="steps", dtype="bfloat16")


def lookup_requests(daemon) -> float:
    for family in text_string_to_metric_families(daemon.metrics_text()):
        if family.name == "kvtierd_requests":
            return sum(s.value for s in family.samples
                       if s.name == "kvtierd_requests_total" and s.labels["op"] == "lookup")
    return 0.0


def stored(daemon, n: int) -> list[Chunk]:
    lay = layout()
    kv = {"l0": torch.randint(0, 256, (n, 4096), dtype=torch.uint8)}
    chunks = [Chunk(b"key%04d" % i, 0, (i,), 0, 0, lay.chunk_nbytes(0)) for i in range(n)]
    with KVTierClient.connect(daemon.address, layout=lay, kv_caches=kv) as client:
        assert all(client.store(chunks).result(timeout=30))
    return chunks


def index_for(daemon) -> KVTierIndex:
    lay = layout()
    return KVTierIndex(daemon.address, namespace=lay.namespace, rank=0, fingerprint=lay.fingerprint)


def test_a_steps_keys_go_to_the_daemon_as_one_lookup_and_answer_the_next_step(daemon):
    chunks = stored(daemon, 40)
    index = index_for(daemon)
    lookups = StepLookups(lambda keys: index.lookup(keys, lease=True))
    try:
        asked = [c.key for c in chunks] + [b"absent%03d" % i for i in range(60)]
        before = lookup_requests(daemon)
        assert [lookups.tier(k) for k in asked] == [None] * 100  # step 1: nothing known yet
        assert [lookups.tier(k) for k in asked[:5]] == [None] * 5  # asking twice adds nothing
        assert lookup_requests(daemon) == before  # nothing sent during the step
        lookups.end_step()
        assert lookups.pending
        assert lookups.wait_idle(30)
        assert lookup_requests(daemon) == before + 1  # 100 keys, one round trip
        assert lookups.batches_sent == 1 and not lookups.pending
        # step 2: every key answered from the batch, no further round trip
        assert [lookups.tier(k) for k in asked] == [Tier.CPU] * 40 + [Tier.NONE] * 60
        assert lookup_requests(daemon) == before + 1
    finally:
        lookups.close()
        index.close()


def test_answers_expire_after_the_step_that_could_use_them(daemon):
    (chunk,) = stored(daemon, 1)
    index = index_for(daemon)
    lookups = StepLookups(lambda keys: index.lookup(keys, lease=False))
    try:
        assert lookups.tier(chunk.key) is None
        lookups.end_step()
        assert lookups.wait_idle(30)
        assert lookups.tier(chunk.key) == Tier.CPU  # the step after the batch: answered
        lookups.end_step()  # a request deferred once more still finds it in the next step
        assert lookups.known(chunk.key) == Tier.CPU
        lookups.end_step()  # two steps after it arrived: it may be stale now
        assert lookups.known(chunk.key) is None
        assert lookups.tier(chunk.key) is None  # asked again, in the next batch
        assert lookups.pending  # queued for the batch at the end of this step
        lookups.end_step()
        assert lookups.wait_idle(30) and lookups.tier(chunk.key) == Tier.CPU
        lookups.clear()  # vLLM reset its prefix cache
        assert lookups.known(chunk.key) is None
    finally:
        lookups.close()
        index.close()


def test_a_down_daemon_or_a_failing_batch_resolves_to_misses_not_a_stuck_request(tmp_path):
    index = KVTierIndex(f"ipc://{tmp_path}/nobody.sock", namespace="n", rank=0, fingerprint="f",
                        timeout_s=0.2, retry_s=60)

    def broken(keys):
        raise RuntimeError("a bug in the ask function")

    for ask in (lambda keys: index.lookup(keys), broken):
        lookups = StepLookups(ask)
        try:
            assert lookups.tier(b"k") is None
            lookups.end_step()
            assert lookups.wait_idle(30)
            assert lookups.tier(b"k") == Tier.NONE and not lookups.pending
        finally:
            lookups.close()
    index.close()
