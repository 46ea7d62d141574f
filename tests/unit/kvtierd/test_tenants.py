"""TenantTable: the daemon's tenant for a peer and a token (token > uid > gid > uid:N > anonymous),
quotas and bounded metric labels."""

from kvtierd.config import Config, TenantConfig
from kvtierd.peer import Peer
from kvtierd.tenants import ANONYMOUS, OTHER_LABEL, TenantTable

CFG = Config(
    tenants=(
        TenantConfig("team-a", uids=(1001, 1002), gids=(3000,), tokens=("tok-a",),
                     max_bytes=16 * 1024**2),
        TenantConfig("ops", gids=(4000,), tokens=("tok-ops",), max_bytes=0),
        TenantConfig("by-uid", uids=(1500,)),
    ),
    tenant_max_bytes=4 * 1024**2,
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
