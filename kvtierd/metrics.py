"""Prometheus metrics of one daemon, on private registries served by prometheus-client's WSGI app.

Names carry units (``_bytes``, ``_seconds``, ``_total``); labels are bounded enums (op, status,
tier, direction, reason), never keys or session ids. Tier gauges are read from the tier's running
totals at scrape time, so they cost nothing on the request path.

Per-tenant figures (``kvtierd_tenant_*``, quota rejections by tenant) live in a registry of their
own: tenants share the node, and what one tenant stores is not another's to read. A scrape sees
them only with ``Authorization: Bearer TOKEN`` holding ``admin_token`` or ``auth_token`` (or when
the operator sets ``expose_tenant_stats``); every aggregate stays open to any scrape.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# Request latencies span ~20 µs (PING) to ~100 ms (large batches).
LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3,
    1.0,
)


# kvtierd_refused_total reasons: max_connections, max_sessions, max_in_flight_requests,
# max_inline_reply_bytes, a STATS/CHECK without a token, a request without its session's secret,
# the per-uid caps (max_connections_per_uid, max_sessions_per_uid), a peer whose credentials the
# daemon's user namespace cannot tell apart, a HELLO that would be the anonymous tenant where it is
# not allowed.
REFUSAL_REASONS = ("connections", "sessions", "in_flight", "inline_reply_bytes", "auth", "secret",
                   "connections_per_uid", "sessions_per_uid", "unmapped_peer", "anonymous")


class TierCollector(Collector):
    """Exports a tier's capacity, usage, chunk counts and eviction counters at scrape time."""

    def __init__(self, tiers: Callable[[], Iterable[tuple[str, dict[str, int]]]]) -> None:
        self._tiers = tiers

    def collect(self):
        capacity = GaugeMetricFamily(
            "kvtierd_tier_capacity_bytes", "Configured capacity of a tier", labels=["tier"]
        )
        used = GaugeMetricFamily(
            "kvtierd_tier_used_bytes", "Bytes allocated in a tier (committed + pending)",
            labels=["tier"],
        )
        chunks = GaugeMetricFamily(
            "kvtierd_tier_chunks", "Chunks in a tier by state", labels=["tier", "state"]
        )
        evictions = CounterMetricFamily(
            "kvtierd_evictions", "Chunks evicted from a tier", labels=["tier"]
        )
        deferred = CounterMetricFamily(
            "kvtierd_evictions_deferred",
            "Evictions a tier put off: the victim was to cascade to the tier below but the arena's "
            "bounce pages were in use (the chunk that needed the room went below itself)",
            labels=["tier"],
        )
        direct = GaugeMetricFamily(
            "kvtierd_nvme_direct_io", "1 when the NVMe tier uses O_DIRECT, 0 when buffered"
        )
        for name, stats in self._tiers():
            capacity.add_metric([name], stats["capacity_bytes"])
            used.add_metric([name], stats["used_bytes"])
            chunks.add_metric([name, "ready"], stats["chunks"])
            chunks.add_metric([name, "pending"], stats["pending_chunks"])
            evictions.add_metric([name], stats.get("evictions", 0))
            if "evictions_deferred" in stats:
                deferred.add_metric([name], stats["evictions_deferred"])
            if "direct_io" in stats:
                direct.add_metric([], stats["direct_io"])
        yield from (capacity, used, chunks, evictions)
        if deferred.samples:
            yield deferred
        if direct.samples:
            yield direct


class TenantCollector(Collector):
    """Per-tenant CPU-tier bytes and quotas at scrape time. The ``tenant`` label is a configured
    tenant's name or ``other`` (every implicit uid:N / anonymous tenant summed), so its
    cardinality is bounded by the config, not by who connects."""

    def __init__(self, tenants, tier) -> None:  # kvtierd.tenants.TenantTable, tiers.cpu.CpuTier
        self._tenants = tenants
        self._tier = tier

    def collect(self):
        used = GaugeMetricFamily(
            "kvtierd_tenant_used_bytes",
            "CPU-tier bytes a tenant's chunks hold against its quota (pending included)",
            labels=["tenant"],
        )
        quota = GaugeMetricFamily(
            "kvtierd_tenant_quota_bytes",
            "A tenant's CPU-tier quota (other: each implicit tenant's); 0 = only the capacity",
            labels=["tenant"],
        )
        totals = dict.fromkeys(self._tenants.labels(), 0)
        for tenant in list(self._tier.tenant_pages):
            totals[self._tenants.label(tenant)] += (
                self._tier.tenant_used_pages(tenant) * self._tier.page_bytes)
        for label, nbytes in totals.items():
            used.add_metric([label], nbytes)
            name = label if label in self._tenants.configured else ""
            quota.add_metric([label], self._tenants.quota_bytes(name) if name
                             else self._tenants.default_max_bytes)
        yield used
        yield quota


class _Registries(Collector):
    """Several registries scraped as one."""

    def __init__(self, *registries: CollectorRegistry) -> None:
        self._registries = registries

    def collect(self):
        for registry in self._registries:
            yield from registry.collect()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        """Scrapes are not logged (every 15 s per Prometheus)."""


def bearer_app(open_app, full_app, admits: Callable[[str], bool]):
    """A WSGI app serving ``full_app`` to requests whose ``Authorization: Bearer`` token
    ``admits`` (the daemon's constant-time token check), ``open_app`` to every other."""

    def app(environ, start_response):
        scheme, _, token = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        ok = scheme.lower() == "bearer" and admits(token.strip())
        return (full_app if ok else open_app)(environ, start_response)

    return app


class DaemonMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Per-tenant series: served to admin-token scrapes only (module docstring).
        self.tenant_registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvtierd_requests", "Requests answered, by op and status", ["op", "status"], registry=r
        )
        self.latency = Histogram(
            "kvtierd_request_duration_seconds", "Time from request received to reply sent",
            ["op"], buckets=LATENCY_BUCKETS, registry=r,
        )
        # Once per chunk the engine asks about: the LOOKUP answer (kvtierd.server.accounting).
        self.hits = Counter(
            "kvtierd_hits", "LOOKUP keys found, by the tier that holds them", ["tier"], registry=r
        )
        self.misses = Counter(
            "kvtierd_misses", "LOOKUP keys not found, by reason", ["reason"], registry=r
        )
        self.get_results = Counter(
            "kvtierd_get_results", "GET items by result: ok (served) or the status saying why not",
            ["result"], registry=r,
        )
        self.bytes = Counter(
            "kvtierd_bytes", "Payload bytes moved, by direction and tier", ["direction", "tier"],
            registry=r,
        )
        self.integrity_failures = Counter(
            "kvtierd_integrity_failures", "Chunks dropped because a check failed", ["tier"],
            registry=r,
        )
        self.demotions = Counter(
            "kvtierd_demotions", "Chunks written from the CPU tier to a lower tier on eviction",
            registry=r,
        )
        self.promotions = Counter(
            "kvtierd_promotions", "Chunks read from a lower tier back into the CPU tier",
            registry=r,
        )
        self.io_failures = Counter(
            "kvtierd_io_failures", "Tier I/O operations that failed, by tier and errno",
            ["tier", "reason"], registry=r,
        )
        self.io_latency = Histogram(
            "kvtierd_nvme_io_duration_seconds", "NVMe job time (data + fdatasync + index)",
            ["op"], buckets=LATENCY_BUCKETS, registry=r,
        )
        # The tier chain (kvtierd.server.chain): per lower tier, whether it is used now (0 while
        # it says it is unavailable or its circuit is open), how often it became unavailable, and
        # its job latency by op (every tier; the NVMe histogram above predates it).
        self.tier_available = Gauge(
            "kvtierd_tier_available", "1 while a lower tier is used, 0 while it is skipped "
            "(unavailable or circuit open)", ["tier"], registry=r,
        )
        self.tier_unavailable = Counter(
            "kvtierd_tier_unavailable", "Times a lower tier became unavailable (circuit opened)",
            ["tier"], registry=r,
        )
        self.tier_io_latency = Histogram(
            "kvtierd_tier_io_duration_seconds", "Lower-tier job time, by tier and op",
            ["tier", "op"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.evictions_dropped = Counter(
            "kvtierd_evictions_dropped",
            "Chunks evicted from a tier that a tier below was to take but none did (gone from "
            "every tier), by the tier they left and why",
            ["tier", "reason"], registry=r,
        )
        self.quota_rejections = Counter(
            "kvtierd_quota_rejections",
            "Chunks refused QUOTA_EXCEEDED (PUT or promotion), by tenant (configured name or other)",
            ["tenant"], registry=self.tenant_registry,
        )
        self.sessions = Gauge("kvtierd_sessions", "Client sessions alive", registry=r)
        self.sessions_closed = Counter(
            "kvtierd_sessions_closed", "Client sessions ended, by reason", ["reason"], registry=r
        )
        self.handshakes = Counter(
            "kvtierd_handshakes", "Staging handshakes answered, by kind and status",
            ["kind", "status"], registry=r,
        )
        self.connections = Gauge(
            "kvtierd_connections", "Client connections open on the ROUTER socket", registry=r
        )
        self.refused = Counter(
            "kvtierd_refused", "Connections and requests refused by a resource limit or a "
            "missing token, by reason", ["reason"], registry=r,
        )
        self.info = Gauge(
            "kvtierd_info", "Daemon build information", ["version", "protocol"], registry=r
        )
        self._server = None

    def prime(self, tiers: Iterable[str]) -> None:
        """Create, at 0, the labelled series that alerts and dashboards need before any traffic: a
        counter first seen at 1 has no increase() to alert on (the first integrity failure would
        go unnoticed), and a hit ratio without its miss series is empty rather than 1."""
        for tier in tiers:
            self.hits.labels(tier)
            self.integrity_failures.labels(tier)
            for direction in ("in", "out"):
                self.bytes.labels(direction, tier)
        self.misses.labels("miss")
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason)
        for result in ("ok", "miss"):
            self.get_results.labels(result)

    def add_tenants(self, tenants, tier) -> None:
        self.tenant_registry.register(TenantCollector(tenants, tier))
        for label in tenants.labels():
            self.quota_rejections.labels(label)  # primed at 0: alerts need a series to increase

    def add_tiers(self, tiers: Callable[[], Iterable[tuple[str, dict[str, int]]]]) -> None:
        self.registry.register(TierCollector(tiers))

    def serve(self, addr: str, admits: Callable[[str], bool] = lambda token: False,
              expose_tenants: bool = False) -> tuple[str, int] | None:
        """Start the /metrics HTTP exporter on ``host:port``; return the bound address. Scrapes
        with a bearer token that ``admits`` (or every scrape, ``expose_tenants``) also get the
        per-tenant series."""
        if addr == "off":
            return None
        host, _, port = addr.rpartition(":")
        host = host.strip("[]")
        full = make_wsgi_app(_Registries(self.registry, self.tenant_registry))
        app = full if expose_tenants else bearer_app(make_wsgi_app(self.registry), full,
                                                     admits)
        server_class = ThreadingWSGIServer  # daemon threads: a stuck scrape never holds exit
        if ":" in host:  # an IPv6 literal
            server_class = type("_Server6", (ThreadingWSGIServer,),
                                {"address_family": socket.AF_INET6})
        self._server = make_server(host, int(port), app, server_class, handler_class=_QuietHandler)
        threading.Thread(target=self._server.serve_forever, name="kvtierd-metrics",
                         daemon=True).start()
        bound = self._server.server_address[:2]
        log.info("metrics at http://%s:%d/metrics", bound[0], bound[1])
        return bound[0], bound[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
