"""Attention replay at long context: the planner's schedule, whose recomputes replay the fused attention from
records kept with the checkpoints (megatrain/models/replay.py), against the same schedule without replay, measured.

Run: `.venv/bin/python benchmarks/bench_replay.py` (about 10 minutes on 2 shared cores; `--model`, `--seq`,
`--budget-factor`, `--rounds`, `--steps`, `--threads`, `--out FILE.json`). One micro-batch of 1 x seq tokens,
fp32, AdamW with clipping, sim device, the `cpu` hardware preset, a budget of `--budget-factor` times the
least workable one (so checkpoints stream to host and blocks recompute). Both schedules are the planner's
passes with the same slots, gradient slots and checkpoint placement; the second drops `Decisions.replay`
(bench_heuristics.fixed_plan). Measured: the steady period between the final states (host optimizer done) of
back-to-back steps, the two interleaved round by round; the final weights of the two are checked equal bit
for bit first. Prints each one's measured and predicted seconds per step and the ratios. Figures:
docs/RESULTS.md, "Attention replay".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch
from bench_heuristics import _period, fixed_plan

from megatrain.ir.trace import trace
from megatrain.models import preset
from megatrain.planner import InfeasiblePlanError, TrainSpec, hardware_preset
from megatrain.planner import passes as P
from megatrain.planner.schedule import Decisions
from megatrain.runtime.config import RunConfig
from megatrain.runtime.trainer import Trainer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--budget-factor", type=float, default=1.25)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds after a warm-up round")
    ap.add_argument("--steps", type=int, default=1, help="steady periods per schedule per round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = preset(args.model).model_copy(update={"max_seq_len": max(args.seq, preset(args.model).max_seq_len)})
    spec = TrainSpec(micro_batch=1, seq_len=args.seq, grad_accum=1, dtype="fp32", lr=1e-3, clip_norm=1.0,
                     total_steps=10**4)
    hw = hardware_preset("cpu")
    ir = trace(config, 1, args.seq, "fp32", target="cpu")
    try:
        P.plan(ir, hw, spec, 1)
    except InfeasiblePlanError as e:
        budget = int(e.needed_bytes * args.budget_factor)
    planned = P.plan(ir, hw, spec, budget)
    dec = Decisions(planned.n_slots, planned.n_grad_slots, tuple(planned.placement[u.name] for u in ir.units),
                    replay=tuple(u.replay for u in planned.units))
    if not any(dec.replay):
        raise SystemExit(f"the planner replays no unit at {budget / 2**20:.0f} MiB; lower --budget-factor")
    plans = {"replay": fixed_plan(ir, hw, spec, budget, dec),
             "no replay": fixed_plan(ir, hw, spec, budget, dataclasses.replace(dec, replay=()))}
    g = torch.Generator().manual_seed(0)
    batch = [tuple(torch.randint(0, config.vocab_size, (1, args.seq), generator=g) for _ in range(2))]
    run = RunConfig(model=config, train=spec, gpu_mem=budget, hardware=hw, device="sim")
    trainers = {k: Trainer(run, plan=p) for k, p in plans.items()}
    times: dict[str, list[float]] = {k: [] for k in trainers}
    t0 = time.perf_counter()
    try:
        for r in range(args.rounds + 1):
            for k, tr in trainers.items():
                t = _period(tr, batch, args.steps)
                if r:
                    times[k].append(t)
            if r == 0:  # same batches, same steps so far: the same weights, bit for bit
                a, b = (tr.store.named_master() for tr in trainers.values())
                assert all(torch.equal(a[n], b[n]) for n in a), "replay changed the weights"
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items() if v),
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        for tr in trainers.values():
            tr.close()
    row = {k: {"measured_s": statistics.median(times[k]), "predicted_s": plans[k].step_time_s,
               "periods": times[k]} for k in plans}
    ratios = [n / r for n, r in zip(times["no replay"], times["replay"])]
    out = {"model": args.model, "seq": args.seq, "budget_mib": budget / 2**20, "threads": args.threads,
           "replaying_units": sum(dec.replay), "host_placed": sum(p == "host" for p in dec.placement),
           "rows": row, "measured_ratio": statistics.median(ratios), "ratios": ratios,
           "predicted_ratio": plans["no replay"].step_time_s / plans["replay"].step_time_s}
    print(f"{args.model}, 1 x {args.seq} tokens, fp32, budget {budget / 2**20:.0f} MiB, {args.threads} thread(s); "
          f"{out['replaying_units']} units replay, {out['host_placed']} checkpoints on host")
    print("\n| schedule | measured s/step | predicted s/step |\n|---|---|---|")
    for k, v in row.items():
        print(f"| {k} | {v['measured_s']:.2f} | {v['predicted_s']:.2f} |")
    print(f"\nno replay / replay: measured {out['measured_ratio']:.3f} (per round {', '.join(f'{x:.3f}' for x in ratios)}), "
          f"predicted {out['predicted_ratio']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
