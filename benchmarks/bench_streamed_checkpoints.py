"""Checkpoints written while training goes on (issue 41): step time with a checkpoint every step against none.

One Trainer on the sim device, one process, its checkpoints in a folder on tmpfs (a disk fast enough: the
figure is what the writes cost the step, not what a disk costs): rounds of `--block` steps alternate between
`checkpoint_every=1` (each step writes the previous step's checkpoint, planner/checkpoint_writes.py) and none,
the order flipping each round, so both see the same machine. Compared: the mean step time (metrics' step_time_s,
which add up to the wall time) of the steps that wrote a checkpoint against that of the plain steps of the same
round, less each block's first step (the block before it ended with a synchronous save or none).

Run: `.venv/bin/python benchmarks/bench_streamed_checkpoints.py` (about 2 minutes on 2 cores; `--seq-len`,
`--micro-batch`, `--rounds`, `--block`, `--dir`). Results: docs/RESULTS.md, "Checkpoints written while training".
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--gpu-mem", default="64MiB")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from megatrain.planner.checkpoint_writes import checkpoint_cost
    from megatrain.runtime.build import default_corpus
    from megatrain.runtime.config import RunConfig
    from megatrain.runtime.trainer import Trainer

    folder = Path(tempfile.mkdtemp(prefix="mt-bench-ck-", dir=args.dir))
    total = 2 + 2 * args.rounds * args.block  # and two warm-up steps
    data, val = default_corpus(args.model)
    cfg = RunConfig.from_settings({"model": args.model, "device": "sim", "gpu-mem": args.gpu_mem, "seq-len":
                                   args.seq_len, "micro-batch": args.micro_batch, "dtype": "fp32", "steps": total,
                                   "data": str(data), "checkpoint-dir": str(folder), "checkpoint-every": 1,
                                   "keep-checkpoints": 2, "no-progress": True})
    times: dict[str, list[float]] = {"checkpoint": [], "plain": []}
    try:
        with Trainer(cfg) as t:
            t.run(2, progress=False, log_every=1)  # warm-up
            for r in range(args.rounds):
                for kind in (("checkpoint", "plain") if r % 2 == 0 else ("plain", "checkpoint")):
                    t.checkpoints.every = 1 if kind == "checkpoint" else 0
                    recs = t.run(args.block, progress=False, log_every=1)
                    times[kind] += [rec["step_time_s"] for rec in recs[1:]]
            cost = checkpoint_cost(t.plan)
            nbytes = t.checkpoint_bytes()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    ck, plain = statistics.mean(times["checkpoint"]), statistics.mean(times["plain"])
    row = {"model": args.model, "tokens_per_step": args.seq_len * args.micro_batch, "checkpoint_bytes": nbytes,
           "steps_each": len(times["plain"]), "plain_mean_s": plain, "checkpoint_mean_s": ck,
           "plain_median_s": statistics.median(times["plain"]), "checkpoint_median_s": statistics.median(times["checkpoint"]),
           "ratio": ck / plain, "planned_extra_s": cost.extra_s, "planned_step_s": cost.step_s, "dir": str(args.dir)}
    print(f"| {args.model} | {row['tokens_per_step']} | {nbytes / 2**20:.1f} MiB | {plain * 1e3:.1f} ms | "
          f"{ck * 1e3:.1f} ms | {row['ratio']:.3f} | {len(times['plain'])} + {len(times['checkpoint'])} |")
    if args.out:
        Path(args.out).write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
