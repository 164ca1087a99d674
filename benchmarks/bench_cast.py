"""The compute-dtype cast (fp32 masters -> bf16 for the link) per thread count: torch's copy_ against the C cast.

Run: `.venv/bin/python benchmarks/bench_cast.py` (about a minute; `--elements`, `--rounds`, `--threads`,
`--out FILE` for a JSON record). Results: docs/RESULTS.md, "Compute-dtype cast".

Each round times, at every thread count, a cast of `--elements` fp32 elements (64 MiB at the default 16M: a
unit's master, out of cache: a read-only sweep of twice the last-level cache runs first) into a bf16 buffer on
huge pages (after the sweep, OMP_SETTLE_S for its OpenMP team to stop spinning: megatrain/runtime/host_adamw.py), the
way each runs in training: torch's `dst.copy_(src)` with the thread count as its intra-op
threads, and megatrain/runtime/cast_kernel.py `cast` (the C loop split into that many pieces, the caller taking one).
Rounds interleave the two and every thread count, so a shared machine's drift moves both alike. Reported per
thread count and way: the median and the best round in G elements/s, and GB/s of memory traffic at 6 B per
element (read 4, write 2). The planner prices a load's host cast at the rate the probe measures at the h2d
worker's thread count (megatrain/runtime/machine_probe.py cast_fields: the best of its repeats, as here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megatrain.runtime import cast_kernel, cpus, host_memory
from megatrain.runtime.host_adamw import OMP_SETTLE_S


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--elements", type=int, default=1 << 24)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", default=None, help="thread counts, e.g. 1,2 (default: 1 .. the cores)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    top = cast_kernel.cpu_threads()
    counts = [int(x) for x in args.threads.split(",")] if args.threads else list(range(1, top + 1))
    n = args.elements
    src = host_memory.empty((n,), torch.float32).normal_()
    dst = host_memory.empty((n,), torch.bfloat16).zero_()
    flush = torch.ones(max(8 << 20, 2 * (cpus.largest_cache_bytes() or 0) // 4))
    ways = {"torch copy_": lambda k: dst.copy_(src), "C cast": lambda k: cast_kernel.cast(src, dst, k)}
    times: dict[tuple[str, int], list[float]] = {}
    own = torch.get_num_threads()
    for r in range(args.rounds + 1):  # the first round warms up (pages, the cast's pool threads)
        for k in counts:
            torch.set_num_threads(k)
            for way, run in ways.items():
                flush.sum()
                time.sleep(OMP_SETTLE_S)  # the flush's OpenMP team stops spinning on the cores the cast uses
                t = time.perf_counter()
                run(k)
                if r:
                    times.setdefault((way, k), []).append(time.perf_counter() - t)
    torch.set_num_threads(own)
    rows = []
    for (way, k), ts in times.items():
        med, best = n / statistics.median(ts) / 1e9, n / min(ts) / 1e9
        rows.append({"way": way, "threads": k, "median_g_per_s": med, "best_g_per_s": best,
                     "median_gb_per_s": 6 * med, "best_gb_per_s": 6 * best})
    from megatrain.runtime.unit_probe import device_name

    machine = f"{device_name('sim')}, torch {torch.__version__}, " \
              f"C cast {'on' if cast_kernel.available() else 'off: ' + str(cast_kernel.why_not())}"
    print(f"fp32 -> bf16 of {n:,} elements, {args.rounds} interleaved rounds; {machine}")
    print("| threads | way | median G elements/s | best | median GB/s (6 B each) | best |")
    print("|---|---|---|---|---|---|")
    for row in sorted(rows, key=lambda x: (x["threads"], x["way"])):
        print(f"| {row['threads']} | {row['way']} | {row['median_g_per_s']:.2f} | {row['best_g_per_s']:.2f} | "
              f"{row['median_gb_per_s']:.1f} | {row['best_gb_per_s']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"elements": n, "rounds": args.rounds, "machine": machine, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
