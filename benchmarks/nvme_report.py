"""The tables of ``benchmarks/nvme_tier.py``: the summary per chunk size (median and minimum of the
daemon's ratios, beside the raw tool's own minimum against itself) and every run in order with the
disk's counters (``disk_stats``) and the daemon's CPU. Run as a script's sibling."""

from __future__ import annotations

from kvtierd.sizes import format_size

TARGET = 0.8


def _flag(ratio: float) -> str:
    return "" if ratio >= TARGET else " <"


def _self(ratio: dict) -> str:
    return f"{ratio['min']:.3f}x" if ratio else "-"


def _disk(d: dict | None) -> str:
    """busy fraction / mean requests in flight of a phase (disk_stats.delta)."""
    return f"{d['busy']:.2f}/{d['depth']:4.1f}" if d else "-"


def print_runs(r: dict) -> None:
    """Every run in order, raw and daemon (R D R D ... R), with the disk's busy fraction and
    mean queue depth in each phase and the daemon's CPU (loop thread / all threads, CPU s per
    wall s): what tells a slow disk from an idle one."""
    print()
    print(f"{'chunk':<6}{'run':<5}{'write GB/s':>11}{'ratio':>7}{'busy/depth':>12}{'KiB/io':>8}"
          f"{'read GB/s':>11}{'ratio':>7}{'busy/depth':>12}{'KiB/io':>8}{'loop/all CPU':>20}")
    for label, row in r["sizes"].items():
        raws = row.get("raws", [])
        for i, raw in enumerate(raws):
            wd, rd = raw.get("write_disk"), raw.get("read_disk")
            self_w = self_r = ""
            if 0 < i < len(raws) - 1:
                self_w = f"{row['raw_self_write_ratio']['values'][i - 1]:.3f}"
                self_r = f"{row['raw_self_read_ratio']['values'][i - 1]:.3f}"
            print(f"{label:<6}{'raw':<5}{raw['write_gbs']:>11.2f}{self_w:>7}{_disk(wd):>12}"
                  f"{(wd or {}).get('write_kib_per_io', 0):>8.0f}{raw['read_gbs']:>11.2f}"
                  f"{self_r:>7}{_disk(rd):>12}{(rd or {}).get('read_kib_per_io', 0):>8.0f}")
            if i < len(row["pairs"]):
                p = row["pairs"][i]
                d = p["daemon"]
                dd, pd = d.get("demote_disk"), d.get("promote_disk")
                dc, pc = d.get("demote_cpu", {}), d.get("promote_cpu", {})
                cpu = (f"{dc.get('loop', 0):.2f}/{dc.get('all', 0):.2f} "
                       f"{pc.get('loop', 0):.2f}/{pc.get('all', 0):.2f}")
                print(f"{label:<6}{'kvt':<5}{d['demote_gbs']:>11.2f}{p['demote_ratio']:>7.3f}"
                      f"{_disk(dd):>12}{(dd or {}).get('write_kib_per_io', 0):>8.0f}"
                      f"{d['promote_gbs']:>11.2f}{p['promote_ratio']:>7.3f}{_disk(pd):>12}"
                      f"{(pd or {}).get('read_kib_per_io', 0):>8.0f}{cpu:>20}")
    print("raw ratio: that raw run / the mean of the raw runs beside it; kvt ratio: the daemon run "
          "/ the mean of the raw runs beside it. busy: fraction of the phase with a request at "
          "the disk; depth: mean requests in flight (/sys/dev/block/*/stat); CPU: demote then "
          "promote phase")


def print_table(r: dict) -> None:
    print()
    print(f"NVMe tier vs raw O_DIRECT, {r['io_threads']} I/O threads, queue depth "
          f"{r['queue_depth']} (raw: as many jobs), CPU tier {r['cpu_bytes']}, "
          f"{format_size(r['bytes_per_size'])} per size, {r['repeat']} daemon runs each between two raw runs, "
          f"dir {r['dir']}")
    print(f"{'chunk':<7}{'demote GB/s':>12}{'raw write':>10}{'ratio med':>10}{'min':>8}  "
          f"{'raw self min':>12}  {'promote GB/s':>12}{'raw read':>9}{'ratio med':>10}{'min':>8}  "
          f"{'raw self min':>12}  {'misses':>6}{'O_DIRECT':>9}")
    for label, row in r["sizes"].items():
        dr, pr = row["demote_ratio"], row["promote_ratio"]
        sw, sr = row["raw_self_write_ratio"], row["raw_self_read_ratio"]
        print(f"{label:<7}{row['demote_gbs']['median']:>12.2f}{row['raw_write_gbs']:>10.2f}"
              f"{dr['median']:>9.3f}x{dr['min']:>7.3f}x{_flag(dr['min']):<2}"
              f"{_self(sw):>12}  "
              f"{row['promote_gbs']['median']:>12.2f}{row['raw_read_gbs']:>9.2f}"
              f"{pr['median']:>9.3f}x{pr['min']:>7.3f}x{_flag(pr['min']):<2}"
              f"{_self(sr):>12}  "
              f"{row['promote_misses']:>6}{'on' if row['direct_io'] else 'OFF':>9}")
    tools = {row["tool"] for row in r["sizes"].values()}
    print(f"GB/s are medians; each ratio is one daemon run / the mean of the raw runs beside it. raw: "
          f"{', '.join(sorted(tools))}; target: every run >= {TARGET} ('<' marks a min below). "
          "'raw self min': the lowest inner raw run / the mean of the raw runs beside it, the "
          "same ratio for the raw tool against itself (the disk's own noise)")
    print_runs(r)
    rs = r.get("restart")
    if rs:
        n = len(rs["full_start_s"])
        print(f"restart: {rs['indexed_chunks']} indexed chunks: first PING after "
              f"{rs['full_median_s']:.3f} s, empty index {rs['empty_median_s']:.3f} s (medians of "
              f"{n}) -> {rs['per_10k_s']:.3f} s per 10k chunks (best of {n}: "
              f"{rs['per_10k_min_s']:.3f} s; recovery in the daemon log: "
              f"{rs['recovery_log_per_10k_s']:.3f} s per 10k)")
    for note in r["notes"]:
        print("note:", note)
    print(f"elapsed {r['elapsed_s']:.0f} s")
