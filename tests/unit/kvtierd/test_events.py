"""The KV-event publisher on its own (a real PUB socket and a real SUB): what is announced per tier
and rank, the bounded queue, a dead publisher thread, the PUT ``blocks`` entries and the config."""

from __future__ import annotations

import msgpack
import pytest
import zmq

from kvtierd.config import ConfigError, resolve_config
from kvtierd.event_blocks import MAX_HASHES, BlockInfo, parse
from kvtierd.events import EventsSettings, KVEvents

pytestmark = pytest.mark.timeout(60)

NS = "org/m/0123456789abcdef"


def ikey(key: bytes, rank: int = 0, tenant: str = "t", namespace: str = NS):
    return ((tenant, namespace, rank), key)


@pytest.fixture
def publisher(tmp_path):
    made = []

    def make(**kw) -> tuple[KVEvents, zmq.Socket]:
        kw.setdefault("int_hashes", False)  # bytes on the wire: easier to compare
        events = KVEvents(EventsSettings(f"ipc://{tmp_path / f'ev{len(made)}.sock'}", node="n",
                                         **kw))
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(events.settings.addr)
        made.append((events, sub))
        return events, sub

    yield make
    for events, sub in made:
        sub.close(linger=0)
        events.close()


def receive(sub: zmq.Socket, count: int) -> list[tuple[bytes, int, list]]:
    out = []
    for _ in range(count):
        assert sub.poll(10_000), f"only {len(out)} of {count} batches arrived"
        topic, seq, data = sub.recv_multipart()
        ts, events, rank = msgpack.unpackb(data)
        assert rank == 0 and ts > 0
        out.append((topic, int.from_bytes(seq, "big"), events))
    return out


def subscribed(events: KVEvents) -> None:
    """Wait for the XPUB to see the subscription (else the first batches may precede it)."""
    for _ in range(200):  # the thread is not started yet: read its XPUB here
        events._pub.poll(50)
        events._subscriptions()
        if events.counts()["subscribers"]:
            return
    raise AssertionError("subscription never seen")


def test_tiers_ranks_and_moves(publisher):
    events, sub = publisher()
    subscribed(events)
    info = BlockInfo((b"h1", b"h2"), b"h0", tuple(range(32)), 16, 0)
    events.stored(ikey(b"a"), "cpu", info)
    events.stored(ikey(b"a"), "cpu", info)  # a re-PUT: announced once
    events.stored(ikey(b"a", rank=1), "cpu", info)  # other ranks are not announced
    events.stored(ikey(b"a"), "nvme")  # a demotion: the hashes of the PUT, no tokens
    events.removed(ikey(b"a", rank=1), "cpu")  # any rank's copy leaving ends the prefix
    events.removed(ikey(b"a"), "cpu")  # ... once
    events.removed(ikey(b"zz"), "nvme")  # never announced: nothing to say
    events.stored(ikey(b"b", namespace="plain"), "cpu")  # no "/": the whole namespace is the model
    events.flush()
    events.start()
    batches = receive(sub, 2)  # one batch per topic, in the order the topics got events
    assert [(t, s) for t, s, _ in batches] == [(b"kv@n@org/m", 0), (b"kv@n@plain", 1)]
    first = dict((t, e) for t, _, e in batches)
    stored_cpu, stored_nvme, removed_cpu = first[b"kv@n@org/m"]
    assert stored_cpu == {"type": "BlockStored", "block_hashes": [b"h1", b"h2"],
                          "parent_block_hash": b"h0", "token_ids": list(range(32)),
                          "block_size": 16, "lora_id": None, "medium": "CPU", "lora_name": None,
                          "group_idx": 0, "locality": "LOCAL"}
    assert (stored_nvme["medium"], stored_nvme["block_hashes"], stored_nvme["token_ids"],
            stored_nvme["block_size"], stored_nvme["parent_block_hash"]) == (
        "STORAGE", [b"h1", b"h2"], [], 0, b"h0")
    assert removed_cpu == {"type": "BlockRemoved", "block_hashes": [b"h1", b"h2"],
                           "medium": "CPU", "group_idx": 0, "locality": "LOCAL"}
    assert first[b"kv@n@plain"][0]["block_hashes"] == [b"b"]  # the key stands in
    counts = events.counts()
    assert counts["events"] == {"stored": 3, "removed": 1} and not +counts["dropped"]


def test_a_chunk_stored_below_after_it_left_above_keeps_its_hashes(publisher):
    """NVMe's victim cascading to the remote tier is removed from STORAGE at eviction and stored
    on REMOTE when its copy is written: it keeps the hashes its PUT gave."""
    events, sub = publisher()
    subscribed(events)
    info = BlockInfo((b"h1", b"h2"), b"h0", tuple(range(32)), 16, 3)
    events.stored(ikey(b"v"), "nvme", info)
    events.removed(ikey(b"v"), "nvme")
    events.stored(ikey(b"v"), "remote")
    events.stored(ikey(b"w"), "remote")  # never announced elsewhere: the key stands in
    events.flush()
    events.start()
    (_, _, batch), = receive(sub, 1)
    assert [(e["type"], e["medium"], e["block_hashes"]) for e in batch] == [
        ("BlockStored", "STORAGE", [b"h1", b"h2"]), ("BlockRemoved", "STORAGE", [b"h1", b"h2"]),
        ("BlockStored", "REMOTE", [b"h1", b"h2"]), ("BlockStored", "REMOTE", [b"w"])]
    assert (batch[2]["parent_block_hash"], batch[2]["group_idx"], batch[2]["token_ids"]) == (
        b"h0", 3, [])


def test_a_full_queue_drops_and_counts_and_the_rest_is_delivered(publisher):
    events, sub = publisher(max_queued_batches=2)
    subscribed(events)
    for n, namespace in enumerate(("m1/x", "m2/x", "m3/x")):  # three topics: three batches
        events.stored(ikey(bytes([n]), namespace=namespace), "cpu")
        events.stored(ikey(bytes([n, n]), namespace=namespace), "cpu")
    events.flush()  # the thread has not started: the queue holds two, the third is dropped
    assert events.counts()["dropped"]["queue_full"] == 2
    assert events.counts()["queued"] == 2
    events.start()
    got = receive(sub, 2)
    assert sorted(s for _, s, _ in got) == [0, 1]
    assert sorted(t for t, _, _ in got) == [b"kv@n@m1", b"kv@n@m2"]
    assert not sub.poll(200)


def test_a_dead_publisher_thread_drops_events_without_raising(publisher):
    events, _ = publisher()
    events.start()
    events._queue.put(None)  # what close() sends: the thread ends
    events._thread.join(timeout=10)
    events.stored(ikey(b"a"), "cpu")
    events.flush()  # never raises into the request loop
    events.removed(ikey(b"a"), "cpu")
    events.flush()
    assert events.counts()["dropped"]["publisher_down"] == 2


def test_block_entries_are_checked():
    good, why = parse({"hashes": [b"x" * 32, 2**64 - 1], "parent": 5, "tokens": [1] * 32,
                       "block_size": 16, "group": 3})
    assert not why and good == BlockInfo((b"x" * 32, 2**64 - 1), 5, (1,) * 32, 16, 3)
    assert parse(None) == (None, "")
    bad = {
        "expected a map": [b"h"],
        "unknown field": {"hashes": [b"h"], "colour": 1},
        "'hashes' must be a list": {"hashes": []},
        "1..1024": {"hashes": [b"h"] * (MAX_HASHES + 1)},
        "1..64": {"hashes": [b"h" * 65]},
        "outside 0..2**64-1": {"hashes": [2**64]},
        "expected bytes or a uint64": {"hashes": ["text"]},
        "'parent'": {"hashes": [b"h"], "parent": True},
        "uint32": {"hashes": [b"h"], "tokens": [-1] * 16, "block_size": 16},
        "tokens = block_size x hashes": {"hashes": [b"h"], "tokens": [1] * 15, "block_size": 16},
        "both 0": {"hashes": [b"h"], "block_size": 16},
        "'block_size'": {"hashes": [b"h"], "block_size": -1},
        "'group'": {"hashes": [b"h"], "group": 10**6},
    }
    for expected, entry in bad.items():
        info, why = parse(entry)
        assert info is None and expected in why, (expected, why)


@pytest.mark.parametrize("values, key", [
    ({"events_addr": "udp://host:1"}, "events_addr"),
    ({"events_addr": "tcp://host"}, "events_addr"),
    ({"events_replay_addr": "tcp://127.0.0.1:5558"}, "events_replay_addr"),
    ({"events_addr": "tcp://*:5557", "events_replay_addr": "tcp://*:5557"}, "events_replay_addr"),
    ({"events_topic": "kv@{pod}"}, "events_topic"),
    ({"events_topic": "kv@{node"}, "events_topic"),
    ({"events_node": "a@b"}, "events_node"),
    ({"events_max_queued_batches": 0}, "events_max_queued_batches"),
    ({"events_replay_batches": 10**7}, "events_replay_batches"),
])
def test_events_config_is_validated(values, key):
    with pytest.raises(ConfigError) as err:
        resolve_config(env={}, overrides=values)
    assert key in str(err.value)


def test_events_config_accepts_vllms_endpoints():
    cfg = resolve_config(env={}, overrides={"events_addr": "tcp://*:5557",
                                            "events_replay_addr": "tcp://*:5558"}).config
    assert (cfg.events_addr, cfg.events_replay_addr) == ("tcp://*:5557", "tcp://*:5558")


def test_hashes_are_published_as_vllm_names_them_by_default():
    from kvtierd.events import removed_event, stored_event, wire_hash

    digest = bytes(range(32))
    assert wire_hash(digest, True) == int.from_bytes(digest[-8:], "big")
    assert wire_hash(7, True) == 7 and wire_hash(None, True) is None
    info = BlockInfo((digest,), digest, (), 0, 2)
    assert stored_event(info, "nvme", True)["block_hashes"] == [int.from_bytes(digest[-8:], "big")]
    assert stored_event(info, "nvme", True)["parent_block_hash"] == int.from_bytes(digest[-8:],
                                                                                    "big")
    assert removed_event(info, "remote", False) == {
        "type": "BlockRemoved", "block_hashes": [digest], "medium": "REMOTE", "group_idx": 2,
        "locality": "REMOTE"}
    assert EventsSettings("ipc:///x").int_hashes  # the default, like vLLM's
