"""Session and index ops: HELLO, BYE, PING, LOOKUP, DELETE, STATS, CHECK (one method each).

The ops that move bytes (PUT, GET) live in ``data_ops``. Each method returns the reply's fields, or
raises ``ProtocolError`` for a request refused as a whole; a LOOKUP waiting for a lower tier's
existence check returns None and is answered through ``send``.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from typing import Callable

from kvtierd import __version__, cuda_health, staging_cuda
from kvtierd.config import Config
from kvtierd.config_tenants import per_uid_cap
from kvtierd.ghost import GhostCaches
from kvtierd.metrics import DaemonMetrics
from kvtierd.peer import Peer
from kvtierd.protocol import (
    MAX_KEY_BYTES,
    PROTOCOL_VERSION,
    STAGING_KINDS,
    ProtocolError,
    Status,
    Tier,
    reply,
)
from kvtierd.server import requests
from kvtierd.server.accounting import Accounting
from kvtierd.server.admission import holds_admin_token, token_matches
from kvtierd.server.chain import MISSED, ChainEvents, TierChain
from kvtierd.server.sessions import Session, SessionTable
from kvtierd.server.tickets import TicketBook
from kvtierd.staging import MemfdStaging
from kvtierd.staging_cuda import CudaIpcStaging
from kvtierd.tenants import OTHER_LABEL, TenantRefused, TenantTable
from kvtierd.tiers.base import MISMATCH_SLOT, MISS_SLOT
from kvtierd.tiers.chunk import ChunkEntry

log = logging.getLogger(__name__)
_CPU, _NONE = int(Tier.CPU), int(Tier.NONE)
_CODE = {tier: int(tier) for tier in Tier}
_LABEL = {tier: tier.name.lower() for tier in Tier}


def _keys_problem(keys: list) -> tuple[Status, str] | None:
    """Why some key of a batch cannot name a chunk (the first such key), or None. A good batch
    is checked in one pass (``requests.good_keys``); a bad one key by key for the message."""
    if requests.good_keys(keys):
        return None
    for key in keys:
        problem = requests.key_problem(key)
        if problem is not None:
            return problem
    return None


class OpHandlers:
    def __init__(
        self,
        cfg: Config,
        mover: TierChain,
        sessions: SessionTable,
        metrics: DaemonMetrics,
        accounting: Accounting,
        tickets: TicketBook,
        tenants: TenantTable,
    ) -> None:
        self.cfg = cfg
        self.tenants = tenants
        self.mover = mover
        self._ping = {"handshake": str(cfg.handshake_path)}  # a PING's answer never changes
        self.tier = mover.cpu
        self.sessions = sessions
        self.metrics = metrics
        self.accounting = accounting
        self.tickets = tickets
        self.send: Callable[..., object] = lambda *args, **kw: None  # the daemon's reply sender
        self.handshake_stats: dict[str, int] = {}  # the handshake server's counts (STATS)
        self.ghosts = GhostCaches([], cfg.page_bytes)  # the daemon sets the real ones
        self.started_at = time.time()
        self.metrics_address: str = ""
        self.pinning: Callable[[], dict] | None = None  # the arena's CUDA pinning progress
        self.connections: Callable[[], dict] | None = None  # the connection guard's counts
        # Sessions one uid may hold (the daemon sets it from the caps in force).
        self.max_sessions_per_uid = per_uid_cap(cfg.max_sessions_per_uid, cfg.max_sessions)

    # -- session ---------------------------------------------------------------------------------
    def hello(self, identity: bytes, header: dict, frames: list) -> dict:
        token = self._authorise(header)
        namespace = requests.text(header, "namespace", requests.MAX_NAMESPACE_CHARS)
        world_size = requests.integer(header, "world_size", 1, requests.MAX_WORLD_SIZE)
        rank = requests.integer(header, "rank", 0, world_size - 1)
        fingerprint = requests.text(header, "fingerprint", requests.MAX_FINGERPRINT_CHARS)
        staging_spec = requests.field(header, "staging", dict, "a staging handle map")
        client = requests.client_map(header)
        # The peer's kernel-reported credentials come with the ticket of its staging handshake;
        # without one (an inline client over TCP) only a tenant token places it outside
        # "anonymous". Opened last: nothing after it can refuse the HELLO.
        staging, peer = self._open_staging(staging_spec)
        try:
            try:
                assigned = self.tenants.resolve(peer, token)
            except TenantRefused as exc:
                self.metrics.refused.labels(exc.reason).inc()
                log.info("HELLO of %s refused: %s", peer.describe() if peer else "a peer "
                         "without credentials", exc.message)
                raise
            self._check_sessions_of(peer, identity)
            session = Session(identity, assigned.tenant, namespace, rank, world_size, fingerprint,
                              staging, client, peer=peer)
            self.sessions.add(session)
        except BaseException:  # a refused HELLO keeps no mapping: the client frees its buffer
            if staging is not None:
                staging.close()
            raise
        self.metrics.sessions.set(len(self.sessions))
        log.info(
            "session %d: tenant %s (%s) namespace %s rank %d/%d staging %s peer %s", session.id,
            assigned.tenant, assigned.reason, namespace, rank, world_size,
            staging.name if staging else "inline",
            peer.describe() if peer else "unknown (no handshake)",
        )
        return {
            "session": session.id,
            "secret": session.secret,  # every later request of the session carries it
            "page_bytes": self.cfg.page_bytes,
            "daemon": __version__,
            "limits": self.limits(),
            "events": bool(self.cfg.events_addr),  # PUT's ``blocks`` is worth sending
        }

    def _check_sessions_of(self, peer: Peer | None, identity: bytes) -> None:
        """BUSY when the peer's uid already holds ``max_sessions_per_uid`` sessions (sessions
        without credentials count as one user), so one user cannot take every session. The
        session this HELLO replaces (same routing id) does not count."""
        uid = peer.uid if peer is not None else None
        cap = self.max_sessions_per_uid
        held = self.sessions.count_of_uid(uid, excluding=identity)
        if held < cap:
            return
        self.metrics.refused.labels("sessions_per_uid").inc()
        who = f"uid {uid}" if uid is not None else "peers without credentials"
        raise ProtocolError(Status.BUSY, f"{who} already hold(s) {held} sessions, "
                            f"max_sessions_per_uid is {cap}; close one (BYE) or retry later")

    def _authorise(self, header: dict) -> str:
        """The HELLO token ("" if none), refused when it does not open this daemon: with an
        ``auth_token`` the token must be it or a tenant's token; with tenant tokens configured, a
        token that is none of them is refused rather than silently ignored (a mistyped tenant
        token would otherwise land the session in its uid's tenant)."""
        token = header.get("token", "")
        if not isinstance(token, str) or len(token) > requests.MAX_TOKEN_CHARS:
            raise ProtocolError(Status.AUTH_FAILED, "HELLO token missing or wrong")
        tenant = self.tenants.token_tenant(token) if token else None
        if self.cfg.auth_token:
            # A tenant token is an operator-issued credential too: its session counts as one
            # opened with auth_token (STATS/CHECK included).
            if not token_matches(token, self.cfg.auth_token) and tenant is None:
                raise ProtocolError(Status.AUTH_FAILED, "HELLO token missing or wrong")
        elif token and tenant is None and self.tenants.has_tokens:
            raise ProtocolError(Status.AUTH_FAILED, "HELLO token is no configured tenant's token")
        return token

    def limits(self) -> dict[str, int]:
        return {
            "protocol": PROTOCOL_VERSION,
            "max_batch": self.cfg.max_batch,
            "max_key_bytes": MAX_KEY_BYTES,
            "max_header_bytes": self.cfg.max_header_bytes,
            "max_inline_bytes": self.cfg.max_inline_bytes,
            "max_frame_bytes": self.cfg.max_frame_bytes,
            "max_staging_bytes": self.cfg.max_staging_bytes,
            "max_inline_reply_bytes": self.cfg.max_inline_reply_bytes,
            "max_in_flight_requests": self.cfg.max_in_flight_requests,
        }

    def _open_staging(self, spec: dict) -> tuple[MemfdStaging | CudaIpcStaging | None,
                                                   Peer | None]:
        """The session's staging and peer, from the ticket of its handshake."""
        kind = spec.get("kind")
        if kind == "shm":
            raise ProtocolError(Status.BAD_HANDLE, "shm staging by name was removed in protocol "
                                "2; use the handshake (memfd)")
        if kind not in STAGING_KINDS:
            raise ProtocolError(Status.BAD_HANDLE, f"staging kind {kind!r:.40} is unknown; "
                                f"allowed: {', '.join(STAGING_KINDS)}")
        if kind == "inline":
            if spec.get("ticket") is None:
                return None, None  # e.g. a remote TCP client: no credentials
            return None, self.tickets.take(spec.get("ticket"), kind).peer
        ticket = self.tickets.take(spec.get("ticket"), kind)
        if kind == "memfd":
            return ticket.staging, ticket.peer
        if spec.get("nbytes") != ticket.nbytes:
            raise ProtocolError(Status.BAD_HANDLE, f"cuda_ipc nbytes {spec.get('nbytes')!r:.40} "
                                f"differs from the {ticket.nbytes} of its handshake")
        # refused with the reason when this daemon has no CUDA
        return CudaIpcStaging(spec, self.cfg.max_staging_bytes), ticket.peer

    def bye(self, session: Session, header: dict, frames: list) -> dict:
        self.sessions.close(session, "bye")
        self.metrics.sessions.set(len(self.sessions))
        self.metrics.sessions_closed.labels("bye").inc()
        return {}

    def ping(self, session: Session | None, header: dict, frames: list) -> dict:
        return dict(self._ping)

    # -- index -----------------------------------------------------------------------------------
    def lookup(self, session: Session, header: dict, frames: list) -> dict | None:
        """Answered now, or (None) once the batched existence checks of the keys that only a
        lower tier such as the remote one can tell about have answered (``TierChain.check``).

        Either way the batch is looked up as one (``_find``: the arena's compact index, then
        each lower tier once for the arena's misses) and answered as one (``_answer``); a
        LOOKUP that waits for a check is looked up again when it answers (what the tiers know
        then), as it was key by key before (a 1024-key LOOKUP then cost two chain walks per
        key, and an entry per remote hit even when nothing was leased)."""
        keys = requests.batch(header, "keys", self.cfg.max_batch)
        lease = requests.flag(header, "lease", False)
        found = self._find(session, keys, lease)
        below = found[1]
        if below and self.mover.checks_existence:
            space = session.space
            missed = [(space, keys[i]) for i, (status, _, _) in below.items()
                      if status is Status.MISS]
            started = time.perf_counter()

            def later() -> None:  # answered with what the tiers know now
                try:
                    leasing = lease and not session.closed
                    fields = self._answer(session, keys, self._find(session, keys, leasing),
                                          leasing)
                    header_out, status = reply(header.get("id"), Status.OK, **fields), "OK"
                except Exception as exc:  # every request gets a reply, even this late
                    log.exception("answering a LOOKUP after its existence check failed")
                    header_out = reply(header.get("id"), Status.INTERNAL, f"internal error: {exc}")
                    status = Status.INTERNAL.name
                self.send(session.identity, header_out, [])
                self.metrics.requests.labels("lookup", status).inc()
                self.metrics.latency.labels("lookup").observe(time.perf_counter() - started)

            if missed and self.mover.check(missed, session.fingerprint, later):
                return None
        return self._answer(session, keys, found, lease)

    def _find(self, session: Session, keys: list, lease: bool
              ) -> tuple[list[int], dict[int, tuple[Status, Tier, ChunkEntry | None]]]:
        """The batch's lookups: the arena answers it from its compact index (``lookup_slots``:
        no entry built unless a hit is leased), the lower tiers only its misses
        (``lookup_below_many``: entries only when leasing). Only the keys the index does not
        hold are validated (before anything is touched): a hit is a key a PUT validated, and
        checking 1024 keys' types and lengths cost as much as decoding them. Returns the slots
        and, by position, the lower tiers' answers for the arena's misses."""
        cpu, fingerprint = self.mover.cpu, session.fingerprint

        def refuse_bad_misses(found: list[int]) -> None:
            if MISS_SLOT in found:
                problem = _keys_problem([k for k, slot in zip(keys, found) if slot == MISS_SLOT])
                if problem is not None:
                    raise ProtocolError(problem[0], problem[1])

        try:
            slots = cpu.lookup_slots(session.space, keys, fingerprint, refuse_bad_misses)
        except TypeError:  # an unhashable key (a msgpack array or map): refused before any touch
            problem = _keys_problem(keys)
            if problem is None:
                raise
            raise ProtocolError(problem[0], problem[1]) from None
        if not self.mover.links or MISS_SLOT not in slots:
            return slots, {}
        missing = [i for i, slot in enumerate(slots) if slot == MISS_SLOT]
        space = session.space
        answers = self.mover.lookup_below_many([(space, keys[i]) for i in missing], fingerprint,
                                               entries=lease)
        return slots, dict(zip(missing, answers))

    def _answer(self, session: Session, keys: list,
                found: tuple[list[int], dict[int, tuple[Status, Tier, ChunkEntry | None]]],
                lease: bool) -> dict:
        """The reply to a batch ``_find`` looked up: counts and ghosts fed once per batch,
        leases taken. Same answers, touches, leases and counts as answering key by key. A batch
        the arena answers alone (all hits, or no lower tier) builds its answer with list
        operations."""
        cpu = self.mover.cpu
        slots, below = found
        n = len(slots)
        if n and min(slots) >= 0:  # every key a CPU hit (the common case): no per-key pass
            self.accounting.lookup_cpu_hits(n)
            self.ghosts.access_uniform(session.space, keys, "cpu")
            if lease:
                entry, pin = cpu.index.entry, self.sessions.lease
                for slot in slots:
                    pin(session, entry(slot))
            return {"tiers": [_CPU] * n}
        missed, mismatched = slots.count(MISS_SLOT), slots.count(MISMATCH_SLOT)
        if missed or mismatched:
            tiers = [_CPU if slot >= 0 else _NONE for slot in slots]
            names: list[str | None] = ["cpu" if slot >= 0 else None for slot in slots]
        else:
            tiers, names = [_CPU] * n, ["cpu"] * n
        hits: Counter[Tier] = Counter({Tier.CPU: n - missed - mismatched})
        misses: Counter[Status] = Counter({Status.LAYOUT_MISMATCH: mismatched})
        leased: dict[int, ChunkEntry] = {}
        if missed and not below:
            misses[Status.MISS] += missed
        elif missed:
            lost = list(below.values()).count(MISSED)  # missed everywhere: identity, in C
            misses[Status.MISS] += lost
            if lost < len(below):
                per_tier: Counter[Tier] = Counter()
                for i, answer in below.items():
                    if answer is MISSED:
                        continue
                    status, tier, entry = answer
                    if status is not Status.OK:
                        misses[status] += 1
                        continue
                    if entry is not None:
                        leased[i] = entry
                    tiers[i] = _CODE[tier]  # Enum .name and int() cost more than the rest
                    names[i] = _LABEL[tier]
                    per_tier[tier] += 1
                hits.update(per_tier)
        self.accounting.lookup_counts(+hits, +misses)
        self.ghosts.access_many(session.space, keys, names)
        if lease:
            for i, slot in enumerate(slots):
                if slot >= 0:
                    self.sessions.lease(session, cpu.index.entry(slot))
                elif i in leased:
                    self.sessions.lease(session, leased[i])
        return {"tiers": tiers}

    def delete(self, session: Session, header: dict, frames: list) -> dict:
        keys = requests.batch(header, "keys", self.cfg.max_batch)
        if self.tier.on_remove is None and (not self.mover.links
                                            or self._arena_only(session, keys)):
            return {"results": self._delete_arena_only(session, keys)}
        results = []
        for key in keys:
            problem = requests.key_problem(key)
            if problem is not None:
                results.append(int(problem[0]))
                continue
            ikey = session.ikey(key)
            status, _, _ = self.mover.lookup(ikey, session.fingerprint)
            if status is Status.LAYOUT_MISMATCH:
                results.append(int(status))
                continue
            self.sessions.release_lease(session, ikey)
            results.append(int(self.mover.delete(ikey)))
            self.ghosts.remove(ikey)
        return {"results": results}

    def _arena_only(self, session: Session, keys: list) -> bool:
        """Whether a DELETE of ``keys`` with tiers below is the arena's alone: every key good, no
        lower tier holds any of them (available or not: its deletions are bookkeeping first) or
        may hold one unknown to this node (a remote tier), and the chain keeps nothing per arena
        chunk (no read counts for an admission filter, no events)."""
        mover = self.mover
        if (mover.counts_reads or type(mover.events) is not ChainEvents
                or _keys_problem(keys) is not None):
            return False
        return not any(link.tier.checks_existence or link.tier.holds_any(session.space, keys)
                       for link in mover.links)

    def _delete_arena_only(self, session: Session, keys: list) -> list[int]:
        """DELETE without kv-events and without lower tiers (or none that holds any of the keys:
        ``_arena_only``), so nothing wants an entry per removed chunk: the CPU tier deletes the
        whole batch by slots, the ghosts forget it in one call. The same statuses, leases and
        ghost updates as the per-key path."""
        mismatch = int(Status.LAYOUT_MISMATCH)
        if _keys_problem(keys) is None:  # every key good (checked in C): statuses as they come
            results = self.tier.delete_many(session.space, keys, session.fingerprint)
            forgotten = (keys if mismatch not in results
                         else [key for key, status in zip(keys, results) if status != mismatch])
        else:
            results = [0] * len(keys)
            valid: list[bytes] = []
            where: list[int] = []
            for i, key in enumerate(keys):
                problem = requests.key_problem(key)
                if problem is not None:
                    results[i] = int(problem[0])
                else:
                    valid.append(key)
                    where.append(i)
            if not valid:
                return results
            statuses = self.tier.delete_many(session.space, valid, session.fingerprint)
            forgotten = []
            for i, key, status in zip(where, valid, statuses):
                results[i] = status
                if status != mismatch:
                    forgotten.append(key)
        if session.leases:  # released after the chunk left: unpinning a removed entry is a no-op
            for key in forgotten:
                self.sessions.release_lease(session, (session.space, key))
        self.ghosts.remove_many(session.space, forgotten)
        return results

    def stats(self, session: Session | None, header: dict, frames: list) -> dict:
        return {
            "stats": {
                "daemon": {
                    "version": __version__,
                    "protocol": PROTOCOL_VERSION,
                    "pid": os.getpid(),
                    "uptime_s": round(time.time() - self.started_at, 3),
                    "socket": self.cfg.socket,
                    "metrics": self.metrics_address,
                    "page_bytes": self.cfg.page_bytes,
                },
                "tiers": dict(self.mover.tier_stats()),
                # per-tenant rows only for the operator (README "Security model")
                **({"tenants": self.tenant_stats()} if self.cfg.expose_tenant_stats
                   or holds_admin_token(self.cfg, session, header) else
                   {"tenants_hidden": "per-tenant figures need admin_token or auth_token (or "
                                      "expose_tenant_stats = true)"}),
                "sessions": len(self.sessions),
                "connections": self.connections() if self.connections else {},
                "handshake": {"socket": str(self.cfg.handshake_path), "tickets": len(self.tickets),
                              **self.handshake_stats},
                "counts": dict(self.accounting.counts),
                "ghosts": self.ghosts.stats(),
                "cuda": {"pinning": self.pinning() if self.pinning else None,
                         **staging_cuda.stats(),
                         # devices whose context hit a sticky error (the daemon is exiting)
                         "lost": {str(d): why for d, why in cuda_health.lost().items()}},
            }
        }

    def tenant_stats(self, limit: int = 64) -> dict[str, dict[str, int]]:
        """CPU-tier use per tenant: every configured tenant, then the implicit ones with the
        most bytes (at most ``limit`` rows in all; the rest summed up as ``other``)."""
        per = self.tier.tenant_stats()
        for name in self.tenants.configured:
            per.setdefault(name, {"used_bytes": 0, "quota_bytes": self.tenants.quota_bytes(name),
                                  "quota_rejections": 0})
        configured = {n: per.pop(n) for n in list(per) if n in self.tenants.configured}
        implicit = sorted(per.items(), key=lambda kv: -kv[1]["used_bytes"])
        room = max(0, limit - len(configured))
        out = {**configured, **dict(implicit[:room])}
        rest = implicit[room:]
        if rest:
            out[OTHER_LABEL] = {k: sum(v[k] for _, v in rest)
                                for k in ("used_bytes", "quota_rejections")}
            out[OTHER_LABEL]["quota_bytes"] = self.tenants.default_max_bytes
        return out

    def check(self, session: Session | None, header: dict, frames: list) -> dict:
        """Verify tier and session invariants; O(chunks), so an admin/test op, not a hot one."""
        try:
            self.tier.check_invariants()
            self.mover.check_invariants()
            self.sessions.check_invariants()
            self.ghosts.check_invariants()
        except AssertionError as exc:
            log.error("invariant violated: %s", exc)
            raise ProtocolError(Status.INTERNAL, f"invariant violated: {exc}") from None
        return {"checked": {"chunks": len(self.tier.index), "sessions": len(self.sessions)}}
