"""kvtierd's remote tier against Mooncake's own Python client, on one real Mooncake Store.

    .venv/bin/python benchmarks/remote_tier.py [--bytes 256MiB] [--rounds 7] [--quick]
                                               [--only transfers|lookup]

One run starts a Mooncake Store in a private network namespace (``mooncake_master`` + a
``mooncake_client`` store process lending the memory, so bytes cross a process boundary over TCP
as to another node; ``tests/helpers/mooncake.py``) and, interleaved round by round on that store:

* **Mooncake raw**: its Python client's ``batch_put_from`` / ``batch_get_into`` of ``--bytes`` as
  256 KiB and 2 MiB objects from/into a registered buffer (``benchmarks/peers/mooncake.py``).
* **kvtierd remote tier**: the same bytes in a real arena, published with the tier's write job
  (arena pages + trailing header per object, zero-copy, batches of the same size) and fetched
  with the tier's batched read job, as the tier chain runs one GET's promotions from a tier with
  batched reads (one job, one ``batch_get_into_multi_buffers`` per ``max_batch`` objects) into
  targets reserved as the CPU tier reserves them (a spare page: the header lands after the
  payload, one buffer per object), header check and xxh3-128 verification of every object
  included.
* **Mooncake raw + xxh3**: the same gets, each batch's objects hashed as they arrive (what
  kvtierd must do to every object it serves): the ceiling of a client that checks its bytes.
* **Mooncake as kvtierd**: its client making kvtierd's calls per object: the payload and an
  ``HEADER_BYTES`` header from a slot elsewhere put as two buffers of one
  ``batch_put_from_multi_buffers`` entry (Mooncake moves each buffer as a transfer of its own, so
  the header costs a 256 KiB object a second transfer), the whole object read into one buffer,
  each payload hashed. The bound of the object format on this machine, by Mooncake's own code.
* **Lookup latency** for 1 / 64 / 1024 keys (half of them present): the tier's existence-check job
  (names + ``batch_is_exist`` + recording the answer) against the raw ``batch_is_exist``.

The best round counts for each side, and the median of each round's own ratio (steadier on a
shared machine), and how many cores the machine kept busy during Mooncake's raw gets (where
that is every core, the check of what is fetched can only take cores from the transfer).
``--transfer-cpus 0`` confines the Mooncake clients and the store process to CPU 0 and runs the
tier's verifier threads on the others: a transfer that leaves a core free, as on a node with more
cores than this VM. ``--only`` runs one half (``lookup``: no transfers, a small store; to iterate on
the existence check). Target (issue 13): kvtierd / Mooncake >= 0.8 both ways. Nothing
asserts; the table is printed and the numbers written as JSON (``--json``). ``--quick`` runs tiny
sizes for the smoke test (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from peers import mooncake as peer  # noqa: E402

from kvtierd.config_remote import RemoteConfig  # noqa: E402
from kvtierd.copy.memcpy import checksum  # noqa: E402
from kvtierd.remote.objects import HEADER_BYTES  # noqa: E402
from kvtierd.remote.tier import RemoteTier  # noqa: E402
from kvtierd.server.chain import split  # noqa: E402
from kvtierd.sizes import parse_size  # noqa: E402
from kvtierd.tiers.arena import Arena  # noqa: E402
from kvtierd.tiers.chunk import segments  # noqa: E402

PAGE = 64 * 1024
SIZES = (256 * 1024, 2 * 1024**2)
LOOKUP_KEYS = (1, 64, 1024)


def tier_round(tier: RemoteTier, arena: Arena, ns, chunk_bytes: int, nbytes: int,
               io_threads: int) -> dict:
    count = max(1, nbytes // chunk_bytes)
    pages = chunk_bytes // PAGE
    half = arena.nbytes // 2
    assert count * chunk_bytes <= half
    arena.view[:count * chunk_bytes] = os.urandom(count * chunk_bytes)
    fp = "bench-fingerprint"
    space = ("bench", f"round-{uuid.uuid4().hex}", 0)
    items = []
    for i in range(count):
        runs = [(i * pages, pages)]
        digest = checksum(arena.view, segments(runs, chunk_bytes, PAGE))
        target = tier.reserve((space, b"%d" % i), fp, chunk_bytes, digest)
        items.append((target, runs))
    job = tier.write_job(items, arena)
    with ns.entered():
        start = time.perf_counter()
        job()
        put_s = time.perf_counter() - start
    for target, _ in items:
        tier.commit(target)
    # Each target as the CPU tier reserves a promotion while a contiguous run is free: room for
    # the object's trailing header after the payload (LowerTier.read_slack_bytes).
    base, padded = half // PAGE, -(-(chunk_bytes + tier.read_slack_bytes) // PAGE)
    assert (base + count * padded) * PAGE <= arena.nbytes
    arena.view[half:half + count * padded * PAGE] = b"\xa5" * (count * padded * PAGE)  # poison
    reads = []
    for i, (target, _) in enumerate(items):
        dst = [(base + i * padded, padded)]
        reads.append((target, dst, segments(dst, chunk_bytes, PAGE)))
    # One GET of every chunk, cut into read jobs as TierChain._submit_reads cuts it.
    assert tier.batched_reads  # so TierChain._submit_reads makes one job of them
    per_job = count * chunk_bytes
    jobs = [tier.read_batch_job(part, arena)
            for part in split(reads, lambda read: read[0].nbytes, per_job)]

    def entered(fn):
        with ns.entered():
            return fn()

    with concurrent.futures.ThreadPoolExecutor(io_threads) as pool:
        start = time.perf_counter()
        results = [r for part in pool.map(entered, jobs) for r in part]
        get_s = time.perf_counter() - start
    bad = [r for r in results if isinstance(r, Exception)]
    assert not bad, f"{len(bad)} chunks failed their read: {bad[0]}"
    total = count * chunk_bytes
    for i, (_, _, segs) in enumerate(reads):
        (offset, length), = segs
        assert arena.view[offset:offset + length] == arena.view[i * chunk_bytes:
                                                                (i + 1) * chunk_bytes], (
            "remote tier returned other bytes")
    for target, _ in items:
        tier.delete(target.ikey)
    deletions = tier.take_deletions()
    if deletions:
        entered(tier.delete_job(deletions))
        tier.deleted(deletions)
    return {"chunk_bytes": chunk_bytes, "chunks": count, "bytes": total,
            "store_gbps": total / put_s / 1e9, "load_gbps": total / get_s / 1e9}


def lookup_latency(tier: RemoteTier, client, ns, reps: int) -> list[dict]:
    """Median seconds of one existence check of N keys, half present, tier vs raw. The tier runs
    with its default ``max_batch`` here (one ``batch_is_exist`` for 1024 keys, as the raw side
    asks); the transfers above use the raw side's batch of ``peer.BATCH`` objects."""
    default = dataclasses.replace(tier.cfg, max_batch=RemoteConfig().max_batch)
    tier.cfg = tier.store.cfg = default
    fp = "bench-lookup"
    space = ("bench", f"lookup-{uuid.uuid4().hex}", 0)
    present = [(space, b"p%d" % i) for i in range(max(LOOKUP_KEYS) // 2)]
    names = [tier.name_of(k, fp) for k in present]
    with ns.entered():
        for i in range(0, len(names), peer.BATCH):
            codes = client.batch_put_from(names[i:i + peer.BATCH],
                                          [tier.arena.address] * len(names[i:i + peer.BATCH]),
                                          [64] * len(names[i:i + peer.BATCH]))
            assert all(c == 0 for c in codes), codes
    rows = []
    for n in LOOKUP_KEYS:
        keys = present[: n - n // 2] + [(space, b"a%d" % i) for i in range(n // 2)]
        tier_s, raw_s = [], []
        for _ in range(reps):
            tier.known.clear()
            tier._used_bytes = 0
            with ns.entered():
                start = time.perf_counter()
                found = tier.exists_job(keys, fp)()
                tier.exists_done(keys, fp, found)
                tier_s.append(time.perf_counter() - start)
                assert sum(found) == n - n // 2, (n, sum(found))
                raw_names = [tier.name_of(k, fp) for k in keys]
                start = time.perf_counter()
                client.batch_is_exist(raw_names)
                raw_s.append(time.perf_counter() - start)
        rows.append({"keys": n, "kvtierd_ms": statistics.median(tier_s) * 1e3,
                     "mooncake_ms": statistics.median(raw_s) * 1e3})
    tier.known.clear()
    tier._used_bytes = 0
    with ns.entered():
        client.batch_remove(names, True)
    return rows


def _median_ratio(tops: list[dict], bottoms: list[dict], way: str) -> float:
    """The median of each round's own ratio ``tops[i][way] / bottoms[i][way]`` (both sides
    seconds apart: steadier than a ratio of bests when other work comes and goes)."""
    return statistics.median(t[way] / b[way] for t, b in zip(tops, bottoms))


def _shaped_row(shaped: list[dict], ours: list[dict], raw: list[dict]) -> dict:
    """Mooncake's client doing kvtierd's calls per object, beside kvtierd and the raw client."""
    row: dict = {}
    for way in ("store_gbps", "load_gbps"):
        row[way] = max(t[way] for t in shaped)
        row[f"{way[:-5]}_ratio_median"] = _median_ratio(ours, shaped, way)
        row[f"{way[:-5]}_vs_raw_median"] = _median_ratio(shaped, raw, way)
    return row


def cpu_split(spec: str) -> tuple[set[int], set[int]]:
    """``--transfer-cpus`` (``"0"``, ``"0,2"``, ``"0-3"``): those CPUs, and the rest of this
    process's CPUs (for the tier's verifier threads); SystemExit naming what is wrong."""
    try:
        cpus = set()
        for part in spec.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise SystemExit(f"--transfer-cpus {spec!r}: expected CPU numbers such as 0 or 0-3,5")
    allowed = os.sched_getaffinity(0)
    rest = allowed - cpus
    if not cpus <= allowed or not rest:
        raise SystemExit(f"--transfer-cpus {spec!r}: must be some, not all, of this process's "
                         f"CPUs {sorted(allowed)}")
    return cpus, rest


def pin_verifiers(tier: RemoteTier, cpus: set[int]) -> None:
    """Start the tier's verifier threads now and move each to ``cpus`` (they meet at a barrier,
    so every thread of the pool takes one of the tasks)."""
    pool, threads = tier.verifier.pool(), tier.io_threads
    ready = threading.Barrier(threads)

    def pin() -> None:
        ready.wait(timeout=30)
        os.sched_setaffinity(0, cpus)  # 0: the calling thread

    for done in [pool.submit(pin) for _ in range(threads)]:
        done.result()


def run(args: argparse.Namespace) -> dict:
    nbytes = parse_size(args.bytes)
    verify_cpus = None
    if args.transfer_cpus:
        # this thread's affinity is inherited by every thread and process started from here on:
        # both Mooncake clients' transfer threads and the store process
        transfer_cpus, verify_cpus = cpu_split(args.transfer_cpus)
        os.sched_setaffinity(0, transfer_cpus)
    sizes = [] if args.only == "lookup" else list(SIZES)
    if args.only == "lookup":
        nbytes = 4 * 1024**2  # the arena and the store only need room for the lookup's objects
    region = peer.Region(peer.region_bytes(nbytes, HEADER_BYTES))
    # the second half holds the read targets, each with a spare page for the trailing header
    arena = Arena(f"kvtierd-bench-remote-{os.getpid()}", 2 * nbytes + nbytes // 2, prefault=True,
                  lock=False)
    results: dict = {"bytes": nbytes, "rounds": args.rounds, "io_threads": args.io_threads,
                     "cpu_count": os.cpu_count(),
                     "sizes": {}, "notes": []}
    try:
        with peer.store(Path(args.workdir), 3 * nbytes) as master:
            client = peer.connect(master, region)
            cfg = RemoteConfig(master_addr=master.master_addr, metadata_url=master.metadata_url,
                               global_segment_bytes=0, local_buffer_bytes=16 * 1024**2,
                               cluster_id="bench", max_batch=peer.BATCH)
            tier = RemoteTier(cfg, arena, PAGE)
            if verify_cpus is not None:
                pin_verifiers(tier, verify_cpus)
                results["transfer_cpus"] = sorted(transfer_cpus)
                results["verify_cpus"] = sorted(verify_cpus)
            try:
                for size in sizes:
                    raw, ours, checked, shaped = [], [], [], []
                    for r in range(args.rounds):  # interleaved: the machine's noise hits all
                        # and in turns: whichever goes second meets what the first left behind
                        sides = [lambda: raw.append(peer.measure(client, region, size, nbytes,
                                                                 master.ns)),
                                 lambda: ours.append(tier_round(tier, arena, master.ns, size,
                                                                nbytes, args.io_threads)),
                                 lambda: checked.append(peer.measure(
                                     client, region, size, nbytes, master.ns, verify=True)),
                                 lambda: shaped.append(peer.measure(
                                     client, region, size, nbytes, master.ns, verify=True,
                                     trailer=HEADER_BYTES))]
                        for side in sides if r % 2 == 0 else sides[::-1]:
                            side()
                    row = {key: {"store_gbps": max(r["store_gbps"] for r in runs),
                                 "load_gbps": max(r["load_gbps"] for r in runs)}
                           for key, runs in (("mooncake", raw), ("kvtierd", ours))}
                    for way in ("store_gbps", "load_gbps"):
                        row[f"{way[:-5]}_ratio"] = row["kvtierd"][way] / row["mooncake"][way]
                        # each round's own ratio (both sides seconds apart): steadier than the
                        # ratio of bests when other work comes and goes on the machine
                        row[f"{way[:-5]}_ratio_median"] = _median_ratio(ours, raw, way)
                    busy = [r["load_cores_busy"] for r in raw if r["load_cores_busy"] is not None]
                    # whether a verifying reader's xxh3 can hide behind the transfer at all
                    row["mooncake"]["load_cores_busy"] = statistics.median(busy) if busy else None
                    row["mooncake_verified"] = {
                        "load_gbps": max(c["load_gbps"] for c in checked),
                        "load_ratio_median": _median_ratio(ours, checked, "load_gbps"),
                        # what hashing every object costs Mooncake's own client on this machine:
                        # the bound a verifying reader's fetch ratio meets
                        "vs_raw_median": _median_ratio(checked, raw, "load_gbps")}
                    row["mooncake_shaped"] = _shaped_row(shaped, ours, raw)
                    row["rounds"] = [{"mooncake": m, "kvtierd": o, "mooncake_verified": c,
                                      "mooncake_shaped": t}
                                     for m, o, c, t in zip(raw, ours, checked, shaped)]
                    results["sizes"][str(size)] = row
                if args.only != "transfers":
                    results["lookup"] = lookup_latency(tier, client, master.ns, args.lookup_reps)
            finally:
                with master.ns.entered():
                    tier.close()
                    client.unregister_buffer(region.address)
                    client.close()
    finally:
        arena.close()
        region.close()
    return results


def print_table(results: dict) -> None:
    if results["sizes"]:
        _print_transfers(results)
    if "lookup" not in results:
        return
    print(f"\n{'lookup keys':>11} {'mooncake ms':>12} {'kvtierd ms':>11}")
    for row in results["lookup"]:
        print(f"{row['keys']:>11} {row['mooncake_ms']:>12.3f} {row['kvtierd_ms']:>11.3f}")


def _print_transfers(results: dict) -> None:
    print(f"\nremote tier vs Mooncake's Python client, {results['bytes']} bytes per size, best of "
          f"{results['rounds']} interleaved rounds (shared machine: compare ratios)")
    if "transfer_cpus" in results:
        print(f"pinned: the Mooncake clients and the store process on CPUs "
              f"{results['transfer_cpus']}, the remote tier's verifier threads on "
              f"{results['verify_cpus']}")
    print(f"{'chunk':>8} {'way':>6} {'mooncake GB/s':>14} {'kvtierd GB/s':>13} {'ratio':>6} "
          f"{'median of rounds':>17}")
    for size, row in results["sizes"].items():
        for way in ("store", "load"):
            print(f"{int(size) // 1024:>6}Ki {way:>6} {row['mooncake'][way + '_gbps']:>14.2f} "
                  f"{row['kvtierd'][way + '_gbps']:>13.2f} {row[way + '_ratio']:>6.2f} "
                  f"{row[way + '_ratio_median']:>17.2f}")
    print("ratio: best kvtierd round / best Mooncake round; median of rounds: the median of "
          "each round's own ratio")
    print(f"\n{'chunk':>8} {'mooncake + xxh3 load GB/s':>26} {'it / mooncake, median':>22} "
          f"{'kvtierd / it, median':>21}")
    for size, row in results["sizes"].items():
        checked = row["mooncake_verified"]
        print(f"{int(size) // 1024:>6}Ki {checked['load_gbps']:>26.2f} "
              f"{checked['vs_raw_median']:>22.2f} {checked['load_ratio_median']:>21.2f}")
    print("mooncake + xxh3: its client hashing each batch it got (kvtierd verifies every object "
          "it fetches: the ceiling of a client that checks its bytes); it / mooncake: what the "
          "hashing alone costs that client on this machine")
    for size, row in results["sizes"].items():
        busy = row["mooncake"]["load_cores_busy"]
        if busy is not None:
            print(f"{int(size) // 1024:>6}Ki: Mooncake's raw gets kept {busy:.2f} of "
                  f"{results['cpu_count']} cores busy (median of rounds, every process); a "
                  "verifying reader's hashing hides behind the transfer only in the cores left")
    print(f"\n{'chunk':>8} {'way':>6} {'mooncake as kvtierd GB/s':>25} {'it / mooncake':>14} "
          f"{'kvtierd / it':>13}")
    for size, row in results["sizes"].items():
        shaped = row["mooncake_shaped"]
        for way in ("store", "load"):
            print(f"{int(size) // 1024:>6}Ki {way:>6} {shaped[way + '_gbps']:>25.2f} "
                  f"{shaped[way + '_vs_raw_median']:>14.2f} "
                  f"{shaped[way + '_ratio_median']:>13.2f}")
    print(f"mooncake as kvtierd: its client making kvtierd's calls per object (payload + a "
          f"{HEADER_BYTES}-byte header as two put buffers, the whole object read into one "
          "buffer, xxh3 of each payload); medians of the rounds' own ratios")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--bytes", default="256MiB", help="bytes moved per chunk size and round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--io-threads", type=int, default=4, help="threads running the read "
                        "jobs (the remote tier's io_threads; one GET is one job)")
    parser.add_argument("--lookup-reps", type=int, default=20)
    parser.add_argument("--workdir", default=str(REPO / "benchmarks/results/remote_tier"))
    parser.add_argument("--json", default=str(REPO / "benchmarks/results/remote_tier.json"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--transfer-cpus", default=None, help="run this process's Mooncake "
                        "clients and the store process on these CPUs (0 or 0-3,5) and the remote "
                        "tier's verifier threads on the others: a transfer that leaves cores free, "
                        "as on a node with more cores than the VM (default: no pinning)")
    parser.add_argument("--only", choices=("transfers", "lookup"), default=None,
                        help="run only the GB/s rounds or only the lookup latency (default: both)")
    args = parser.parse_args()
    if args.quick:
        args.bytes, args.rounds, args.lookup_reps = "4MiB", 1, 2
    reason = peer.mc.unavailable_reason()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    results = run(args)
    print_table(results)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
