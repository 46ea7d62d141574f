"""Shared pieces of the bad-input tests: raw sessions over memfd staging (``helpers.handshake``),
and a *bystander* session whose chunk must survive every bad input byte-exact."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack
from helpers.daemon import DaemonProcess
from helpers.handshake import MemfdBuffer, inline_staging
from helpers.raw import RawClient

from kvtierd.protocol import Op, Status

SHM = Path("/dev/shm")
POISON = 0xEE
SENTINEL = 0x5A


class Session:
    """A raw client that said HELLO (memfd staging handed over by the handshake if given, else
    inline with our credentials: an inline handshake's ticket)."""

    def __init__(self, address: str, namespace: str, *, staging: MemfdBuffer | None = None,
                 fingerprint: str = "fp-a", rank: int = 0, timeout_s: float = 10.0,
                 **extra: Any) -> None:
        self.raw = RawClient(address, timeout_s=timeout_s)
        self.staging = staging
        spec = (staging.hello_staging(address) if staging is not None
                else inline_staging(address))
        extra.setdefault("world_size", rank + 1)
        reply, _ = self.raw.request(Op.HELLO, namespace=namespace, rank=rank,
                                    fingerprint=fingerprint, staging=spec, **extra)
        assert reply["name"] == "OK", reply
        self.hello = reply

    def request(self, op: Op | int, frames: list[bytes] | None = None, **fields: Any):
        return self.raw.request(op, frames, **fields)

    def put(self, items: list, frames: list[bytes] | None = None) -> dict:
        reply, payload = self.raw.request(Op.PUT, frames, items=items)
        assert reply["name"] == "OK", reply
        assert payload == []
        assert len(reply["results"]) == len(items), reply
        return reply

    def get(self, items: list) -> tuple[dict, list[bytes]]:
        reply, payload = self.raw.request(Op.GET, items=items)
        assert reply["name"] == "OK", reply
        assert len(reply["results"]) == len(items), reply
        return reply, payload

    def lookup(self, keys: list[bytes]) -> list[int]:
        reply, _ = self.raw.request(Op.LOOKUP, keys=keys)
        assert reply["name"] == "OK", reply
        return reply["tiers"]

    def close(self) -> None:
        self.raw.close()


def names(results: list[int]) -> list[str]:
    return [Status(r).name for r in results]


def item_errors(reply: dict) -> dict[int, tuple[str, str]]:
    return {i: (name, message) for i, name, message in reply["errors"]}


def namespace() -> str:
    return f"ns-{secrets.token_hex(6)}"


def send_raw(raw: RawClient, frames: list[bytes]) -> dict:
    raw.send_frames(frames)
    reply, payload = raw.recv()
    assert payload == []
    return reply


@contextlib.contextmanager
def bystander(daemon: DaemonProcess, memfd: Callable[..., MemfdBuffer], **hello: Any
              ) -> Iterator[None]:
    """A well-behaved session stores a random chunk before the block and reloads it after."""
    buf = memfd(256 * 1024)
    s = Session(daemon.address, f"bystander-{secrets.token_hex(6)}", staging=buf, **hello)
    try:
        data = os.urandom(150_000)  # three 64 KiB pages, the last one partly used
        buf.write(0, data)
        assert names(s.put([[b"bystander-chunk", 0, len(data)]])["results"]) == ["OK"]
        before = daemon.cpu()
        yield
        assert daemon.alive(), f"the daemon died:\n{daemon.log()}"
        buf.fill(POISON)
        reply, _ = s.get([[b"bystander-chunk", 4096, len(data)]])
        assert names(reply["results"]) == ["OK"], reply
        assert buf.read(4096, len(data)) == data, "bystander chunk altered"
        assert buf.read(0, 4096) == bytes([POISON]) * 4096
        assert buf.read(4096 + len(data), 4096) == bytes([POISON]) * 4096
        after = daemon.cpu()
        assert after["chunks"] >= before["chunks"], (before, after)
        assert after.get("evictions", 0) == before.get("evictions", 0), (before, after)
        assert after.get("deletes", 0) == before.get("deletes", 0), (before, after)
        assert after["pending_chunks"] == 0, after
        daemon.check()
    finally:
        s.close()


def start_daemon(root: Path, name: str, *flags: str, **kwargs: Any) -> DaemonProcess:
    """A bad-input test daemon. It allows the anonymous tenant: its HELLOs test the fields, most
    of them refused before the staging is looked at, and a ticket per refused HELLO would pile
    up against the per-uid ticket cap (tests/integration/test_trust_boundary.py tests the
    default, which refuses anonymous sessions on ipc)."""
    proc = DaemonProcess(root / name, ["--anonymous-tenant", "allow", *flags], **kwargs)
    proc.start()
    return proc


def write_toml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def stop_tolerating_traceback(d: DaemonProcess) -> None:
    """stop_and_verify for a daemon whose log holds the traceback a test is about; still strict
    about the exit code and the arena. Leaves nothing behind if the daemon already died."""
    assert d.proc is not None
    if d.proc.poll() is None:
        d.check()
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(timeout=20)
        assert code == 0, f"kvtierd exited with {code}:\n{d.log()}"
        assert not (SHM / d.arena_name).exists(), "arena left in /dev/shm"
    else:
        (SHM / d.arena_name).unlink(missing_ok=True)  # a crashed daemon cannot clean up


LIMITS_TOML = """\
max_header_bytes = 4096
max_inline_bytes = 65536
max_batch = 16
"""


def packed(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)
