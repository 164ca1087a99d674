"""The planner's schedule against fixed rules a user would otherwise write, measured over a grid of budgets
(issue 20).

Run: `.venv/bin/python benchmarks/bench_heuristics.py` (about 15 minutes on 2 shared cores; `--budgets
56,80,120,300`, `--rounds`, `--steps`, `--model`, `--out FILE.json`). Model `small`, 4 micro-batches of 2 x 128
tokens, fp32, AdamW with clipping, sim device. Per budget, three schedules run the same program machinery,
differing only in the decisions the checkpoints pass makes (megatrain/planner/passes.py):

- `planner`: the planner's own (slots, gradient slots and per-unit checkpoint placement by its search);
- `every-4th`: every 4th block's checkpoint stays on the device, the others go to host (the rule of reference
  code that checkpoints every k-th block, k = 4), 2 parameter slots, 1 gradient slot, nothing kept: every
  unit recomputes its forward in the backward;
- `all-host`: every checkpoint on host, 2 parameter slots (1 if 2 do not fit), 1 gradient slot, nothing kept.

A rule whose program does not fit the budget is reported as such. Each is measured, not predicted: the
steady period between the final states (host optimizer done) of back-to-back steps, the schedules' steps
interleaved round-robin within a budget so their ratios share the machine load. Prints per budget the
measured seconds per step and each rule's time over the planner's (> 1: the planner is faster).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

from megatrain.ir.trace import trace
from megatrain.models import preset
from megatrain.planner import TrainSpec, hardware_preset
from megatrain.planner import passes as P
from megatrain.planner.costs import CostModel
from megatrain.planner.plan import PassRecord, Plan
from megatrain.planner.report import plan_fields
from megatrain.planner.schedule import Decisions
from megatrain.runtime.config import RunConfig
from megatrain.runtime.trainer import Trainer

MiB = 2**20
SPEC = TrainSpec(micro_batch=2, seq_len=128, grad_accum=4, dtype="fp32", lr=1e-3, clip_norm=1.0, total_steps=10**4)


def fixed_plan(ir, hw, train: TrainSpec, budget: int, dec: Decisions) -> Plan:
    """The planner's passes with the checkpoints pass replaced by `dec` (raises if it does not fit)."""
    state = P.State(ir=ir, hw=hw, train=train, budget=budget, costs=CostModel(ir, hw))
    records = []
    for name, fn in P.PASSES:
        if name == "checkpoints":
            state, lines = dataclasses.replace(state, decisions=dec), ["fixed rule"]
        else:
            state, lines = fn(state)
        if lines is not None:  # a pass with nothing to decide records nothing (passes.plan)
            records.append(PassRecord(name=name, decisions=tuple(lines), seconds=0.0))
    return Plan(**plan_fields(state, tuple(records), 0.0))


def rules(ir) -> dict[str, list[Decisions]]:
    """Each rule's decisions, most memory first (the first that fits is used)."""
    blocks = [i for i, u in enumerate(ir.units) if u.kind == "block"]
    every4 = tuple("device" if not u.carry_in or (i in blocks and blocks.index(i) % 4 == 0) else "host"
                   for i, u in enumerate(ir.units))
    host = tuple("host" if u.carry_in else "device" for u in ir.units)
    return {"every-4th": [Decisions(2, 1, every4), Decisions(1, 1, every4)],
            "all-host": [Decisions(2, 1, host), Decisions(1, 1, host)]}


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    shape = (SPEC.micro_batch, SPEC.seq_len)
    return [(torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
            for _ in range(SPEC.grad_accum)]


def _period(tr: Trainer, batch, n: int) -> float:
    first = tr.engine.step_index
    for _ in range(n + 1):
        tr.train_step(batch)
    tr.device.synchronize()
    finals = [tr.engine.final_time(first + k) for k in range(n + 1)]
    return statistics.median(b - a for a, b in zip(finals, finals[1:]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--budgets", default="56,80,120,300", help="MiB, comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds after a warm-up round")
    ap.add_argument("--steps", type=int, default=2, help="steady periods per schedule per round")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the main thread and the sim "
                    "device's compute stream (default 1: see docs/RESULTS.md on oversubscribed cores)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)  # the sim device's compute stream takes this count too
    hw = hardware_preset("cpu")
    ir = trace(preset(args.model), SPEC.micro_batch, SPEC.seq_len, SPEC.dtype, target="cpu")
    batch = _batch(preset(args.model).vocab_size)
    results = []
    t0 = time.perf_counter()
    for mib in [int(b) for b in args.budgets.split(",")]:
        budget = mib * MiB
        plans = {"planner": P.plan(ir, hw, SPEC, budget)}
        for name, options in rules(ir).items():
            for dec in options:
                try:
                    plans[name] = fixed_plan(ir, hw, SPEC, budget, dec)
                    break
                except ValueError:
                    continue
        run = RunConfig(model=args.model, train=SPEC, gpu_mem=budget, hardware=hw, device="sim")
        trainers = {k: Trainer(run, plan=p) for k, p in plans.items()}
        times: dict[str, list[float]] = {k: [] for k in trainers}
        try:
            for r in range(args.rounds + 1):
                for k, tr in trainers.items():
                    t = _period(tr, batch, args.steps)
                    if r:
                        times[k].append(t)
        finally:
            for tr in trainers.values():
                tr.close()
        row = {"budget_mib": mib}
        for k, p in plans.items():
            place = {c: sum(1 for v in p.placement.values() if v == c) for c in ("device", "host", "keep")}
            row[k] = {"measured_s": statistics.median(times[k]), "predicted_s": p.step_time_s,
                      "slots": p.n_slots, "placement": place}
        for k in plans:
            if k != "planner":
                row[k]["over_planner"] = row[k]["measured_s"] / row["planner"]["measured_s"]
        for k in rules(ir):
            row.setdefault(k, None)
        results.append(row)
        print(json.dumps(row), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print("\n| budget | planner s/step (slots; ckpt device/host/keep) | every-4th s/step | over planner "
          "| all-host s/step | over planner |\n|---|---|---|---|---|---|")
    for row in results:
        pl = row["planner"]
        cells = [f"{row['budget_mib']} MiB",
                 f"{pl['measured_s']:.2f} ({pl['slots']}; {'/'.join(str(v) for v in pl['placement'].values())})"]
        for k in ("every-4th", "all-host"):
            x = row[k]
            cells += ["does not fit", "-"] if x is None else [f"{x['measured_s']:.2f}", f"**{x['over_planner']:.2f}**"]
        print("| " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
