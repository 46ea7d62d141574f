"""Tenants: who a chunk belongs to, decided by the daemon from credentials, never by the client.

A session's tenant is resolved once, at HELLO, from what the daemon knows about the peer (most
specific first):

1. its HELLO ``token``, if it is one of a configured tenant's ``tokens`` (compared in constant
   time: the token is the only secret here);
2. its uid (SO_PEERCRED from the staging handshake), if a configured tenant lists it;
3. its primary gid, if a configured tenant lists it;
4. otherwise the implicit tenant ``uid:N`` of its uid — so two users never share by default;
5. a session with neither credentials nor a tenant token (an inline client over TCP) is the fixed
   tenant ``anonymous``, a quota every such client shares — only where ``anonymous_tenant``
   allows it (by default on a tcp:// socket, never on ipc://, where every local client can do
   the staging handshake); elsewhere the HELLO is refused.

A peer whose credentials the daemon's user namespace cannot tell apart (``Peer.unmapped``: every
unmapped user reads as uid 65534) is refused unless step 1 names its tenant: otherwise every user
outside the namespace would be one tenant and read each other's chunks.

The tenant is the first part of every chunk's identity (``ikey = ((tenant, namespace, rank), key)``),
so another tenant's chunks are simply not in the key space a session can name: they miss, they
never answer LAYOUT_MISMATCH or BUSY, they are never overwritten or deleted.

Metrics label tenants by configured name and aggregate every implicit tenant as ``other``, so the
label's cardinality is bounded by the config.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from kvtierd.config import Config, TenantConfig
from kvtierd.peer import Peer
from kvtierd.protocol import ProtocolError, Status

ANONYMOUS = "anonymous"
OTHER_LABEL = "other"  # metrics label of every implicit tenant (uid:N, anonymous)


class TenantRefused(ProtocolError):
    """A HELLO no tenant can be given to; ``reason`` labels kvtierd_refused_total."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(Status.AUTH_FAILED, message)
        self.reason = reason


@dataclass(frozen=True)
class Assignment:
    tenant: str
    reason: str  # how it was matched, for the session's log line ("token", "uid 1001", ...)


class TenantTable:
    def __init__(self, cfg: Config) -> None:
        self.configured: dict[str, TenantConfig] = {t.name: t for t in cfg.tenants}
        self.default_max_bytes = cfg.tenant_max_bytes
        self._by_uid = {uid: t.name for t in cfg.tenants for uid in t.uids}
        self._by_gid = {gid: t.name for t in cfg.tenants for gid in t.gids}
        self._tokens = [(tok.encode("utf-8"), t.name) for t in cfg.tenants for tok in t.tokens]
        self.has_tokens = bool(self._tokens)
        self.allows_anonymous = cfg.allows_anonymous
        self._handshake = str(cfg.handshake_path)

    def token_tenant(self, token: str) -> str | None:
        """The configured tenant whose token this is, or None. Every token is compared (in
        constant time each), so the answer's timing does not say which tenant, if any, matched."""
        given = token.encode("utf-8", "surrogatepass")
        found = None
        for candidate, name in self._tokens:
            if hmac.compare_digest(given, candidate) and found is None:
                found = name
        return found

    def resolve(self, peer: Peer | None, token: str) -> Assignment:
        by_token = self.token_tenant(token) if token else None
        if by_token is not None:
            return Assignment(by_token, "token")
        if peer is None:
            if not self.allows_anonymous:
                raise TenantRefused("anonymous", "HELLO without credentials (no staging "
                                    "handshake ticket) and without a tenant's token would be the "
                                    "shared tenant 'anonymous', which this daemon does not allow "
                                    "(anonymous_tenant); do the staging handshake at "
                                    f"{self._handshake} (kind inline for a session without shared "
                                    "memory) or present a configured tenant's token")
            return Assignment(ANONYMOUS, "no credentials")
        if peer.unmapped:
            raise TenantRefused("unmapped_peer", f"your credentials read as uid {peer.uid} gid "
                                f"{peer.gid} (the overflow ids): your user is not mapped into "
                                "the daemon's user namespace, so the daemon cannot tell you from "
                                "other unmapped users; present a configured tenant's token, or "
                                "run the daemon in a user namespace that maps your uid and gid")
        if peer.uid in self._by_uid:
            return Assignment(self._by_uid[peer.uid], f"uid {peer.uid}")
        if peer.gid in self._by_gid:
            return Assignment(self._by_gid[peer.gid], f"gid {peer.gid}")
        return Assignment(f"uid:{peer.uid}", f"uid {peer.uid}")

    def quota_bytes(self, tenant: str) -> int:
        """The tenant's CPU-tier quota in bytes; 0 means only the tier's capacity."""
        configured = self.configured.get(tenant)
        if configured is not None and configured.max_bytes is not None:
            return configured.max_bytes
        return self.default_max_bytes

    def label(self, tenant: str) -> str:
        return tenant if tenant in self.configured else OTHER_LABEL

    def labels(self) -> list[str]:
        return [*self.configured, OTHER_LABEL]
