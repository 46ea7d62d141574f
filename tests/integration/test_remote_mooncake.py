"""The remote tier against a real Mooncake Store (mooncake_master in a private network namespace).

The tier's jobs are run here the way the chain runs them (job on a worker, ``*_done``/``commit`` on
the caller), on a real arena: byte-exact round trips into poisoned pages, a flipped byte in a stored
object, a killed and restarted master, two tenants and two clusters on one store.
"""

from __future__ import annotations

import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import mooncake as mc
from helpers.wait import wait_for

from kvtierd.config_remote import RemoteConfig
from kvtierd.copy.memcpy import checksum
from kvtierd.protocol import Status, Tier
from kvtierd.remote import objects
from kvtierd.remote.tier import RemoteTier
from kvtierd.remote.verify import RemoteMiss
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.chunk import segments
from kvtierd.tiers.lower import IntegrityError, TierUnavailable

pytestmark = pytest.mark.skipif(mc.unavailable_reason() is not None,
                                reason=str(mc.unavailable_reason()))

PAGE = 64 * 1024
FP = "fingerprint-a"


@pytest.fixture
def master(tmp_path_factory) -> mc.MooncakeMaster:
    return mc.shared_master(tmp_path_factory.getbasetemp() / "mooncake")


@pytest.fixture
def arena():
    a = Arena(f"kvtierd-test-remote-{uuid.uuid4().hex[:8]}", 64 * PAGE, prefault=False,
              lock=False)
    yield a
    a.close()


def config(master: mc.MooncakeMaster, **kw) -> RemoteConfig:
    values = dict(cluster_id=f"test-{uuid.uuid4().hex[:12]}", master_addr=master.master_addr,
                  metadata_url=master.metadata_url,
                  global_segment_bytes=32 * 1024**2, local_buffer_bytes=8 * 1024**2,
                  retry_s=1.0, connect_timeout_s=2.0)
    values.update(kw)
    return RemoteConfig(**values)


def ikey(tenant: str, key: bytes, namespace: str = "ns", rank: int = 0):
    return ((tenant, namespace, rank), key)


class Harness:
    """A tier in the master's namespace, its jobs run inline (each on the test's thread, which is
    inside the namespace while it runs)."""

    def __init__(self, master: mc.MooncakeMaster, arena: Arena, **kw) -> None:
        self.ns = master.ns
        self.arena = arena
        self.tier = RemoteTier(config(master, **kw), arena, PAGE)

    def run(self, job):
        with self.ns.entered():
            return job()

    def publish(self, key, payload: bytes, page: int) -> None:
        runs = [(page, -(-len(payload) // PAGE))]
        off = page * PAGE
        self.arena.view[off : off + len(payload)] = payload
        digest = checksum(self.arena.view, [(off, len(payload))])
        target = self.tier.reserve(key, FP, len(payload), digest)
        assert target is not None
        self.run(self.tier.write_job([(target, runs)], self.arena))
        self.tier.commit(target)

    def load(self, key, nbytes: int, page: int, fingerprint: str = FP, slack: int = 0) -> bytes:
        """LOOKUP (existence check) then a read into poisoned pages (with room for ``slack``
        bytes after the payload, as the CPU tier reserves a promotion); the bytes read."""
        status, entry = self.tier.lookup(key, fingerprint)
        if entry is None:
            unknown = self.tier.unknown([key], fingerprint)
            found = self.run(self.tier.exists_job(unknown, fingerprint))
            self.tier.exists_done(unknown, fingerprint, found)
            status, entry = self.tier.lookup(key, fingerprint)
        if entry is None:
            raise RemoteMiss(f"lookup: {status.name}")
        runs = [(page, -(-(nbytes + slack) // PAGE))]
        segs = segments(runs, nbytes, PAGE)
        start, end = page * PAGE, (page + runs[0][1]) * PAGE
        self.arena.view[start:end] = b"\xa5" * (end - start)  # poison, slack included
        self.tier.acquire(entry)
        try:
            digest = self.run(self.tier.read_job(entry, self.arena, runs, segs))
        except IntegrityError:
            self.tier.drop(entry)
            raise
        finally:
            self.tier.release(entry)
        assert digest == checksum(self.arena.view, segs)
        return b"".join(bytes(self.arena.view[o : o + n]) for o, n in segs)

    def flush_deletions(self) -> None:
        taken = self.tier.take_deletions()
        if taken:
            self.run(self.tier.delete_job(taken))
            self.tier.deleted(taken)

    def close(self) -> None:
        with self.ns.entered():
            self.tier.close()


@pytest.fixture
def node(master, arena):
    h = Harness(master, arena)
    yield h
    h.tier.check_invariants()
    h.close()


raw_client = mc.raw_client


def test_round_trip_is_byte_exact_and_lookup_answers_remote(node: Harness) -> None:
    assert node.tier.tier is Tier.REMOTE
    payloads = {ikey("uid:1", b"k%d" % i): os.urandom(PAGE * 2 + 123 * i) for i in range(3)}
    for i, (key, data) in enumerate(payloads.items()):
        node.publish(key, data, page=i * 4)
    node.tier.known.clear()  # as on another node: only the store knows
    node.tier._used_bytes = 0
    for key, data in payloads.items():
        assert node.load(key, len(data), page=32) == data
    # another size than was stored is a plain miss (never a partial payload), and kept
    key, data = next(iter(payloads.items()))
    with pytest.raises(RemoteMiss):
        node.load(key, len(data) + 1, page=32)
    assert node.load(key, len(data), page=32) == data
    # another layout's reader never sees it: a different name
    with pytest.raises(RemoteMiss):
        node.load(key, len(data), page=32, fingerprint="fingerprint-b")


def test_a_key_known_only_from_an_existence_check_loads_byte_exact(node: Harness) -> None:
    """Another node's object: the check records it as its layout (no entry), a LOOKUP without
    a lease answers from the record, and the GET's lookup builds the entry that is read."""
    payloads = {ikey("uid:1", b"seen%d" % i): os.urandom(PAGE + 321 * i) for i in range(3)}
    for i, (key, data) in enumerate(payloads.items()):
        node.publish(key, data, page=i * 4)
    node.tier.known.clear()  # as on another node: only the store knows
    node.tier._used_bytes = 0
    keys = list(payloads) + [ikey("uid:1", b"never-stored")]
    unknown = node.tier.unknown(keys, FP)
    assert unknown == keys
    found = node.run(node.tier.exists_job(unknown, FP))
    assert found == [True, True, True, False]
    node.tier.exists_done(unknown, FP, found)
    assert [node.tier.known.get(k) for k in keys] == [FP, FP, FP, None]
    assert node.tier.lookup_many(keys, FP, entries=False) == [(Status.OK, None)] * 3 + [
        (Status.MISS, None)]
    assert node.tier.unknown(keys[3:], FP) == []  # the absent one is trusted for ABSENT_TTL_S
    for key, data in payloads.items():
        assert node.load(key, len(data), page=32) == data
        entry = node.tier.known[key]
        assert entry.nbytes == 0 and entry.fingerprint == FP  # built by the GET's lookup
    assert node.tier.stats()["used_bytes"] == 0


def test_another_layouts_absent_answer_never_hides_this_layouts_object(node: Harness) -> None:
    """Issue 38 item 2: a LOOKUP of K by another layout (its object absent) used to hide the right
    layout's object of K for ABSENT_TTL_S (NONE, then REMOTE a second later)."""
    key = ikey("uid:1", b"two-layouts")
    data = os.urandom(PAGE)
    node.publish(key, data, page=0)
    node.tier.known.clear()  # as on another node: only the store knows
    node.tier._used_bytes = 0
    other = "fingerprint-b"
    assert node.tier.unknown([key], other) == [key]
    found = node.run(node.tier.exists_job([key], other))
    assert found == [False]
    node.tier.exists_done([key], other, found)
    assert node.tier.unknown([key], other) == []  # trusted for that layout
    assert node.tier.unknown([key], FP) == [key]  # but asked again for this one
    found = node.run(node.tier.exists_job([key], FP))
    assert found == [True]
    node.tier.exists_done([key], FP, found)
    assert node.load(key, len(data), page=8) == data


def test_a_read_with_room_after_the_payload_lands_the_header_there(master, node) -> None:
    """The one-buffer read (header after the payload, in the target's spare page) serves the
    same verified bytes as the header-slot read, and writes nothing past the header."""
    key = ikey("uid:1", b"inline")
    data = os.urandom(2 * PAGE)
    node.publish(key, data, page=0)
    assert node.load(key, len(data), page=40, slack=objects.HEADER_BYTES) == data
    after = 40 * PAGE + len(data) + objects.HEADER_BYTES
    assert bytes(node.arena.view[after : 43 * PAGE]) == b"\xa5" * (43 * PAGE - after)
    header = bytes(node.arena.view[40 * PAGE + len(data) : after])
    name = node.tier.name_of(key, FP)
    assert objects.check_header(header, name, key, FP, len(data)).checksum == checksum(
        memoryview(data), [(0, len(data))])
    assert node.load(key, len(data), page=50) == data  # no room: the header-slot read


def test_concurrent_read_jobs_verify_on_threads_of_their_own(master, arena, monkeypatch):
    """Two GETs' read jobs running at once each keep one call's check in flight: their first
    checks meet at a barrier, which one verifier thread for the whole tier never reaches (the
    second check would queue behind the first); both still land byte-exact."""
    monkeypatch.setattr("kvtierd.remote.tier.READ_CALL_BYTES", PAGE)  # a call per chunk
    node = Harness(master, arena, io_threads=2)
    try:
        payloads = {ikey("uid:1", b"c%d" % i): os.urandom(PAGE) for i in range(8)}
        for i, (key, data) in enumerate(payloads.items()):
            node.publish(key, data, page=i)
        entries = [node.tier.lookup(key, FP)[1] for key in payloads]
        arena.view[16 * PAGE : 32 * PAGE] = b"\xa5" * (16 * PAGE)  # poison
        jobs = []
        for base, part in ((16, entries[:4]), (24, entries[4:])):
            items = [(entry, [(base + i, 1)], segments([(base + i, 1)], PAGE, PAGE))
                     for i, entry in enumerate(part)]
            jobs.append(node.tier.read_batch_job(items, arena))
        met = threading.Barrier(2, timeout=10)
        checked: list[str] = []
        verify = node.tier.verifier._check_part

        def first_checks_meet(*args):
            checked.append(threading.current_thread().name)
            if len(checked) <= 2:
                met.wait()  # BrokenBarrierError after 10 s if the checks run one after another
            return verify(*args)

        node.tier.verifier._check_part = first_checks_meet
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(node.run, jobs))
        assert len(set(checked[:2])) == 2 and len(checked) == 8
        for digests, base, part in ((results[0], 16, list(payloads.values())[:4]),
                                    (results[1], 24, list(payloads.values())[4:])):
            for i, (digest, data) in enumerate(zip(digests, part)):
                got = bytes(arena.view[(base + i) * PAGE : (base + i + 1) * PAGE])
                assert got == data and digest == checksum(memoryview(data), [(0, PAGE)])
    finally:
        node.close()


def test_flipped_byte_is_an_integrity_miss_and_the_object_is_removed(master, node) -> None:
    key = ikey("uid:1", b"victim")
    data = os.urandom(3 * PAGE)
    node.publish(key, data, page=0)
    name = node.tier.name_of(key, FP)
    store = raw_client(master)
    try:
        with master.ns.entered():
            stored = bytearray(store.get(name))
            assert len(stored) == objects.HEADER_BYTES + len(data)
            stored[1000] ^= 0x01  # a payload byte: the header follows the payload
            assert store.remove(name, True) == 0
            assert store.put(name, bytes(stored)) == 0
        with pytest.raises(IntegrityError, match="checksum"):
            node.load(key, len(data), page=8)
        assert node.tier.lookup(key, FP) == (Status.MISS, None)
        node.flush_deletions()
        with master.ns.entered():
            assert store.is_exist(name) == 0
    finally:
        with master.ns.entered():
            store.close()


@pytest.mark.parametrize("cut", ["half", "no-header", "longer"])
def test_an_object_of_another_length_is_an_integrity_failure_and_removed(master, node, cut):
    """Issue 38 item 3: an object cut to half its length (or grown) under a chunk's name was a
    plain miss on every GET and stayed in the store, so every node's LOOKUP kept answering
    REMOTE; counted nowhere as an integrity failure. Now it is one, and the object is removed."""
    key = ikey("uid:1", b"cut-" + cut.encode())
    data = os.urandom(2 * PAGE)
    node.publish(key, data, page=0)
    name = node.tier.name_of(key, FP)
    store = raw_client(master)
    try:
        with master.ns.entered():
            stored = store.get(name)
            changed = {"half": stored[: len(stored) // 2], "no-header": stored[: len(data)],
                       "longer": stored + b"\x00" * 4096}[cut]
            assert store.remove(name, True) == 0
            assert store.put(name, changed) == 0
        with pytest.raises(IntegrityError, match="bytes"):
            node.load(key, len(data), page=8)
        node.flush_deletions()
        with master.ns.entered():
            assert store.is_exist(name) == 0, "the bad object is still promised"
    finally:
        with master.ns.entered():
            store.close()


def test_a_reader_asking_another_size_of_a_whole_object_misses_and_keeps_it(master, node):
    """The other side of item 3: a valid object read with a wrong size (a buggy reader of the
    same tenant) is a plain miss, and the object stays for the readers that ask right."""
    key = ikey("uid:1", b"asked-wrong")
    data = os.urandom(2 * PAGE)
    node.publish(key, data, page=0)
    name = node.tier.name_of(key, FP)
    with pytest.raises(RemoteMiss, match="a whole chunk of"):
        node.load(key, PAGE, page=8)
    node.tier.drop(node.tier.known[key])  # what the chain does with a miss of a known entry
    node.flush_deletions()
    store = raw_client(master)
    try:
        with master.ns.entered():
            assert store.is_exist(name) == 1, "a valid object was removed"
    finally:
        with master.ns.entered():
            store.close()
    assert node.load(key, len(data), page=8) == data


@pytest.mark.parametrize("there", ["garbage", "cut-copy", "another-tenants-header"])
def test_a_publish_replaces_a_bad_object_under_its_name(master, node, there) -> None:
    """Issue 38 item 4: Mooncake answered OBJECT_ALREADY_EXISTS, the tier counted it as stored and
    the node announced the broken object. Now an object under the name that is not a whole chunk
    of this key and layout is replaced."""
    key = ikey("uid:1", b"republish-" + there.encode())
    data = os.urandom(2 * PAGE)
    name = node.tier.name_of(key, FP)
    good = data + objects.header_for(name, key, FP, len(data),
                                     checksum(memoryview(data), [(0, len(data))])).pack()
    bad = {"garbage": os.urandom(len(good)), "cut-copy": good[: len(good) // 2],
           "another-tenants-header": data + objects.header_for(
               name, ikey("uid:2", b"republish-" + there.encode()), FP, len(data),
               checksum(memoryview(data), [(0, len(data))])).pack()}[there]
    store = raw_client(master)
    try:
        with master.ns.entered():
            assert store.put(name, bad) == 0
        node.publish(key, data, page=0)
        with master.ns.entered():
            assert store.get(name) == good, "the bad object was kept"
        node.tier.known.clear()  # as another node: read it back through the store
        node.tier._used_bytes = 0
        assert node.load(key, len(data), page=8) == data
    finally:
        with master.ns.entered():
            store.close()


def test_a_publish_keeps_another_writers_whole_copy(master, node) -> None:
    """Two nodes computing one chunk: the second publish finds a whole valid chunk (other bytes,
    its own checksum) under the name and keeps it, rather than overwriting a copy readers use."""
    key = ikey("uid:1", b"two-writers")
    theirs, mine = os.urandom(PAGE), os.urandom(PAGE)
    name = node.tier.name_of(key, FP)
    their_object = theirs + objects.header_for(
        name, key, FP, len(theirs), checksum(memoryview(theirs), [(0, len(theirs))])).pack()
    store = raw_client(master)
    try:
        with master.ns.entered():
            assert store.put(name, their_object) == 0
        node.publish(key, mine, page=0)
        with master.ns.entered():
            assert store.get(name) == their_object
    finally:
        with master.ns.entered():
            store.close()


def test_replicas_are_asked_of_the_store(master, arena) -> None:
    """Issue 38 item 10: ``[remote] replicas`` is passed to Mooncake's puts (before, every object
    had one replica, so a node that died took its share of every tenant's objects with it)."""
    store = raw_client(master)  # a second segment in the pool, for the second replica
    node = Harness(master, arena, replicas=2)
    try:
        key = ikey("uid:1", b"two-copies")
        node.publish(key, os.urandom(PAGE), page=0)
        with master.ns.entered():
            replicas = store.get_replica_desc(node.tier.name_of(key, FP))
        assert len(replicas) == 2, replicas
    finally:
        node.close()
        with master.ns.entered():
            store.close()


def test_forged_header_tenant_is_an_integrity_failure(master, node) -> None:
    """An object under tenant A's name whose header says tenant B (or is cut short) never
    passes."""
    key = ikey("tenant-a", b"k")
    data = os.urandom(PAGE)
    name = node.tier.name_of(key, FP)
    forged = objects.header_for(name, ikey("tenant-b", b"k"), FP, len(data),
                                checksum(memoryview(data), [(0, len(data))])).pack()
    store = raw_client(master)
    try:
        with master.ns.entered():
            assert store.put(name, data + forged) == 0
        with pytest.raises(IntegrityError, match="tenant"):
            node.load(key, len(data), page=0)
    finally:
        with master.ns.entered():
            store.close()


def test_two_tenants_and_two_clusters_never_cross(master, node, arena) -> None:
    data_a, data_b = os.urandom(PAGE), os.urandom(PAGE)
    node.publish(ikey("tenant-a", b"same"), data_a, page=0)
    node.publish(ikey("tenant-b", b"same"), data_b, page=2)
    # the same key in another namespace or rank is another object too
    for other in (ikey("tenant-a", b"same", namespace="ns2"), ikey("tenant-a", b"same", rank=1),
                  ikey("tenant-c", b"same"), ikey("tenant-a/ns", b"same", namespace="")):
        with pytest.raises(RemoteMiss):
            node.load(other, PAGE, page=8)
    assert node.load(ikey("tenant-a", b"same"), PAGE, page=8) == data_a
    assert node.load(ikey("tenant-b", b"same"), PAGE, page=8) == data_b
    other = Harness(master, arena, cluster_id="other-cluster", global_segment_bytes=0)
    try:
        with pytest.raises(RemoteMiss):
            other.load(ikey("tenant-a", b"same"), PAGE, page=16)
    finally:
        other.close()


def test_master_killed_opens_the_breaker_and_a_restarted_master_is_picked_up(master, node):
    key = ikey("uid:1", b"before")
    data = os.urandom(PAGE)
    node.publish(key, data, page=0)
    master.kill()
    with pytest.raises(TierUnavailable):
        node.run(node.tier.exists_job([ikey("uid:1", b"x")], FP))
    master.start()
    # the old master's metadata is gone (objects are misses); new writes and reads work again
    fresh = os.urandom(PAGE)

    def publish_again():
        try:
            node.publish(ikey("uid:1", b"after"), fresh, page=2)
            return True
        except Exception:  # TierUnavailable / refused while Mooncake remounts its segment
            node.tier.pending.clear()
            return False

    wait_for(publish_again, 30, "a publish through the restarted master", interval_s=0.5)
    assert node.load(ikey("uid:1", b"after"), PAGE, page=8) == fresh
