"""A raw session whose staging is a CUDA IPC handle (the CPU stand-in's in CI): one place that
knows how a ``cuda_ipc`` session starts (handshake ticket, then HELLO), for the control-path
tests, the GPU tests and their child scripts."""

from __future__ import annotations

from helpers.handshake import ticket
from helpers.raw import RawClient

from kvtierd.protocol import Op


def cuda_ipc_spec(handle: bytes, nbytes: int, device: int = 0, pci_bus_id: str | None = None
                  ) -> dict:
    spec = {"kind": "cuda_ipc", "handle": handle, "nbytes": nbytes, "device": device}
    if pci_bus_id:
        spec["pci_bus_id"] = pci_bus_id
    return spec


def cuda_ipc_hello(address: str, spec: dict, namespace: str = "standin") -> tuple[RawClient, dict]:
    """A raw client that took a ``cuda_ipc`` handshake ticket for ``spec``'s nbytes and sent HELLO
    with ``spec``; its reply (OK or the refusal)."""
    staging = {**spec, "ticket": ticket(address, "cuda_ipc", spec["nbytes"])}
    raw = RawClient(address)
    reply, _ = raw.request(Op.HELLO, namespace=namespace, rank=0, world_size=1, fingerprint="fp-standin",
                           staging=staging)
    return raw, reply
