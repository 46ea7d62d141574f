"""Bad input from a client: every case gets a clear answer and hurts nobody else.

Each case checks four things: the daemon answers with the right status (for the whole request or per
item) and a message that names the offending value or limit; nothing is copied outside the client's
registered staging range; a *bystander* session that stored a random chunk before the bad input
still loads it byte-exact afterwards (into a poisoned buffer); and the daemon's invariant check
passes.

Most cases share one module-scoped daemon (each uses its own namespace); cases that need other
limits, auth, or that may crash the daemon start their own.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import random
import secrets
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack
import pytest
from helpers.daemon import DaemonProcess
from helpers.raw import RawClient

from kvtierd.protocol import MAX_KEY_BYTES, PROTOCOL_VERSION, Op, Status, Tier

pytestmark = pytest.mark.timeout(60)

SHM = Path("/dev/shm")
POISON = 0xEE
SENTINEL = 0x5A


# -- helpers -------------------------------------------------------------------------------------
class ShmBuffer:
    """A client staging file in /dev/shm, mapped here; ``slack`` bytes past the announced size."""

    def __init__(self, nbytes: int, slack: int = 0, fill: int = 0) -> None:
        self.name = f"kvtier-stg-test-{secrets.token_hex(8)}"
        self.path = SHM / self.name
        self.nbytes = nbytes
        self.size = nbytes + slack
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.size)
            self.mm = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        if fill:
            self.fill(fill)

    def handle(self, nbytes: int | None = None) -> dict:
        size = self.nbytes if nbytes is None else nbytes
        return {"kind": "shm", "name": self.name, "nbytes": size}

    def fill(self, byte: int, start: int = 0, end: int | None = None) -> None:
        end = self.size if end is None else end
        self.mm[start:end] = bytes([byte]) * (end - start)

    def write(self, offset: int, data: bytes) -> None:
        self.mm[offset : offset + len(data)] = data

    def read(self, offset: int, nbytes: int) -> bytes:
        return bytes(self.mm[offset : offset + nbytes])

    def close(self) -> None:
        if not self.mm.closed:
            self.mm.close()
        self.path.unlink(missing_ok=True)


@pytest.fixture
def shm() -> Iterator[Callable[..., ShmBuffer]]:
    """Factory of staging buffers; every file is unmapped and removed at teardown."""
    made: list[ShmBuffer] = []

    def make(nbytes: int, slack: int = 0, fill: int = 0) -> ShmBuffer:
        buf = ShmBuffer(nbytes, slack, fill)
        made.append(buf)
        return buf

    yield make
    for buf in made:
        buf.close()


class Session:
    """A raw client that said HELLO (shm staging if given, else inline)."""

    def __init__(self, address: str, namespace: str, *, staging: ShmBuffer | None = None,
                 fingerprint: str = "fp-a", rank: int = 0, timeout_s: float = 10.0,
                 **extra: Any) -> None:
        self.raw = RawClient(address, timeout_s=timeout_s)
        self.staging = staging
        spec = staging.handle() if staging is not None else {"kind": "inline"}
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


@pytest.fixture
def sessions() -> Iterator[Callable[..., Session]]:
    made: list[Session] = []

    def make(*args: Any, **kwargs: Any) -> Session:
        s = Session(*args, **kwargs)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


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
def bystander(daemon: DaemonProcess, shm: Callable[..., ShmBuffer], **hello: Any) -> Iterator[None]:
    """A well-behaved session stores a random chunk before the block and reloads it after."""
    buf = shm(256 * 1024)
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
    proc = DaemonProcess(root / name, list(flags), **kwargs)
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


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Iterator[DaemonProcess]:
    """One daemon (64 MiB tier, 64 KiB pages, default limits) for the cases that cannot hurt it."""
    d = start_daemon(tmp_path_factory.mktemp("bad-input"), "shared")
    yield d
    d.stop_and_verify()


@pytest.fixture(scope="module")
def limited(tmp_path_factory) -> Iterator[DaemonProcess]:
    """A daemon with small header, inline and batch limits from a TOML config file."""
    root = tmp_path_factory.mktemp("bad-input-limits")
    config = write_toml(root / "limits.toml", LIMITS_TOML)
    d = start_daemon(root, "limited", "--config", str(config))
    yield d
    d.stop_and_verify()


# -- envelope --------------------------------------------------------------------------------------
def _packed(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


MALFORMED = {
    # name: (frame, reply id, fragment of the message)
    "random-bytes-1": (random.Random(1).randbytes(64), None, "not valid msgpack"),
    "random-bytes-2": (random.Random(2).randbytes(300), None, "not valid msgpack"),
    "reserved-byte": (b"\xc1", None, "not valid msgpack"),
    "truncated-map": (_packed({"v": 1, "op": 2, "id": 5})[:-1], None, "not valid msgpack"),
    "huge-array-length": (b"\xdd\xff\xff\xff\xff", None, "not valid msgpack"),
    "trailing-garbage": (_packed({"v": 1, "op": 2, "id": 5}) + b"\x00", None, "not valid msgpack"),
    "list-not-map": (_packed([1, 2, 5]), None, "must be a msgpack map, got list"),
    "int-not-map": (_packed(7), None, "must be a msgpack map, got int"),
    "int-map-keys": (_packed({1: 1, 2: 2}), None, "not valid msgpack"),
    "missing-id": (_packed({"v": PROTOCOL_VERSION, "op": int(Op.PING)}), None,
                   "request id None is not an int"),
    "id-is-str": (_packed({"v": PROTOCOL_VERSION, "op": int(Op.PING), "id": "7"}), "7",
                  "request id '7' is not an int"),
    "id-is-float": (_packed({"v": PROTOCOL_VERSION, "op": int(Op.PING), "id": 1.5}), 1.5,
                    "request id 1.5 is not an int"),
    "id-is-bool": (_packed({"v": PROTOCOL_VERSION, "op": int(Op.PING), "id": True}), True,
                   "request id True is not an int"),
    "id-is-list": (_packed({"v": PROTOCOL_VERSION, "op": int(Op.PING), "id": [1]}), [1],
                   "request id [1] is not an int"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_header_is_bad_message(shared, shm, case):
    frame, reply_id, fragment = MALFORMED[case]
    with bystander(shared, shm):
        raw = RawClient(shared.address)
        try:
            reply = send_raw(raw, [frame])
            assert reply["name"] == "BAD_MESSAGE" and reply["status"] == Status.BAD_MESSAGE
            assert reply["id"] == reply_id, reply
            assert fragment in reply["message"], reply
            assert reply["v"] == PROTOCOL_VERSION
            # the same peer is still served
            assert raw.request(Op.PING)[0]["name"] == "OK"
        finally:
            raw.close()


@pytest.mark.parametrize("op", [99, 0, -1, "PUT", 2**40])
def test_unknown_op(shared, shm, op):
    with bystander(shared, shm):
        raw = RawClient(shared.address)
        try:
            reply = send_raw(raw, [_packed({"v": PROTOCOL_VERSION, "op": op, "id": 12})])
            assert reply["name"] == "UNKNOWN_OP" and reply["id"] == 12, reply
            assert f"op {op!r} is unknown" in reply["message"], reply
            assert "1 (HELLO)" in reply["message"] and "9 (CHECK)" in reply["message"]
        finally:
            raw.close()


@pytest.mark.parametrize("version", [2, 0, "1", None, "missing"])
def test_unsupported_protocol_version(shared, shm, version):
    header = {"op": int(Op.PING), "id": 41}
    if version != "missing":
        header["v"] = version
    with bystander(shared, shm):
        raw = RawClient(shared.address)
        try:
            reply = send_raw(raw, [_packed(header)])
            assert reply["name"] == "UNSUPPORTED_VERSION", reply
            assert reply["id"] == 41
            shown = None if version == "missing" else version
            assert f"protocol version {shown!r} is not supported" in reply["message"], reply
            assert f"this daemon speaks {PROTOCOL_VERSION}" in reply["message"], reply
        finally:
            raw.close()


@pytest.mark.parametrize("op,fields", [
    (Op.LOOKUP, {"keys": [b"k"]}),
    (Op.PUT, {"items": [[b"k", 0, 4096]]}),
    (Op.GET, {"items": [[b"k", 0, 4096]]}),
    (Op.DELETE, {"keys": [b"bystander-chunk"]}),
    (Op.BYE, {}),
], ids=["LOOKUP", "PUT", "GET", "DELETE", "BYE"])
def test_ops_before_hello_need_a_session(shared, shm, op, fields):
    with bystander(shared, shm):
        raw = RawClient(shared.address)
        try:
            frames = [b"x" * 4096] if op is Op.PUT else None
            reply, payload = raw.request(op, frames, **fields)
            assert reply["name"] == "NO_SESSION", reply
            assert op.name in reply["message"] and "HELLO" in reply["message"], reply
            assert payload == []
            # ops that need no session still work for the same peer
            assert raw.request(Op.PING)[0]["name"] == "OK"
            assert raw.request(Op.STATS)[0]["name"] == "OK"
        finally:
            raw.close()


# -- HELLO -----------------------------------------------------------------------------------------
def _hello_fields(**overrides: Any) -> dict:
    fields = {"namespace": namespace(), "rank": 0, "fingerprint": "fp-a",
              "staging": {"kind": "inline"}}
    for key, value in overrides.items():
        if value is _DROP:
            fields.pop(key)
        else:
            fields[key] = value
    return fields


_DROP = object()


def _assert_no_session(raw: RawClient) -> None:
    reply, _ = raw.request(Op.LOOKUP, keys=[b"k"])
    assert reply["name"] == "NO_SESSION", reply


HELLO_BAD_FIELDS = {
    # name: (overrides, fragments of the message)
    "rank-str": ({"rank": "0"}, ["'rank'", "'0'"]),
    "rank-negative": ({"rank": -1}, ["rank -1", ">= 0"]),
    "rank-bool": ({"rank": True}, ["'rank'", "True"]),
    "rank-float": ({"rank": 0.0}, ["'rank'", "0.0"]),
    "rank-missing": ({"rank": _DROP}, ["'rank'", "missing"]),
    "namespace-empty": ({"namespace": ""}, ["namespace", "1..256"]),
    "namespace-long": ({"namespace": "n" * 257}, ["namespace", "1..256"]),
    "namespace-int": ({"namespace": 5}, ["'namespace'", "5"]),
    "namespace-bytes": ({"namespace": b"ns"}, ["'namespace'", "b'ns'"]),
    "namespace-missing": ({"namespace": _DROP}, ["'namespace'", "missing"]),
    "fingerprint-empty": ({"fingerprint": ""}, ["fingerprint", "1..128"]),
    "fingerprint-int": ({"fingerprint": 3}, ["'fingerprint'", "3"]),
    "staging-str": ({"staging": "shm"}, ["'staging'", "'shm'"]),
    "staging-missing": ({"staging": _DROP}, ["'staging'", "missing"]),
}


@pytest.mark.parametrize("case", sorted(HELLO_BAD_FIELDS))
def test_hello_with_wrong_field_is_bad_request(shared, shm, case):
    overrides, fragments = HELLO_BAD_FIELDS[case]
    with bystander(shared, shm):
        sessions_before = shared.stats()["sessions"]
        raw = RawClient(shared.address)
        try:
            reply, _ = raw.request(Op.HELLO, **_hello_fields(**overrides))
            assert reply["name"] == "BAD_REQUEST", reply
            for fragment in fragments:
                assert fragment in reply["message"], (fragment, reply)
            _assert_no_session(raw)
            assert shared.stats()["sessions"] <= sessions_before
        finally:
            raw.close()


def _staging_case(case: str, shared: DaemonProcess, shm, cleanup: list[Path]):
    """(staging spec, message fragments) for one bad handle."""
    if case == "slash":
        return {"kind": "shm", "name": "../kvtier-stg-x", "nbytes": 4096}, ["'../kvtier-stg-x'"]
    if case == "slash-inside":
        name = "kvtier-stg-a/../../../etc/passwd"
        return {"kind": "shm", "name": name, "nbytes": 4096}, [repr(name), "not allowed"]
    if case == "dotdot":
        return {"kind": "shm", "name": "..", "nbytes": 4096}, ["'..'", "not allowed"]
    if case == "dotdot-suffix":  # a legal-looking name that is no file: cannot be opened
        name = "kvtier-stg-.."
        return {"kind": "shm", "name": name, "nbytes": 4096}, [f"/dev/shm/{name}"]
    if case == "daemon-arena":
        name = shared.arena_name
        assert (SHM / name).exists()
        return {"kind": "shm", "name": name, "nbytes": 4096}, [repr(name), "not allowed"]
    if case == "name-not-str":
        return {"kind": "shm", "name": 12, "nbytes": 4096}, ["12", "not allowed"]
    if case == "name-missing":
        return {"kind": "shm", "nbytes": 4096}, ["None", "not allowed"]
    if case == "nonexistent":
        name = f"kvtier-stg-test-missing-{secrets.token_hex(6)}"
        return {"kind": "shm", "name": name, "nbytes": 4096}, [f"/dev/shm/{name}", "cannot open"]
    if case == "smaller-than-announced":
        buf = shm(4096)
        return buf.handle(nbytes=8192), [buf.name, "4096 bytes", "8192 announced"]
    if case == "nbytes-zero":
        return shm(4096).handle(nbytes=0), ["staging nbytes 0"]
    if case == "nbytes-negative":
        return shm(4096).handle(nbytes=-4096), ["staging nbytes -4096"]
    if case == "nbytes-str":
        return shm(4096).handle(nbytes="4096"), ["staging nbytes '4096'"]
    if case == "nbytes-missing":
        spec = shm(4096).handle()
        del spec["nbytes"]
        return spec, ["staging nbytes None"]
    if case == "symlink":
        target = shm(4096)
        link = SHM / f"kvtier-stg-test-link-{secrets.token_hex(6)}"
        link.symlink_to(target.path)
        cleanup.append(link)
        return {"kind": "shm", "name": link.name, "nbytes": 4096}, [link.name, "cannot open"]
    if case == "directory":
        path = SHM / f"kvtier-stg-test-dir-{secrets.token_hex(6)}"
        path.mkdir()
        cleanup.append(path)
        return {"kind": "shm", "name": path.name, "nbytes": 4096}, [path.name]
    if case == "unknown-kind":
        return {"kind": "tcp"}, ["staging kind 'tcp' is unknown", "shm", "inline"]
    if case == "kind-missing":
        return {"name": "kvtier-stg-x", "nbytes": 1}, ["staging kind None is unknown"]
    if case == "cuda-ipc":
        return {"kind": "cuda_ipc", "handle": b"\x00" * 64, "nbytes": 4096}, ["CUDA", "shm"]
    raise AssertionError(case)


STAGING_CASES = [
    "slash", "slash-inside", "dotdot", "dotdot-suffix", "daemon-arena", "name-not-str",
    "name-missing", "nonexistent", "smaller-than-announced", "nbytes-zero", "nbytes-negative",
    "nbytes-str", "nbytes-missing", "symlink", "directory", "unknown-kind", "kind-missing",
    "cuda-ipc",
]


@pytest.mark.parametrize("case", STAGING_CASES)
def test_hello_with_bad_staging_handle(shared, shm, case):
    cleanup: list[Path] = []
    try:
        with bystander(shared, shm):
            spec, fragments = _staging_case(case, shared, shm, cleanup)
            sessions_before = shared.stats()["sessions"]
            raw = RawClient(shared.address)
            try:
                reply, _ = raw.request(Op.HELLO, **_hello_fields(staging=spec))
                assert reply["name"] == "BAD_HANDLE", reply
                for fragment in fragments:
                    assert fragment in reply["message"], (fragment, reply)
                _assert_no_session(raw)
                assert shared.stats()["sessions"] <= sessions_before
            finally:
                raw.close()
    finally:
        for path in cleanup:
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink(missing_ok=True)


# -- shm staging: bounds -----------------------------------------------------------------------
STAGE = 200_000  # announced staging size: not a multiple of the 4 KiB page, so the daemon's
SLACK = 65_536  # mapping reaches past it; the file has SLACK more bytes holding a sentinel
CHUNK = 8192


def test_get_out_of_bounds_copies_nothing_and_never_past_the_buffer(shared, shm, sessions):
    with bystander(shared, shm):
        buf = shm(STAGE, slack=SLACK)
        s = sessions(shared.address, namespace(), staging=buf)
        data = os.urandom(CHUNK)
        buf.write(0, data)
        assert names(s.put([[b"k", 0, CHUNK]])["results"]) == ["OK"]

        buf.fill(POISON, 0, STAGE)
        buf.fill(SENTINEL, STAGE)
        items = [
            [b"k", -1, CHUNK],
            [b"k", STAGE - CHUNK // 2, CHUNK],  # straddles the end
            [b"k", STAGE, CHUNK],  # starts right at the end
            [b"k", STAGE - CHUNK + 1, CHUNK],  # one byte past the end
            [b"k", 0, 2**62],  # huge nbytes
            [b"k", 2**63 - 1, CHUNK],  # huge offset
            [b"k", 100_000, CHUNK],  # valid: a hit
            [b"k", STAGE - CHUNK, CHUNK],  # valid: ends exactly at the end of the buffer
            [b"k", "0", CHUNK],  # offset not an int
            [b"k", None, CHUNK],
        ]
        reply, payload = s.get(items)
        assert payload == []
        oob = ["OUT_OF_BOUNDS"]
        assert names(reply["results"]) == oob * 6 + ["OK", "OK"] + oob * 2
        errors = item_errors(reply)
        assert sorted(errors) == [0, 1, 2, 3, 4, 5, 8, 9]
        for i in (0, 1, 2, 3, 4, 5):
            name, message = errors[i]
            assert name == "OUT_OF_BOUNDS"
            assert f"[{items[i][1]}, {items[i][1]}+{items[i][2]})" in message, message
            assert f"[0, {STAGE})" in message, message
        assert "'0'" in errors[8][1] and "None" in errors[9][1]

        assert buf.read(100_000, CHUNK) == data
        assert buf.read(STAGE - CHUNK, CHUNK) == data
        expected_poison = [(0, 100_000), (100_000 + CHUNK, STAGE - CHUNK)]
        for start, end in expected_poison:
            assert buf.read(start, end - start) == bytes([POISON]) * (end - start), (start, end)
        assert buf.read(STAGE, SLACK) == bytes([SENTINEL]) * SLACK, "bytes past the buffer written"
        shared.check()


def test_put_out_of_bounds_stores_nothing(shared, shm, sessions):
    with bystander(shared, shm):
        buf = shm(STAGE, slack=SLACK, fill=SENTINEL)
        buf.fill(0x11, 0, STAGE)
        s = sessions(shared.address, namespace(), staging=buf)
        before = shared.cpu()
        items = [
            [b"neg", -1, CHUNK],
            [b"straddle", STAGE - CHUNK // 2, CHUNK],
            [b"at-end", STAGE, 1],
            [b"huge", 0, 2**62],
            [b"huge-offset", 2**63 - 1, CHUNK],
            [b"str-offset", "0", CHUNK],
            [b"fits", STAGE - CHUNK, CHUNK],
        ]
        reply = s.put(items)
        assert names(reply["results"]) == ["OUT_OF_BOUNDS"] * 6 + ["OK"]
        errors = item_errors(reply)
        assert f"[0, {STAGE})" in errors[1][1] and f"[{STAGE - CHUNK // 2}, " in errors[1][1]
        assert s.lookup([item[0] for item in items]) == [0] * 6 + [Tier.CPU]
        after = shared.cpu()
        assert after["chunks"] == before["chunks"] + 1
        assert after["pending_chunks"] == 0
        assert after["used_bytes"] == before["used_bytes"] + 64 * 1024
        # the staging file, including the bytes past the announced size, is untouched
        assert buf.read(0, STAGE) == b"\x11" * STAGE
        assert buf.read(STAGE, SLACK) == bytes([SENTINEL]) * SLACK


@pytest.mark.parametrize("nbytes", [0, -1, -CHUNK, 1.5, "8192", None, True])
def test_bad_nbytes_is_a_per_item_bad_request(shared, shm, sessions, nbytes):
    # nbytes 0 and negative ones are refused by the daemon's nbytes check (BAD_REQUEST) before the
    # staging range check (which would say OUT_OF_BOUNDS); either way nothing is copied.
    with bystander(shared, shm):
        buf = shm(STAGE, slack=SLACK, fill=SENTINEL)
        buf.fill(POISON, 0, STAGE)
        s = sessions(shared.address, namespace(), staging=buf)
        data = os.urandom(CHUNK)
        buf.write(0, data)
        assert names(s.put([[b"k", 0, CHUNK]])["results"]) == ["OK"]
        buf.fill(POISON, 0, STAGE)
        reply = s.put([[b"bad", 0, nbytes], [b"good", 0, CHUNK]])
        assert names(reply["results"]) == ["BAD_REQUEST", "OK"]
        name, message = item_errors(reply)[0]
        assert f"nbytes {nbytes!r}" in message and "positive int" in message, message
        reply, _ = s.get([[b"k", 4096, nbytes], [b"k", 20_000, CHUNK]])
        assert names(reply["results"]) == ["BAD_REQUEST", "OK"]
        assert buf.read(20_000, CHUNK) == data
        assert buf.read(0, 20_000) == bytes([POISON]) * 20_000
        assert buf.read(STAGE, SLACK) == bytes([SENTINEL]) * SLACK
        assert s.lookup([b"bad"]) == [0]


# -- keys ------------------------------------------------------------------------------------------
def test_key_length_and_type_are_checked_per_item(shared, shm, sessions):
    with bystander(shared, shm):
        buf = shm(8 * CHUNK)
        s = sessions(shared.address, namespace(), staging=buf)
        key64 = b"\x01" * MAX_KEY_BYTES
        key65 = b"\x02" * (MAX_KEY_BYTES + 1)
        data = os.urandom(CHUNK)
        buf.write(0, data)
        keys: list[Any] = [key64, key65, b"\x03" * 1000, b"", "text-key", 5, None]
        reply = s.put([[k, 0, CHUNK] for k in keys])
        expected = ["OK", "KEY_TOO_LONG", "KEY_TOO_LONG"] + ["BAD_REQUEST"] * 4
        assert names(reply["results"]) == expected
        errors = item_errors(reply)
        assert "65 bytes" in errors[1][1] and f"{MAX_KEY_BYTES}-byte limit" in errors[1][1]
        assert "1000 bytes" in errors[2][1]
        assert errors[3][1] == "key is empty"
        assert "'text-key'" in errors[4][1] and "not bytes" in errors[4][1]
        assert "key 5 " in errors[5][1] and "key None " in errors[6][1]

        buf.fill(POISON)
        reply, _ = s.get([[k, CHUNK * (i + 1), CHUNK] for i, k in enumerate(keys)])
        assert names(reply["results"]) == expected
        assert buf.read(CHUNK, CHUNK) == data, "the 64-byte key did not round-trip"
        assert buf.read(2 * CHUNK, 6 * CHUNK) == bytes([POISON]) * 6 * CHUNK
        assert buf.read(0, CHUNK) == bytes([POISON]) * CHUNK

        # LOOKUP and DELETE check keys too (LOOKUP refuses the whole request)
        assert s.lookup([key64]) == [Tier.CPU]
        reply, _ = s.request(Op.LOOKUP, keys=[key64, key65])
        assert reply["name"] == "KEY_TOO_LONG" and "65 bytes" in reply["message"], reply
        reply, _ = s.request(Op.LOOKUP, keys=[b""])
        assert reply["name"] == "BAD_REQUEST" and "empty" in reply["message"], reply
        reply, _ = s.request(Op.DELETE, keys=[key65, b"", "text-key"])
        assert names(reply["results"]) == ["KEY_TOO_LONG", "BAD_REQUEST", "BAD_REQUEST"]
        assert s.lookup([key64]) == [Tier.CPU]


# -- namespaces, layouts, sizes ------------------------------------------------------------------
def test_other_namespace_or_rank_cannot_see_a_chunk(shared, shm, sessions):
    with bystander(shared, shm):
        ns = namespace()
        buf = shm(4 * CHUNK)
        owner = sessions(shared.address, ns, staging=buf)
        data = os.urandom(CHUNK)
        buf.write(0, data)
        assert names(owner.put([[b"secret", 0, CHUNK]])["results"]) == ["OK"]
        for other_ns, rank in ((namespace(), 0), (ns, 1)):
            obuf = shm(4 * CHUNK, fill=POISON)
            other = sessions(shared.address, other_ns, staging=obuf, rank=rank)
            assert other.lookup([b"secret"]) == [0]
            reply, _ = other.get([[b"secret", 0, CHUNK]])
            assert names(reply["results"]) == ["MISS"]
            assert obuf.read(0, 4 * CHUNK) == bytes([POISON]) * 4 * CHUNK
            reply, _ = other.request(Op.DELETE, keys=[b"secret"])
            assert names(reply["results"]) == ["MISS"]
        buf.fill(POISON)
        reply, _ = owner.get([[b"secret", CHUNK, CHUNK]])
        assert names(reply["results"]) == ["OK"] and buf.read(CHUNK, CHUNK) == data


def test_put_with_other_layout_fingerprint_keeps_the_stored_chunk(shared, shm, sessions):
    with bystander(shared, shm):
        ns = namespace()
        buf_a = shm(4 * CHUNK)
        a = sessions(shared.address, ns, staging=buf_a, fingerprint="fp-a")
        data = os.urandom(CHUNK)
        buf_a.write(0, data)
        assert names(a.put([[b"k", 0, CHUNK]])["results"]) == ["OK"]
        commits = shared.cpu()["commits"]

        buf_b = shm(4 * CHUNK)
        b = sessions(shared.address, ns, staging=buf_b, fingerprint="fp-b")
        buf_b.write(0, os.urandom(CHUNK))
        reply = b.put([[b"k", 0, CHUNK]])
        assert names(reply["results"]) == ["LAYOUT_MISMATCH"]
        assert "fingerprint" in item_errors(reply)[0][1]
        assert shared.cpu()["commits"] == commits

        before_b = buf_b.read(0, 4 * CHUNK)
        reply, _ = b.get([[b"k", 0, CHUNK]])
        assert names(reply["results"]) == ["LAYOUT_MISMATCH"]  # a miss, with the reason
        assert buf_b.read(0, 4 * CHUNK) == before_b
        assert b.lookup([b"k"]) == [0]
        reply, _ = b.request(Op.DELETE, keys=[b"k"])
        assert names(reply["results"]) == ["LAYOUT_MISMATCH"]

        buf_a.fill(POISON)
        reply, _ = a.get([[b"k", CHUNK, CHUNK]])
        assert names(reply["results"]) == ["OK"]
        assert buf_a.read(CHUNK, CHUNK) == data
        assert a.lookup([b"k"]) == [Tier.CPU]


def test_get_with_wrong_nbytes_is_size_mismatch(shared, shm, sessions):
    with bystander(shared, shm):
        buf = shm(8 * CHUNK)
        s = sessions(shared.address, namespace(), staging=buf)
        data = os.urandom(5000)
        buf.write(0, data)
        assert names(s.put([[b"k", 0, 5000]])["results"]) == ["OK"]
        buf.fill(POISON)
        reply, _ = s.get([[b"k", 0, 4096], [b"k", CHUNK, 5001], [b"k", 2 * CHUNK, CHUNK],
                          [b"k", 3 * CHUNK, 5000]])
        assert names(reply["results"]) == ["SIZE_MISMATCH"] * 3 + ["OK"]
        assert buf.read(0, 3 * CHUNK) == bytes([POISON]) * 3 * CHUNK
        assert buf.read(3 * CHUNK, 5000) == data
        # a PUT of the same key with another size is refused, the stored chunk kept
        buf.write(0, os.urandom(CHUNK))
        reply = s.put([[b"k", 0, CHUNK]])
        assert names(reply["results"]) == ["SIZE_MISMATCH"]
        assert "another size" in item_errors(reply)[0][1]
        buf.fill(POISON)
        reply, _ = s.get([[b"k", 100, 5000]])
        assert names(reply["results"]) == ["OK"] and buf.read(100, 5000) == data


def test_re_put_is_exists_and_copies_nothing(shared, shm, sessions):
    with bystander(shared, shm):
        buf = shm(4 * CHUNK)
        s = sessions(shared.address, namespace(), staging=buf)
        data = os.urandom(CHUNK)
        buf.write(0, data)
        assert names(s.put([[b"k", 0, CHUNK]])["results"]) == ["OK"]
        before = shared.cpu()
        buf.write(0, os.urandom(CHUNK))  # other bytes under the same key
        reply = s.put([[b"k", 0, CHUNK], [b"k", CHUNK, CHUNK]])
        assert names(reply["results"]) == ["EXISTS", "EXISTS"]
        assert reply["errors"] == []  # a successful no-op has no message
        after = shared.cpu()
        assert after["commits"] == before["commits"]
        assert after["used_bytes"] == before["used_bytes"]
        buf.fill(POISON)
        reply, _ = s.get([[b"k", 2 * CHUNK, CHUNK]])
        assert names(reply["results"]) == ["OK"] and buf.read(2 * CHUNK, CHUNK) == data


# -- unexpected payload frames ----------------------------------------------------------------
def test_put_with_payload_frames_on_shm_session_is_bad_request(shared, shm, sessions):
    with bystander(shared, shm):
        buf = shm(4 * CHUNK)
        s = sessions(shared.address, namespace(), staging=buf)
        buf.write(0, os.urandom(CHUNK))
        reply, payload = s.request(Op.PUT, [b"x" * CHUNK], items=[[b"k", 0, CHUNK]])
        assert reply["name"] == "BAD_REQUEST", reply
        assert "payload frames" in reply["message"] and "inline" in reply["message"]
        assert payload == []
        assert s.lookup([b"k"]) == [0]
        assert shared.cpu()["pending_chunks"] == 0
        # the session is still usable
        assert names(s.put([[b"k", 0, CHUNK]])["results"]) == ["OK"]


def test_get_with_payload_frames_on_shm_session_is_bad_request(shared, shm, sessions):
    with bystander(shared, shm):
        buf = shm(4 * CHUNK)
        s = sessions(shared.address, namespace(), staging=buf)
        buf.write(0, os.urandom(CHUNK))
        assert names(s.put([[b"k", 0, CHUNK]])["results"]) == ["OK"]
        buf.fill(POISON)
        reply, payload = s.request(Op.GET, [b"x" * CHUNK], items=[[b"k", 0, CHUNK]])
        assert reply["name"] == "BAD_REQUEST", reply
        assert "payload frames" in reply["message"], reply
        assert buf.read(0, 4 * CHUNK) == bytes([POISON]) * 4 * CHUNK


# -- inline sessions -------------------------------------------------------------------------------
def test_inline_put_frame_count_and_sizes_are_checked(shared, shm, sessions):
    with bystander(shared, shm):
        s = sessions(shared.address, namespace())
        reply, _ = s.request(Op.PUT, [], items=[[b"k", 0, 10]])
        assert reply["name"] == "BAD_REQUEST"
        assert "1 items, 0 frames" in reply["message"], reply
        reply, _ = s.request(Op.PUT, [b"a" * 10, b"b" * 10], items=[[b"k", 0, 10]])
        assert reply["name"] == "BAD_REQUEST" and "1 items, 2 frames" in reply["message"]
        reply = s.put([[b"short", 0, 10], [b"long", 0, 10], [b"ok", 0, 10]],
                      [b"x" * 9, b"x" * 11, b"x" * 10])
        assert names(reply["results"]) == ["SIZE_MISMATCH", "SIZE_MISMATCH", "OK"]
        errors = item_errors(reply)
        assert "9 bytes" in errors[0][1] and "says 10" in errors[0][1]
        assert "11 bytes" in errors[1][1]
        assert s.lookup([b"k", b"short", b"long", b"ok"]) == [0, 0, 0, Tier.CPU]
        assert shared.cpu()["pending_chunks"] == 0


def test_inline_get_returns_one_frame_per_item(shared, shm, sessions):
    with bystander(shared, shm):
        s = sessions(shared.address, namespace())
        a, b = os.urandom(1000), os.urandom(CHUNK)
        assert names(s.put([[b"a", 0, 1000], [b"b", 0, CHUNK]], [a, b])["results"]) == ["OK"] * 2
        reply, payload = s.get([[b"a", 0, 1000], [b"missing", 0, 10], [b"b", 0, CHUNK]])
        assert names(reply["results"]) == ["OK", "MISS", "OK"]
        assert payload == [a, b"", b], [len(p) for p in payload]


# -- limits (a daemon with small ones) -------------------------------------------------------------
def test_oversize_header_frame_is_too_large(limited, shm):
    with bystander(limited, shm):
        raw = RawClient(limited.address)
        try:
            header = _packed({"v": 1, "op": int(Op.PING), "id": 9, "pad": "x" * 5000})
            reply = send_raw(raw, [header])
            assert reply["name"] == "TOO_LARGE", reply
            assert f"header frame is {len(header)} bytes" in reply["message"], reply
            assert "the limit is 4096" in reply["message"]
            assert reply["id"] is None  # not decoded, so the id is unknown
            # a PUT from a session: refused as a whole, nothing stored
            s = Session(limited.address, namespace())
            try:
                items = [[b"k%d" % i, 0, 1] for i in range(4)]
                header = _packed({"v": 1, "op": int(Op.PUT), "id": 3, "items": items,
                                  "pad": "y" * 4096})
                reply = send_raw(s.raw, [header, *[b"z"] * 4])
                assert reply["name"] == "TOO_LARGE", reply
                assert f"header frame is {len(header)} bytes" in reply["message"], reply
                assert s.lookup([b"k0"]) == [0]
            finally:
                s.close()
            assert raw.request(Op.PING)[0]["name"] == "OK"
        finally:
            raw.close()


@pytest.mark.parametrize("op", [Op.LOOKUP, Op.PUT, Op.GET, Op.DELETE], ids=lambda o: o.name)
def test_too_many_items_is_too_large(limited, shm, op):
    with bystander(limited, shm):
        s = Session(limited.address, namespace())
        try:
            keys = [b"k%d" % i for i in range(17)]
            fields = ({"keys": keys} if op in (Op.LOOKUP, Op.DELETE)
                      else {"items": [[k, 0, 1] for k in keys]})
            reply, _ = s.request(op, **fields)  # PUT: no frames, so the item count is checked
            assert reply["name"] == "TOO_LARGE", reply
            field = "keys" if "keys" in fields else "items"
            assert f"field '{field}' has 17 entries; the limit is 16" in reply["message"], reply
            # exactly max_batch is fine
            keys = keys[:16]
            if op is Op.PUT:
                reply, _ = s.request(op, [b"z"] * 16, items=[[k, 0, 1] for k in keys])
            elif op is Op.GET:
                reply, _ = s.request(op, items=[[k, 0, 1] for k in keys])
            else:
                reply, _ = s.request(op, keys=keys)
            assert reply["name"] == "OK", reply
        finally:
            s.close()


def test_too_many_payload_frames_is_too_large(limited, shm):
    with bystander(limited, shm):
        s = Session(limited.address, namespace())
        try:
            items = [[b"k%d" % i, 0, 1] for i in range(17)]
            s.raw.send_frames([_packed({"v": 1, "op": int(Op.PUT), "id": 77, "items": items}),
                               *[b"z"] * 17])
            reply, payload = s.raw.recv()
            assert reply["name"] == "TOO_LARGE", reply
            assert "frames" in reply["message"] and "(17)" in reply["message"], reply
            assert s.lookup([b"k0"]) == [0]
            assert limited.cpu()["pending_chunks"] == 0
        finally:
            s.close()


def test_too_many_payload_frames_reply_echoes_the_request_id(limited, shm):
    with bystander(limited, shm):
        s = Session(limited.address, namespace())
        try:
            items = [[b"k%d" % i, 0, 1] for i in range(17)]
            s.raw.send_frames([_packed({"v": 1, "op": int(Op.PUT), "id": 77, "items": items}),
                               *[b"z"] * 17])
            reply, _ = s.raw.recv()
            assert reply["name"] == "TOO_LARGE", reply
            assert reply["id"] == 77, reply
        finally:
            s.close()


def test_too_many_payload_frames_message_counts_the_clients_frames(limited, shm):
    with bystander(limited, shm):
        s = Session(limited.address, namespace())
        try:
            items = [[b"k%d" % i, 0, 1] for i in range(17)]
            s.raw.send_frames([_packed({"v": 1, "op": int(Op.PUT), "id": 77, "items": items}),
                               *[b"z"] * 17])
            reply, _ = s.raw.recv()
            assert reply["name"] == "TOO_LARGE", reply
            assert "message has 18 frames" in reply["message"], reply
        finally:
            s.close()


def test_oversize_inline_payload_is_too_large_per_item(limited, shm):
    with bystander(limited, shm):
        s = Session(limited.address, namespace())
        try:
            assert s.hello["limits"]["max_inline_bytes"] == 65536
            big, fits = os.urandom(65537), os.urandom(65536)
            reply = s.put([[b"big", 0, len(big)], [b"fits", 0, len(fits)]], [big, fits])
            assert names(reply["results"]) == ["TOO_LARGE", "OK"]
            message = item_errors(reply)[0][1]
            assert "65537" in message and "max_inline_bytes (65536)" in message, message
            assert s.lookup([b"big", b"fits"]) == [0, Tier.CPU]
            reply, _ = s.get([[b"fits", 0, 65537], [b"big", 0, 2**40]])
            assert names(reply["results"]) == ["TOO_LARGE", "TOO_LARGE"]
            assert "65537" in item_errors(reply)[0][1]
            assert limited.cpu()["pending_chunks"] == 0
        finally:
            s.close()


# -- auth ------------------------------------------------------------------------------------------
def test_auth_token_is_required(daemon_factory, tmp_path, shm):
    config = write_toml(tmp_path / "auth.toml", 'auth_token = "s3cret"\n')
    d = daemon_factory("--config", str(config))
    with bystander(d, shm, token="s3cret"):
        raw = RawClient(d.address)
        try:
            for token in (_DROP, "wrong", "", "s3cret ", "S3CRET", b"s3cret", 5, None):
                fields = _hello_fields() if token is _DROP else _hello_fields(token=token)
                reply, _ = raw.request(Op.HELLO, **fields)
                assert reply["name"] == "AUTH_FAILED", (token, reply)
                assert "token" in reply["message"] and "s3cret" not in reply["message"]
                _assert_no_session(raw)
            reply, _ = raw.request(Op.HELLO, **_hello_fields(token="s3cret"))
            assert reply["name"] == "OK", reply
            assert raw.request(Op.LOOKUP, keys=[b"k"])[0]["name"] == "OK"
        finally:
            raw.close()


def test_non_ascii_auth_token_is_auth_failed(daemon_factory, tmp_path, shm):
    config = write_toml(tmp_path / "auth.toml", 'auth_token = "s3cret"\n')
    d = daemon_factory("--config", str(config))
    try:
        with bystander(d, shm, token="s3cret"):
            raw = RawClient(d.address)
            try:
                reply, _ = raw.request(Op.HELLO, **_hello_fields(token="sécret"))
                assert reply["name"] == "AUTH_FAILED", reply
                _assert_no_session(raw)
            finally:
                raw.close()
        assert "Traceback" not in d.log()
    finally:
        stop_tolerating_traceback(d)


# -- a staging file that shrinks under the daemon ------------------------------------------------
def _reply_or_death(raw: RawClient, d: DaemonProcess, timeout_s: float = 10.0) -> dict | None:
    """The next non-probe reply, or None as soon as the daemon process is gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if raw.sock.poll(50):
            header = msgpack.unpackb(raw.sock.recv_multipart()[0], raw=False)
            if header.get("id") != 0:
                return header
        elif not d.alive():
            return None
    raise AssertionError("no reply, and the daemon is still alive")


@pytest.mark.parametrize("op", [Op.PUT, Op.GET], ids=lambda o: o.name)
def test_staging_file_truncated_after_hello_does_not_kill_the_daemon(daemon_factory, shm, op):
    d = daemon_factory()
    try:
        with bystander(d, shm):
            buf = shm(1 << 20)
            s = Session(d.address, namespace(), staging=buf)
            try:
                buf.write(0, os.urandom(CHUNK))
                assert names(s.put([[b"first", 0, CHUNK]])["results"]) == ["OK"]
                buf.mm.close()  # never touch the mapping after the truncation
                os.truncate(buf.path, 0)
                key = b"second" if op is Op.PUT else b"first"
                s.raw.send_frames([_packed({"v": 1, "op": int(op), "id": 50,
                                            "items": [[key, 512 * 1024, CHUNK]]})])
                reply = _reply_or_death(s.raw, d)
                assert reply is not None, f"the daemon died ({d.proc.returncode})"
                assert reply["id"] == 50
                assert reply["name"] != "OK" or reply["results"] != [Status.OK], reply
            finally:
                s.close()
    finally:
        stop_tolerating_traceback(d)
