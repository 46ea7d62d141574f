"""What a PUT (or a promotion) is told when the CPU tier refuses to reserve a chunk."""

from __future__ import annotations

from typing import Any

from kvtierd.metrics import DaemonMetrics
from kvtierd.protocol import Status
from kvtierd.tenants import TenantTable


def reserve_message(tier: Any, tenants: TenantTable, metrics: DaemonMetrics, status: Status,
                    nbytes: int, tenant: str) -> str:
    """The message for refusal ``status`` of ``nbytes`` for ``tenant`` ("" for EXISTS, a
    successful no-op). A quota refusal is also counted (``kvtierd_quota_rejections_total``)."""
    if status is Status.QUOTA_EXCEEDED:
        metrics.quota_rejections.labels(tenants.label(tenant)).inc()
        page = tier.page_bytes
        return (
            f"tenant {tenant} is over its quota: {tier.tenant_used_pages(tenant) * page}"
            f" of {tier.quota_pages(tenant) * page} bytes used, {nbytes} more asked, and"
            " its own chunks that could be evicted do not make enough room"
        )
    if status is Status.NO_SPACE:
        return (
            f"no room for {nbytes} bytes: the CPU tier is full of chunks that are pending, "
            "leased or being read"
        )
    if status is Status.TOO_LARGE:
        return f"chunk of {nbytes} bytes is larger than the CPU tier ({tier.capacity_bytes})"
    if status is Status.LAYOUT_MISMATCH:
        return "key is stored with another layout fingerprint; the stored chunk is kept"
    if status is Status.SIZE_MISMATCH:
        return "key is stored with another size by the same layout; the stored chunk is kept"
    if status is Status.BUSY:
        return "a PUT of this key is already in flight"
    return ""  # EXISTS: a successful no-op, no message
