"""TenantTable: the daemon's tenant for a peer and a token (token > uid > gid > uid:N > anonymous),
quotas and bounded metric labels."""

import dataclasses

import pytest

from kvtierd.config import Config, TenantConfig
from kvtierd.peer import Peer
from kvtierd.tenants import ANONYMOUS, OTHER_LABEL, TenantRefused, TenantTable

CFG = Config(
    tenants=(
        TenantConfig("team-a", uids=(1001, 1002), gids=(3000,), tokens=("tok-a",),
                     max_bytes=16 * 1024**2),
        TenantConfig("ops", gids=(4000,), tokens=("tok-ops",), max_bytes=0),
        TenantConfig("by-uid", uids=(1500,)),
    ),
    tenant_max_bytes=4 * 1024**2,
    anonymous_tenant="allow",
)


def test_precedence_token_then_uid_then_gid_then_own_uid():
    table = TenantTable(CFG)
    assert table.resolve(Peer(1001, 4000, 1), "tok-ops").tenant == "ops"  # token beats uid
    assert table.resolve(Peer(1500, 3000, 1), "").tenant == "by-uid"  # uid beats gid
    assert table.resolve(Peer(7, 3000, 1), "").tenant == "team-a"  # gid
    assert table.resolve(Peer(1002, 9, 1), "").tenant == "team-a"  # uid
    assert table.resolve(Peer(7, 9, 1), "").tenant == "uid:7"  # nobody configured it: its own
    assert table.resolve(Peer(8, 9, 1), "").tenant == "uid:8"  # two users never share by default
    assert table.resolve(None, "tok-a").tenant == "team-a"  # token without credentials
    assert table.resolve(None, "").tenant == ANONYMOUS
    assert table.resolve(Peer(7, 9, 1), "unknown").tenant == "uid:7"  # (HELLO refuses it first)


def test_anonymous_only_where_allowed():
    # "auto": a tcp socket allows it (remote clients cannot do the handshake), ipc never does
    for socket, anonymous, allowed in (("ipc:///tmp/k.sock", "auto", False),
                                       ("tcp://127.0.0.1:5555", "auto", True),
                                       ("ipc:///tmp/k.sock", "allow", True),
                                       ("tcp://127.0.0.1:5555", "refuse", False)):
        table = TenantTable(dataclasses.replace(CFG, socket=socket, anonymous_tenant=anonymous))
        assert table.resolve(None, "tok-a").tenant == "team-a"  # a tenant token is never anonymous
        if allowed:
            assert table.resolve(None, "").tenant == ANONYMOUS
            continue
        with pytest.raises(TenantRefused) as refused:
            table.resolve(None, "")
        assert refused.value.reason == "anonymous" and "anonymous_tenant" in refused.value.message


def test_unmapped_peers_are_refused_unless_a_token_names_their_tenant():
    table = TenantTable(CFG)
    unmapped = Peer(65534, 65534, 0, unmapped=True)
    with pytest.raises(TenantRefused) as refused:
        table.resolve(unmapped, "")
    assert refused.value.reason == "unmapped_peer" and "65534" in refused.value.message
    assert table.resolve(unmapped, "tok-a").tenant == "team-a"
    assert table.resolve(Peer(65534, 65534, 5), "").tenant == "uid:65534"  # a mapped "nobody"


def test_token_compare_is_exact():
    table = TenantTable(CFG)
    for token in ("tok-a ", "TOK-A", "tok-", "tok-aa", "tok-ops\0"):
        assert table.token_tenant(token) is None, token
    assert table.token_tenant("tok-a") == "team-a" and table.has_tokens
    assert not TenantTable(Config()).has_tokens


def test_quotas_and_labels():
    table = TenantTable(CFG)
    assert table.quota_bytes("team-a") == 16 * 1024**2
    assert table.quota_bytes("ops") == 0  # explicit 0: only the capacity
    assert table.quota_bytes("by-uid") == 4 * 1024**2  # no max_bytes: tenant_max_bytes
    assert table.quota_bytes("uid:7") == 4 * 1024**2 and table.quota_bytes(ANONYMOUS) == 4 * 1024**2
    assert table.label("team-a") == "team-a"
    assert table.label("uid:7") == table.label(ANONYMOUS) == OTHER_LABEL
    assert table.labels() == ["team-a", "ops", "by-uid", OTHER_LABEL]
