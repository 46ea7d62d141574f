"""LMCache 0.5.6's multiprocess server, CPU mode over POSIX shared memory, on the KV-tensor path.

The peer is what a CPU vLLM worker runs with LMCache's MP connector: ``lmcache.v1.multiprocess.
server`` in ``engine_driven`` transfer mode with ``--shm-name`` (its L1 pool is a POSIX shm
segment the worker maps), and on the worker side LMCache's own client API:
``RequestClientFactory`` (ZeroMQ) + ``create_transfer_context`` (its ``EngineDrivenContextShm``
gathers paged KV blocks straight into the server's shm slots: prepare_store / commit_store, and
scatters from them on load: prepare_retrieve / commit_retrieve). A load is what a request needs
before it can retrieve from LMCache: ``lookup`` (prefix hashing + prefetch with read locks),
``wait_prefetch_status``, then the retrieve; kvtierd's matching row times LOOKUP + GET likewise.

Its environment is its own: a venv under ``.cache/peers/lmcache-venv`` created on first use with
``lmcache==0.5.6`` installed without its dependency list, which names CUDA-only packages
(cupy-cuda13x, cuda-python, cufile) and ~1.5 GB that CPU mode never imports. The venv reads the
project's site-packages after its own (a ``.pth`` file) for torch and the rest: LMCache's native
extensions link against libtorch, so it must run on the same torch build as the engine anyway,
and the comparison then runs both sides on the very same torch. An import probe checks that the
server and the client load; a failure is reported as ``PeerUnavailable`` with the import error.

This file is also the worker: the venv's python runs it with ``-P`` (so that this file's folder,
whose ``lmcache.py`` is this module, does not shadow the real package), with ``--worker``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import uuid
from pathlib import Path

VERSION = "0.5.6"
ROOT = Path(__file__).resolve().parents[2]
ENV_DIR = ROOT / ".cache" / "peers" / "lmcache-venv"
READY = ENV_DIR / ".kvtierd-ready"
PROBE = ("import lmcache.v1.multiprocess.server, lmcache.v1.multiprocess.transfer_context, "
         "lmcache.v1.multiprocess.transport.factory")
#: tokens per LMCache chunk: one 16-token block, the chunk kvtierd stores too
CHUNK_TOKENS = 16
TIMEOUT_S = 120.0
#: nothing leaves the machine: LMCache's usage telemetry is off, its logs quiet
PEER_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_LOG_LEVEL": "WARNING"}


def _python() -> Path:
    return ENV_DIR / "bin" / "python"


def _run(cmd: list, what: str) -> None:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        from . import PeerUnavailable
        raise PeerUnavailable(f"lmcache: {what} failed (exit {proc.returncode}):\n{tail}")


def ensure_env() -> Path:
    """The peer's python, after creating and checking its venv on first use (cached after)."""
    if READY.exists() and READY.read_text().strip() == VERSION and _python().exists():
        return _python()
    ENV_DIR.parent.mkdir(parents=True, exist_ok=True)
    print(f"lmcache: creating {ENV_DIR} (lmcache=={VERSION})", file=sys.stderr)
    _run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--clear", ENV_DIR],
         "creating the venv")
    purelib = subprocess.run([_python(), "-c", "import sysconfig;"
                              "print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    project = sysconfig.get_paths()["purelib"]
    # "zz-": read after everything the venv installs itself, so its own packages win
    Path(purelib, "zz-kvtierd-project.pth").write_text(project + "\n")
    _run([_python(), "-m", "pip", "install", "-q", "--no-deps", f"lmcache=={VERSION}"],
         f"pip install lmcache=={VERSION}")
    _run([_python(), "-P", "-c", PROBE], "importing the LMCache server and client")
    READY.write_text(VERSION + "\n")
    return _python()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(python: Path, port: int, shm_name: str, l1_gb: float,
                  log: Path) -> subprocess.Popen:
    cmd = [python, "-P", "-m", "lmcache.v1.multiprocess.server",
           "--host", "127.0.0.1", "--port", port, "--chunk-size", CHUNK_TOKENS,
           "--supported-transfer-mode", "engine_driven", "--shm-name", shm_name,
           "--l1-size-gb", l1_gb, "--eviction-policy", "LRU", "--disable-observability"]
    with open(log, "wb") as out:
        return subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **PEER_ENV}, start_new_session=True)


def _stop_server(proc: subprocess.Popen, shm_name: str) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # the server shuts down (and unlinks its pool) on it
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    for leftover in Path("/dev/shm").glob(f"*{shm_name}*"):
        leftover.unlink(missing_ok=True)  # a killed server leaves its pool behind


def run(sizes: list[int], rounds: int, workdir: Path, batch_bytes: int | None = None) -> list[dict]:
    """Store and load ``sizes``-byte chunks through LMCache (see the module docstring)."""
    from . import BATCH_BYTES, PeerUnavailable, checked_rows

    python = ensure_env()
    batch = batch_bytes or BATCH_BYTES
    workdir = Path(workdir)
    port, shm_name = _free_port(), f"kvtierd-bench-{uuid.uuid4().hex[:8]}"
    # the L1 pool holds every round's batch without evicting: ``rounds + 1`` batches per size
    l1_gb = max(0.25, round(1.25 * batch * (rounds + 1) * len(sizes) / 1024**3, 2))
    log = workdir / "lmcache-server.log"
    server = _start_server(python, port, shm_name, l1_gb, log)
    out = workdir / "lmcache-rows.json"
    try:
        cmd = [python, "-P", Path(__file__).resolve(), "--worker", "--url",
               f"tcp://127.0.0.1:{port}", "--rounds", rounds, "--batch-bytes", batch,
               "--out", out]
        for s in sizes:
            cmd += ["--size", s]
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                              env={**os.environ, **PEER_ENV}, timeout=600)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
            server_tail = "\n".join(log.read_text(errors="replace").splitlines()[-10:])
            raise PeerUnavailable(f"lmcache: the worker failed (exit {proc.returncode}):\n{tail}"
                                  f"\nserver log:\n{server_tail}")
        return checked_rows("lmcache", json.loads(out.read_text()))
    finally:
        _stop_server(server, shm_name)


# -- the worker: runs in the peer's venv -----------------------------------------------------------
def _wait_for_server(client) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        future = client.get_chunk_size()
        if future.wait(timeout=2.0):
            chunk = future.result()
            if chunk != CHUNK_TOKENS:
                raise RuntimeError(f"the server's chunk size is {chunk}, not {CHUNK_TOKENS}")
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the LMCache server did not answer within {TIMEOUT_S:.0f} s")


def _measure(client, size: int, rounds: int, batch_bytes: int, instance_id: int) -> dict:
    import random

    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
    from lmcache.v1.multiprocess.transfer_context import (EngineDrivenContextShm,
                                                          create_transfer_context)
    from peers import PATH_KV, KVGeometry, loaded_correctly, poison

    geo = KVGeometry(size, batch_bytes)
    kv = geo.kv_caches()
    src, dst = geo.block_ids()
    model = f"kvtierd-bench-{size}"
    ctx = create_transfer_context(kv, instance_id=instance_id, req_client=client,
                                  mode="engine_driven")
    # the layout hint a vLLM worker sends (vllm_layout_hints): NHD pages, block-first
    ctx.register(kv, model, 1, 1, TIMEOUT_S, layout_hints={"kv_layout": "NHD"})
    if not isinstance(ctx.engine_driven_context, EngineDrivenContextShm):
        raise RuntimeError("LMCache fell back from SHM to pickle transfers: not the mode measured")
    tokens_per_batch = geo.chunks * CHUNK_TOKENS
    rng = random.Random(size)
    store_s, load_s = [], []
    try:
        for r in range(rounds + 1):  # round 0 warms up
            rid = f"bench-{size}-{r}-{uuid.uuid4().hex[:6]}"
            tokens = tuple(rng.randrange(1, 32000) for _ in range(tokens_per_batch))
            key = IPCCacheServerKey(model_name=model, world_size=1, worker_id=0,
                                    token_ids=tokens, start=0, end=len(tokens), request_id=rid,
                                    num_kv_readers=1)
            t0 = time.perf_counter()
            stored = ctx.submit_store(rid, key, kv, [src], None, 1).result(timeout=TIMEOUT_S)
            t1 = time.perf_counter()
            poison(kv, dst)
            t2 = time.perf_counter()
            client.lookup(key.no_worker_id_version(), 1).result(timeout=TIMEOUT_S)
            hits = client.wait_prefetch_status(rid, TIMEOUT_S).result(timeout=TIMEOUT_S)
            loaded = ctx.submit_retrieve(rid, key, kv, [dst], None, 1).result(timeout=TIMEOUT_S)
            t3 = time.perf_counter()
            client.end_session(rid).result(timeout=TIMEOUT_S)
            if not (stored and loaded and hits == geo.chunks):
                raise RuntimeError(f"round {r}: stored={stored} hits={hits}/{geo.chunks} "
                                   f"loaded={loaded}")
            if not loaded_correctly(kv, src, dst):
                raise RuntimeError(f"round {r}: the loaded blocks differ from the stored ones")
            if r:
                store_s.append(t1 - t0)
                load_s.append(t3 - t2)
    finally:
        unregister = ctx.unregister()
        if unregister is not None:
            unregister.result(timeout=TIMEOUT_S)
        ctx.close()
    gb = geo.chunks * size / 1e9
    return {"peer": "lmcache", "path": PATH_KV, "chunk_bytes": size,
            "store_gbps": gb / min(store_s), "load_gbps": gb / min(load_s),
            "batch_bytes": geo.chunks * size, "rounds": rounds,
            "mode": "engine_driven + POSIX shm", "version": VERSION}


def _worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--size", type=int, action="append", required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--batch-bytes", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: ``peers``

    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    client = RequestClientFactory.create(args.url)
    try:
        _wait_for_server(client)
        rows = [_measure(client, size, args.rounds, args.batch_bytes, os.getpid() * 64 + i)
                for i, size in enumerate(args.size)]
    finally:
        client.close()
    args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
