"""Tenants against a real daemon: isolation (no reads, probes, overwrites or deletes across tenants),
sharing inside one configured tenant, and per-tenant quotas in the CPU tier.

The tenants here are configured by HELLO token, which works for every session; the same checks with
real users (tenant by uid over the staging handshake) live in test_tenant_users.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers.bad_input import POISON, Session, item_errors, names, namespace, write_toml
from helpers.wait import wait_for

from kvtierd.protocol import Op, Status, Tier

pytestmark = pytest.mark.timeout(90)

TWO_TENANTS = """\
[tenants.team-a]
tokens = ["token-of-a"]
[tenants.team-b]
tokens = ["token-of-b"]
"""
CHUNK = 100_000  # two 64 KiB pages, the last one partly used
FP = "fp-shared-layout"  # both tenants run the same model: same namespace, rank and fingerprint


def payloads(n: int) -> dict[bytes, bytes]:
    return {b"prefix-%02d" % i: os.urandom(CHUNK) for i in range(n)}


def put_inline(s: Session, chunks: dict[bytes, bytes]) -> list[str]:
    reply = s.put([[k, 0, len(v)] for k, v in chunks.items()], list(chunks.values()))
    return names(reply["results"])


def get_inline(s: Session, keys, nbytes: int = CHUNK) -> tuple[list[str], list[bytes]]:
    reply, frames = s.get([[k, 0, nbytes] for k in keys])
    return names(reply["results"]), frames


@pytest.fixture
def two_tenants(daemon_factory, tmp_path):
    config = write_toml(tmp_path / "tenants.toml", TWO_TENANTS)
    return daemon_factory("--config", str(config), "--expose-tenant-stats")  # stats()["tenants"]


def test_tenant_b_cannot_read_probe_overwrite_or_delete_tenant_a_chunks(two_tenants, sessions):
    d = two_tenants
    ns = namespace()
    a = sessions(d.address, ns, fingerprint=FP, token="token-of-a")
    b = sessions(d.address, ns, fingerprint=FP, token="token-of-b")
    nobody = sessions(d.address, ns, fingerprint=FP)  # no token, no credentials: "anonymous"
    other_layout = sessions(d.address, ns, fingerprint="fp-other")  # anonymous, another model
    mine = payloads(4)
    assert put_inline(a, mine) == ["OK"] * 4
    keys = list(mine)

    # Probe: 0 hits, and no LAYOUT_MISMATCH telling B that the key exists under another layout.
    for s in (b, nobody, other_layout):
        assert s.lookup(keys) == [Tier.NONE] * 4
        got, frames = get_inline(s, keys)
        assert got == ["MISS"] * 4 and frames == [b""] * 4  # 0 bytes of A's
    # Overwrite: B's PUT under A's keys stores B's own chunks (OK, not EXISTS / LAYOUT_MISMATCH).
    theirs = {k: os.urandom(CHUNK) for k in keys}
    assert put_inline(b, theirs) == ["OK"] * 4
    # Delete: B deletes its own chunks under those keys, never A's.
    reply, _ = b.request(Op.DELETE, keys=keys + [b"never-stored"])
    assert names(reply["results"]) == ["OK"] * 4 + ["MISS"]
    reply, _ = nobody.request(Op.DELETE, keys=keys)
    assert names(reply["results"]) == ["MISS"] * 4
    assert put_inline(other_layout, dict(list(theirs.items())[:1])) == ["OK"]  # not MISMATCH
    # A reloads every chunk byte-exact.
    got, frames = get_inline(a, keys)
    assert got == ["OK"] * 4 and frames == [mine[k] for k in keys], "tenant A's bytes changed"
    assert d.cpu()["deletes"] == 4  # B's four, nothing else
    d.check()


def test_poisoned_staging_buffer_of_another_tenant_stays_untouched(two_tenants, memfd, sessions):
    d = two_tenants
    ns = namespace()
    buf_a, buf_b = memfd(4 * CHUNK), memfd(4 * CHUNK)
    a = sessions(d.address, ns, staging=buf_a, fingerprint=FP, token="token-of-a")
    b = sessions(d.address, ns, staging=buf_b, fingerprint=FP, token="token-of-b")
    data = os.urandom(CHUNK)
    buf_a.write(0, data)
    assert names(a.put([[b"secret", 0, CHUNK]])["results"]) == ["OK"]
    buf_b.fill(POISON)
    reply, _ = b.get([[b"secret", CHUNK, CHUNK]])
    assert names(reply["results"]) == ["MISS"]
    assert buf_b.read(0, 4 * CHUNK) == bytes([POISON]) * (4 * CHUNK), "B's buffer was written"
    buf_a.fill(POISON)
    reply, _ = a.get([[b"secret", CHUNK, CHUNK]])
    assert names(reply["results"]) == ["OK"] and buf_a.read(CHUNK, CHUNK) == data


def test_sessions_of_one_tenant_share_their_chunks(two_tenants, sessions):
    d = two_tenants
    ns = namespace()
    writer = sessions(d.address, ns, fingerprint=FP, token="token-of-a")
    reader = sessions(d.address, ns, fingerprint=FP, token="token-of-a")
    chunks = payloads(3)
    assert put_inline(writer, chunks) == ["OK"] * 3
    assert reader.lookup(list(chunks)) == [Tier.CPU] * 3
    got, frames = get_inline(reader, chunks)
    assert got == ["OK"] * 3 and frames == list(chunks.values())
    assert put_inline(reader, chunks) == ["EXISTS"] * 3  # the same chunks, not copies
    tenants = d.stats()["tenants"]
    assert tenants["team-a"]["used_bytes"] == 3 * 2 * 64 * 1024
    assert tenants["team-b"]["used_bytes"] == 0


def test_unknown_token_is_refused_when_tenant_tokens_are_configured(two_tenants, sessions):
    from helpers.raw import RawClient

    raw = RawClient(two_tenants.address)
    try:
        reply, _ = raw.request(Op.HELLO, namespace="n", rank=0, world_size=1, fingerprint=FP,
                               staging={"kind": "inline"}, token="token-of-c")
        assert reply["name"] == "AUTH_FAILED" and "token-of-c" not in reply["message"], reply
    finally:
        raw.close()


QUOTA = """\
[tenants.greedy]
tokens = ["token-greedy"]
max_bytes = "1MiB"
[tenants.victim]
tokens = ["token-victim"]
"""


def metric(text: str, name: str, tenant: str) -> float:
    found = re.search(rf'^{name}\{{tenant="{tenant}"\}} (\S+)$', text, re.M)
    assert found, f"{name}{{tenant={tenant}}} not exported"
    return float(found.group(1))


def test_quota_exhaustion_evicts_only_the_tenants_own_chunks_then_refuses(
        daemon_factory, tmp_path, sessions):
    config = write_toml(tmp_path / "quota.toml", QUOTA)
    d = daemon_factory("--config", str(config), "--nvme-bytes", "0", "--expose-tenant-stats")
    ns = namespace()
    victim = sessions(d.address, ns, fingerprint=FP, token="token-victim")
    greedy = sessions(d.address, ns, fingerprint=FP, token="token-greedy")
    kept = payloads(6)
    assert put_inline(victim, kept) == ["OK"] * 6

    # 1 MiB = 16 pages = 8 chunks of 2 pages. The first 8 fit; the next 8 evict greedy's own.
    first = {b"g-first-%d" % i: os.urandom(CHUNK) for i in range(8)}
    second = {b"g-second-%d" % i: os.urandom(CHUNK) for i in range(8)}
    assert put_inline(greedy, first) == ["OK"] * 8
    assert put_inline(greedy, second) == ["OK"] * 8
    assert greedy.lookup(list(first)) == [Tier.NONE] * 8  # its own coldest went
    assert d.cpu()["evictions"] == 8

    # With all of its chunks leased, nothing of its own can go: refused, nobody else evicted.
    reply, _ = greedy.request(Op.LOOKUP, keys=list(second), lease=True)
    assert reply["tiers"] == [Tier.CPU] * 8
    reply = greedy.put([[b"g-over", 0, CHUNK]], [os.urandom(CHUNK)])
    assert names(reply["results"]) == ["QUOTA_EXCEEDED"]
    message = item_errors(reply)[0][1]
    assert "greedy" in message and "1048576" in message and str(CHUNK) in message, message
    assert d.cpu()["evictions"] == 8

    got, frames = get_inline(victim, kept)
    assert got == ["OK"] * 6 and frames == list(kept.values()), "another tenant's chunks changed"
    got, frames = get_inline(greedy, second)
    assert got == ["OK"] * 8 and frames == list(second.values())

    tenants = d.stats()["tenants"]
    assert tenants["greedy"] == {"used_bytes": 1024**2, "quota_bytes": 1024**2,
                                 "quota_rejections": 1}
    assert tenants["victim"]["used_bytes"] == 6 * 2 * 64 * 1024
    assert tenants["victim"]["quota_rejections"] == 0
    text = d.metrics_text()
    assert metric(text, "kvtierd_tenant_used_bytes", "greedy") == 1024**2
    assert metric(text, "kvtierd_tenant_quota_bytes", "greedy") == 1024**2
    assert metric(text, "kvtierd_tenant_quota_bytes", "victim") == 0
    assert metric(text, "kvtierd_quota_rejections_total", "greedy") == 1
    assert metric(text, "kvtierd_quota_rejections_total", "victim") == 0
    assert metric(text, "kvtierd_tenant_used_bytes", "other") == 0
    table = subprocess.run([sys.executable, "-m", "kvtierd", "stats", "--socket", d.address],
                           capture_output=True, text=True, timeout=30, check=True).stdout
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.strip()}
    assert rows["tenant"] == ["tenant", "cpu", "used", "quota", "used%", "refused"], table
    assert rows["greedy"] == ["greedy", "1.0", "MiB", "1.0", "MiB", "100.0%", "1"], table
    assert rows["victim"][-3:] == ["none", "-", "0"], table
    d.check()


def test_a_chunk_larger_than_the_quota_is_refused_without_evicting(daemon_factory, tmp_path,
                                                                    sessions):
    config = write_toml(tmp_path / "quota.toml", QUOTA)
    d = daemon_factory("--config", str(config), "--nvme-bytes", "0", "--expose-tenant-stats")
    greedy = sessions(d.address, namespace(), fingerprint=FP, token="token-greedy")
    small = payloads(2)
    assert put_inline(greedy, small) == ["OK"] * 2
    big = os.urandom(1024**2 + 1)
    reply = greedy.put([[b"too-big", 0, len(big)]], [big])
    assert names(reply["results"]) == ["QUOTA_EXCEEDED"]
    got, frames = get_inline(greedy, small)
    assert got == ["OK"] * 2 and frames == list(small.values())
    assert d.cpu().get("evictions", 0) == 0


def test_promotion_past_the_quota_is_refused_until_own_chunks_can_go(daemon_factory, tmp_path,
                                                                     sessions):
    config = write_toml(tmp_path / "quota.toml", QUOTA)
    # with an NVMe tier: own evictions are demotions
    d = daemon_factory("--config", str(config), "--expose-tenant-stats")
    greedy = sessions(d.address, namespace(), fingerprint=FP, token="token-greedy")
    first = {b"g-first-%d" % i: os.urandom(CHUNK) for i in range(8)}
    second = {b"g-second-%d" % i: os.urandom(CHUNK) for i in range(8)}
    assert put_inline(greedy, first) == ["OK"] * 8
    assert put_inline(greedy, second) == ["OK"] * 8
    wait_for(lambda: greedy.lookup(list(first)) == [Tier.NVME] * 8, 20, "first chunks on NVMe")
    reply, _ = greedy.request(Op.LOOKUP, keys=list(second), lease=True)
    assert reply["tiers"] == [Tier.CPU] * 8
    key = next(iter(first))
    reply, frames = greedy.get([[key, 0, CHUNK]])
    assert names(reply["results"]) == ["QUOTA_EXCEEDED"] and frames == [b""], reply
    assert "cannot promote" in item_errors(reply)[0][1] and "greedy" in item_errors(reply)[0][1]
    got, frames = get_inline(greedy, second)  # a GET consumes the leases
    assert got == ["OK"] * 8 and frames == list(second.values())
    got, frames = get_inline(greedy, [key])
    assert got == ["OK"] and frames == [first[key]]  # promoted, its own coldest made room
    assert d.stats()["tenants"]["greedy"]["used_bytes"] <= 1024**2
