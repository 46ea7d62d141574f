"""Issue 9, staging that cannot be yanked or spoofed: the attacks on protocol 1's named /dev/shm
staging, replayed against the memfd handshake (protocol 2, and 3's daemon-applied seals; issue 33's
attacks are in test_trust_boundary.py). Every refusal is BAD_HANDLE (or the
envelope's own status) naming why; the daemon stays alive, CHECK clean, a bystander's chunk
byte-exact, and no descriptor a client sent stays open in the daemon."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import secrets
import socket
import time
from pathlib import Path

import msgpack
import pytest
from helpers.bad_input import bystander, names, namespace, packed, send_raw
from helpers.daemon import DaemonProcess
from helpers.handshake import (
    F_SEAL_FUTURE_WRITE,
    F_SEAL_WRITE,
    SEALED,
    MemfdBuffer,
    handshake,
    handshake_path,
    send_handshake,
    ticket,
)
from helpers.raw import RawClient
from helpers.wait import wait_for

from kvtier_client.handshake import connect

from kvtierd.protocol import PROTOCOL_VERSION, Op, Status

pytestmark = pytest.mark.timeout(90)

MiB = 1024**2
SHRINK, GROW, SEAL = 0x2, 0x4, 0x1
KEEP_SIZE, PUNCH_HOLE = 0x1, 0x2  # FALLOC_FL_*
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)


def daemon_fds(d: DaemonProcess) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def daemon_memfd_maps(d: DaemonProcess) -> list[str]:
    maps = Path(f"/proc/{d.proc.pid}/maps").read_text().splitlines()
    return [line for line in maps if "memfd:kvtier-test-staging" in line]


def hello(raw: RawClient, staging: dict) -> dict:
    reply, _ = raw.request(Op.HELLO, namespace=namespace(), rank=0, world_size=1, fingerprint="fp",
                           staging=staging)
    return reply


# -- truncation ------------------------------------------------------------------------------------
def test_truncating_sealed_staging_fails_and_48mib_put_get_stay_byte_exact(daemon_factory):
    d = daemon_factory(cpu_bytes="128MiB")
    chunk, count = 4 * MiB, 12  # 48 MiB per batch: copied on the daemon's copy threads
    region = chunk * count
    buf = MemfdBuffer(2 * region)
    raw = RawClient(d.address)
    try:
        assert hello(raw, buf.hello_staging(d.address))["name"] == "OK"
        data = os.urandom(region)
        buf.write(0, data)
        keys = [b"big-%d" % i for i in range(count)]
        for size in (0, region, 2 * region + 4096):  # shrink, shrink, grow: all refused
            with pytest.raises(PermissionError):
                os.ftruncate(buf.fd, size)
        reply, _ = raw.request(Op.PUT, items=[[k, i * chunk, chunk] for i, k in enumerate(keys)])
        assert names(reply["results"]) == ["OK"] * count, reply
        with pytest.raises(PermissionError):  # again, with the daemon's copies done
            os.ftruncate(buf.fd, 4096)
        buf.fill(0xEE, region)
        reply, _ = raw.request(Op.GET, items=[[k, region + i * chunk, chunk]
                                              for i, k in enumerate(keys)])
        assert names(reply["results"]) == ["OK"] * count, reply
        assert buf.read(region, region) == data, "a 48 MiB GET is not byte-exact"
        assert d.alive()
        d.check()
    finally:
        raw.close()
        buf.close()


# -- memfds the daemon must not map ----------------------------------------------------------------
def _bad_fd_case(case: str, d: DaemonProcess, tmp_path: Path, opened: list):
    """(message, fds, fragments of the refusal) for one untrustworthy staging descriptor."""
    def memfd(nbytes: int = 64 * 1024, **options) -> MemfdBuffer:
        buf = MemfdBuffer(nbytes, **options)
        opened.append(buf)
        return buf

    def fd_of(path: Path) -> int:
        fd = os.open(path, os.O_RDWR)
        opened.append(fd)
        return fd

    def msg(nbytes: int, kind: str = "memfd") -> dict:
        return {"v": PROTOCOL_VERSION, "kind": kind, "nbytes": nbytes}

    if case == "unsealed-memfd":
        return msg(65536), [memfd(seals=0).fd], ["seals are none", "F_SEAL_SHRINK and F_SEAL_GROW"]
    if case == "sealed-without-grow":
        return msg(65536), [memfd(seals=SHRINK | SEAL).fd], [
            "F_SEAL_SEAL|F_SEAL_SHRINK;", "required: F_SEAL_SHRINK and F_SEAL_GROW"]
    if case == "sealed-without-shrink":
        return msg(65536), [memfd(seals=GROW | SEAL).fd], [
            "F_SEAL_SEAL|F_SEAL_GROW;", "required"]
    if case == "write-sealed":
        return msg(65536), [memfd(seals=SEALED | F_SEAL_WRITE).fd], [
            "F_SEAL_WRITE", "not allowed (GET writes into the buffer)"]
    if case == "future-write-sealed":
        return msg(65536), [memfd(seals=SEALED | F_SEAL_FUTURE_WRITE).fd], [
            "F_SEAL_FUTURE_WRITE", "not allowed"]
    if case == "sparse-256mib":  # ftruncate only: no page allocated
        return msg(256 * MiB), [memfd(256 * MiB, allocate=False).fd], [
            "has holes (first at byte 0, 0 of 268435456 bytes allocated)"]
    if case == "fallocated-never-written":  # Linux reports those pages as holes
        buf = memfd(64 * 1024, allocate=False, seals=0)
        os.posix_fallocate(buf.fd, 0, 64 * 1024)
        os.pwrite(buf.fd, b"x" * 4096, 0)
        fcntl.fcntl(buf.fd, fcntl.F_ADD_SEALS, SEALED)
        return msg(65536), [buf.fd], ["has holes (first at byte 4096"]
    if case == "dev-shm-file":
        path = Path("/dev/shm") / f"kvtier-test-hs-{secrets.token_hex(6)}"
        path.write_bytes(os.urandom(65536))
        opened.append(path)
        return msg(65536), [fd_of(path)], ["seals are F_SEAL_SEAL;", "a /dev/shm file"]
    if case == "hard-link-to-arena":
        link = Path("/dev/shm") / f"kvtier-test-arena-link-{secrets.token_hex(6)}"
        os.link(Path("/dev/shm") / d.arena_name, link)
        opened.append(link)
        return msg(64 * MiB), [fd_of(link)], ["the daemon's own arena"]
    if case == "regular-file":
        path = tmp_path / "staging.bin"
        path.write_bytes(os.urandom(65536))
        return msg(65536), [fd_of(path)], ["cannot carry seals", "not a memfd"]
    if case == "pipe":
        r, w = os.pipe()
        opened.extend([r, w])
        return msg(65536), [r], ["staging fd is a pipe, not a memfd"]
    if case == "two-fds":
        return msg(65536), [memfd().fd, memfd().fd], ["carries more than 1 file descriptor",
                                                      "exactly one memfd for kind memfd"]
    if case == "many-fds":
        return msg(65536), [memfd().fd for _ in range(8)], ["carries more than 1 file descriptor"]
    if case == "no-fd":
        return msg(65536), [], ["kind 'memfd' carries 0 file descriptor(s); allowed: exactly 1"]
    if case == "fd-with-inline":
        return msg(0, "inline"), [memfd().fd], ["kind 'inline' carries 1", "exactly 0"]
    if case == "fd-with-cuda-ipc":
        return msg(65536, "cuda_ipc"), [memfd().fd], ["kind 'cuda_ipc' carries 1"]
    if case == "nbytes-larger":
        return msg(131072), [memfd().fd], ["has 65536 bytes, the handshake announced 131072"]
    if case == "nbytes-smaller":
        return msg(4096), [memfd().fd], ["has 65536 bytes, the handshake announced 4096"]
    if case == "nbytes-zero":
        return msg(0), [memfd().fd], ["staging nbytes 0 must be an int in 1.."]
    if case == "nbytes-huge":
        return msg(2**62), [memfd().fd], [f"staging nbytes {2**62} must be an int in 1.."]
    if case == "nbytes-str":
        return {**msg(0), "nbytes": "65536"}, [memfd().fd], ["staging nbytes '65536'"]
    if case == "unknown-kind":
        return msg(65536, "shm"), [memfd().fd], ["handshake kind 'shm' is unknown", "memfd"]
    raise AssertionError(case)


BAD_FD_CASES = [
    "unsealed-memfd", "sealed-without-grow", "sealed-without-shrink", "write-sealed",
    "future-write-sealed", "sparse-256mib", "fallocated-never-written", "dev-shm-file",
    "hard-link-to-arena", "regular-file", "pipe", "two-fds", "many-fds", "no-fd",
    "fd-with-inline", "fd-with-cuda-ipc", "nbytes-larger", "nbytes-smaller", "nbytes-zero",
    "nbytes-huge", "nbytes-str", "unknown-kind",
]


@pytest.mark.parametrize("case", BAD_FD_CASES)
def test_untrustworthy_staging_fd_is_refused(shared, memfd, tmp_path, case):
    opened: list = []
    try:
        with bystander(shared, memfd):
            fds_before, maps_before = daemon_fds(shared), daemon_memfd_maps(shared)
            tickets_before = shared.stats()["handshake"]["tickets"]
            message, fds, fragments = _bad_fd_case(case, shared, tmp_path, opened)
            answer = send_handshake(handshake_path(shared.address), message, fds)
            assert answer["name"] == "BAD_HANDLE", answer
            assert answer["ticket"] == b"" and answer["status"] == Status.BAD_HANDLE
            for fragment in fragments:
                assert fragment in answer["message"], (fragment, answer)
            assert shared.stats()["handshake"]["tickets"] <= tickets_before
            wait_for(lambda: daemon_fds(shared) <= fds_before, 5,
                     "the daemon closing every descriptor of a refused handshake")
            new_maps = set(daemon_memfd_maps(shared)) - set(maps_before)
            assert not new_maps, f"a refused memfd was mapped: {new_maps}"
    finally:
        for item in opened:
            if isinstance(item, int):
                os.close(item)
            elif isinstance(item, Path):
                item.unlink(missing_ok=True)
            else:
                item.close()


def test_hello_v1_with_shm_staging_is_unsupported_version_naming_the_current_one(shared, memfd):
    with bystander(shared, memfd):
        raw = RawClient(shared.address)
        try:
            header = {"v": 1, "op": int(Op.HELLO), "id": 7, "namespace": "old", "rank": 0,
                      "fingerprint": "fp", "staging": {"kind": "shm", "name": "kvtier-stg-x",
                                                       "nbytes": 4096}}
            reply = send_raw(raw, [packed(header)])
            assert reply["name"] == "UNSUPPORTED_VERSION" and reply["id"] == 7, reply
            assert "protocol version 1 is not supported" in reply["message"], reply
            assert f"this daemon speaks {PROTOCOL_VERSION}" in reply["message"], reply
            assert raw.request(Op.LOOKUP, keys=[b"k"])[0]["name"] == "NO_SESSION"
            answer = handshake(handshake_path(shared.address), "inline")
            assert answer["name"] == "OK"  # a current handshake on the same daemon still works
            answer = send_handshake(handshake_path(shared.address),
                                    {"v": 1, "kind": "inline", "nbytes": 0})
            assert answer["name"] == "UNSUPPORTED_VERSION", answer
            assert f"this daemon speaks {PROTOCOL_VERSION}" in answer["message"]
        finally:
            raw.close()


# -- tickets ---------------------------------------------------------------------------------------
def test_ticket_is_one_time(shared, memfd):
    with bystander(shared, memfd):
        buf = memfd(64 * 1024)
        staging = buf.hello_staging(shared.address)
        first, second = RawClient(shared.address), RawClient(shared.address)
        try:
            assert hello(first, staging)["name"] == "OK"
            reply = hello(second, staging)
            assert reply["name"] == "BAD_HANDLE" and "ticket is unknown" in reply["message"]
            assert second.request(Op.LOOKUP, keys=[b"k"])[0]["name"] == "NO_SESSION"
            assert first.request(Op.LOOKUP, keys=[b"k"])[0]["name"] == "OK"
        finally:
            first.close()
            second.close()


def test_ticket_expires_and_its_mapping_is_closed(daemon_factory, memfd):
    d = daemon_factory(env={"KVTIERD_TICKET_TIMEOUT_S": "1"})
    buf = memfd(64 * 1024)
    staging = buf.hello_staging(d.address)
    assert len(daemon_memfd_maps(d)) == 1, "the handshake maps the verified memfd"
    assert d.stats()["handshake"]["tickets"] == 1
    wait_for(lambda: d.stats()["handshake"]["tickets"] == 0, 10, "the ticket expiring")
    assert daemon_memfd_maps(d) == [], "an expired ticket's mapping stayed"
    raw = RawClient(d.address)
    try:
        reply = hello(raw, staging)
        assert reply["name"] == "BAD_HANDLE" and "unknown" in reply["message"], reply
        # a new handshake works (with a new buffer: the daemon sealed the first one for good)
        assert hello(raw, memfd(64 * 1024).hello_staging(d.address))["name"] == "OK"
    finally:
        raw.close()
    d.check()


def test_ticket_of_another_kind_and_unknown_tickets_are_refused(shared, memfd):
    with bystander(shared, memfd):
        raw = RawClient(shared.address)
        try:
            tickets_before = shared.stats()["handshake"]["tickets"]
            cuda = ticket(shared.address, "cuda_ipc", 65536)
            reply = hello(raw, {"kind": "memfd", "ticket": cuda})
            assert reply["name"] == "BAD_HANDLE", reply
            assert "issued for kind 'cuda_ipc'" in reply["message"], reply
            # consumed by the failed attempt: its own kind cannot use it any more either
            reply = hello(raw, {"kind": "cuda_ipc", "ticket": cuda, "handle": b"\0" * 64,
                                "nbytes": 65536, "device": 0})
            assert reply["name"] == "BAD_HANDLE" and "unknown" in reply["message"], reply
            reply = hello(raw, {"kind": "memfd", "ticket": secrets.token_bytes(16)})
            assert reply["name"] == "BAD_HANDLE" and "unknown" in reply["message"], reply
            assert shared.stats()["handshake"]["tickets"] <= tickets_before
        finally:
            raw.close()


# -- handshake garbage -----------------------------------------------------------------------------
@pytest.mark.parametrize("data,status,fragment", [
    (b"\xc1not msgpack", "BAD_MESSAGE", "not valid msgpack"),
    (packed([1, 2, 3]), "BAD_MESSAGE", "must be a msgpack map, got list"),
    (b"hello", "BAD_MESSAGE", "must be a msgpack map, got int"),  # 'h' is a msgpack int
    (packed({"v": PROTOCOL_VERSION, "kind": "inline", "pad": "x" * 8000}), "TOO_LARGE",
     "over 4096 bytes"),
], ids=["reserved-byte", "list", "text", "oversized"])
def test_handshake_garbage_is_answered_and_closed(shared, memfd, data, status, fragment):
    with bystander(shared, memfd):
        before = _handshake_count(shared, "invalid", status)
        answer = send_handshake(handshake_path(shared.address), data)
        assert answer["name"] == status and fragment in answer["message"], answer
        assert handshake(handshake_path(shared.address), "inline")["name"] == "OK"
        assert _handshake_count(shared, "invalid", status) == before + 1


def _handshake_count(d: DaemonProcess, kind: str, status: str) -> float:
    wanted = f'kvtierd_handshakes_total{{kind="{kind}",status="{status}"}} '
    lines = [line for line in d.metrics_text().splitlines() if line.startswith(wanted)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_huge_handshake_stream_is_cut_off(shared, memfd):
    with bystander(shared, memfd):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            connect(sock, handshake_path(shared.address), 10)
            with pytest.raises((BrokenPipeError, ConnectionResetError)):
                for _ in range(64):  # 64 MiB: far more than any socket buffer
                    sock.sendall(b"\x00" * MiB)
        assert handshake(handshake_path(shared.address), "inline")["name"] == "OK"


def test_silent_handshakes_block_nobody_and_are_closed(shared, memfd):
    with bystander(shared, memfd):
        path = handshake_path(shared.address)
        silent = []
        try:
            for _ in range(20):  # more than the 16 handshakes one user may hold open at once
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                connect(sock, path, 10)
                silent.append(sock)
            busy = msgpack.unpackb(silent[-1].recv(4096), raw=False)
            assert busy["name"] == "BUSY" and "limit per user is 16" in busy["message"], busy
            # the request loop is not blocked meanwhile
            raw = RawClient(shared.address, timeout_s=2)
            try:
                assert raw.request(Op.PING)[0]["name"] == "OK"
            finally:
                raw.close()
            started = time.monotonic()
            first = msgpack.unpackb(silent[0].recv(4096), raw=False)  # closed at its deadline
            assert first["name"] == "BAD_MESSAGE", first
            assert "no complete handshake within 2 s" in first["message"], first
            assert time.monotonic() - started < 8
            buf = memfd(64 * 1024)
            raw = RawClient(shared.address)
            try:
                assert hello(raw, buf.hello_staging(shared.address))["name"] == "OK"
            finally:
                raw.close()
        finally:
            for sock in silent:
                sock.close()


def test_one_silent_handshake_does_not_delay_another(shared, memfd):
    with bystander(shared, memfd):
        path = handshake_path(shared.address)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as quiet:
            quiet.connect(path)
            quiet.send(b"\x83")  # the start of a 3-entry map, and then nothing
            buf = memfd(64 * 1024)
            raw = RawClient(shared.address, timeout_s=5)
            try:
                assert hello(raw, buf.hello_staging(shared.address))["name"] == "OK"
                buf.write(0, data := os.urandom(8192))
                reply, _ = raw.request(Op.PUT, items=[[b"k", 0, 8192]])
                assert names(reply["results"]) == ["OK"]
                buf.fill(0xEE)
                reply, _ = raw.request(Op.GET, items=[[b"k", 4096, 8192]])
                assert names(reply["results"]) == ["OK"] and buf.read(4096, 8192) == data
            finally:
                raw.close()


def test_hole_punched_after_the_handshake_is_refused_by_the_daemons_seal(daemon_factory):
    # Seals against shrinking and growing do not stop FALLOC_FL_PUNCH_HOLE; the daemon's own
    # F_SEAL_FUTURE_WRITE, added once it has mapped the buffer, does (before protocol 3 the
    # daemon's next touch of punched pages allocated them, charged to the daemon's cgroup:
    # test_trust_boundary has the cgroup). Both mappings stay writable.
    d = daemon_factory()
    buf = MemfdBuffer(4 * MiB)
    raw = RawClient(d.address)
    try:
        assert hello(raw, buf.hello_staging(d.address))["name"] == "OK"
        data = os.urandom(MiB)
        buf.write(0, data)
        reply, _ = raw.request(Op.PUT, items=[[b"before", 0, MiB]])
        assert names(reply["results"]) == ["OK"]
        assert _libc.fallocate(buf.fd, PUNCH_HOLE | KEEP_SIZE, 0, 4 * MiB) == -1, "punch hole"
        assert ctypes.get_errno() == errno.EPERM
        assert os.lseek(buf.fd, 0, os.SEEK_HOLE) == 4 * MiB
        with pytest.raises(PermissionError):  # no new writable mapping, no write(2)
            os.pwrite(buf.fd, b"x", 0)
        buf.write(MiB, data[::-1])  # the client's own mapping still writes
        reply, _ = raw.request(Op.PUT, items=[[b"after", MiB, MiB]])
        assert names(reply["results"]) == ["OK"]
        reply, _ = raw.request(Op.GET, items=[[b"before", 2 * MiB, MiB], [b"after", 0, MiB]])
        assert names(reply["results"]) == ["OK", "OK"]
        assert buf.read(2 * MiB, MiB) == data and buf.read(0, MiB) == data[::-1]
        assert d.alive()
        d.check()
    finally:
        raw.close()
        buf.close()
