"""Predicted against measured steady-state step time, planned with a probe of this machine (issue 20).

Run: `.venv/bin/python benchmarks/bench_prediction.py` (about 10 minutes on 2 shared CPU cores; `--cases
tiny-1,small-4` picks cases, `--steps`, `--rounds`, `--repeats`, `--out FILE.json`). For each case it probes
the model's units on the sim device (`probe_hardware`, what `megatrain probe --model` runs; cached under
$MEGATRAIN_PROFILES when set), plans with that profile, and measures the steady step time of the plan's
program: the time between the final states (host optimizer done) of consecutive steps, median over the
steps after a warm-up. The cases' steps are interleaved round-robin (one step of each case per round), so
each ratio is taken under the same machine load; the probe of each case runs just before the rounds.
Prints a markdown table: predicted ms, measured median ms, measured/predicted, and the spread (min-max of
per-round ratios over rounds of `--steps` steps).

`--reprobe` separates the cost model's error from the machine's drift: before each measured round of a case
its units are probed again (not cached) and the plan's own program is priced with that fresh profile
(estimate_time, the planner's estimator); the table then also gives the median of measured over
fresh-probe predicted per round. The plan, and the headline ratio, stay those of the first probe.

NOTE: on the sim device the streams share the host's cores, so the measured step depends on what else the
machine runs; the probe measures the same machine's slowdowns (planner/contention.py), not another's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack

import torch

from megatrain.ir.trace import trace
from megatrain.models import ModelConfig, preset
from megatrain.planner import TrainSpec
from megatrain.planner.costs import CostModel
from megatrain.planner.estimate import estimate_time
from megatrain.planner.probe import probe
from megatrain.runtime.trainer import Trainer
from megatrain.runtime.unit_probe import cached_hardware, probe_hardware, probe_threads

MiB = 2**20


def _mixing() -> ModelConfig:
    return ModelConfig(**{**preset("tiny").model_dump(), "name": "tiny-hc4", "n_layers": 4, "depth_mixing": "hc:4"})


# name -> (model, micro_batch, seq_len, grad_accum, budget bytes)
CASES = {
    "tiny-1": ("tiny", 2, 64, 1, 6 * MiB),
    "tiny-4": ("tiny", 2, 64, 4, 6 * MiB),
    "tiny-whole": ("tiny", 2, 64, 4, 64 * MiB),
    "small-1": ("small", 2, 128, 1, 56 * MiB),
    "small-4": ("small", 2, 128, 4, 56 * MiB),
    "small-whole": ("small", 2, 128, 4, 300 * MiB),
    "hc4-4": ("hc", 2, 64, 4, 10 * MiB),
    "hc4-1": ("hc", 2, 64, 1, 10 * MiB),
    "moe-4": ("moe-tiny", 2, 64, 4, 8 * MiB),
    "moe-1": ("moe-tiny", 2, 64, 1, 8 * MiB),
}


def _config(name: str):
    return _mixing() if name == "hc" else preset(name)


def _spec(mb: int, seq: int, accum: int) -> TrainSpec:
    return TrainSpec(micro_batch=mb, seq_len=seq, grad_accum=accum, dtype="fp32", lr=1e-3, clip_norm=1.0,
                     total_steps=10**4)


def _batch(vocab: int, mb: int, seq: int, accum: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (mb, seq), generator=g), torch.randint(0, vocab, (mb, seq), generator=g))
            for _ in range(accum)]


def _traced(config, spec: TrainSpec):
    return trace(config, spec.micro_batch, spec.seq_len, spec.dtype, target="cpu")


def _probed(config, spec: TrainSpec, machine, repeats: int):
    """This machine's profile with the model's unit profile (cached one if there is one)."""
    ir = _traced(config, spec)
    hw = cached_hardware(ir, "sim", probe_threads("sim"))
    return hw if hw is not None else probe_hardware(ir, machine, "sim", repeats=repeats)


def _fresh_prediction(run: dict, machine, repeats: int) -> float:
    """The plan's program priced with a unit profile measured now (not cached)."""
    p = run["trainer"].plan
    hw = probe_hardware(run["ir"], machine, "sim", repeats=repeats, cache=False)
    return estimate_time(p.program, CostModel(p.ir, hw, p.host_policy, p.train.clip_norm is not None)).step_time_s


def _mark(ratio: float) -> str:
    """A measured/predicted ratio, bold when within the 10% target."""
    return f"**{ratio:.2f}**" if abs(ratio - 1) <= 0.10 else f"{ratio:.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    ap.add_argument("--steps", type=int, default=4, help="steps per case per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds after one warm-up round")
    ap.add_argument("--repeats", type=int, default=5, help="probe repeats per op")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the main thread and the sim "
                    "device's compute stream (default 1: see docs/RESULTS.md on oversubscribed cores)")
    ap.add_argument("--reprobe", action="store_true", help="probe each case again before each measured round "
                    "and report measured over that fresh prediction too")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)  # the sim device's compute stream takes this count too
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}")
    machine = probe(device="cpu", quick=True)
    t0 = time.perf_counter()
    with ExitStack() as stack:
        runs = {}
        for name in names:
            model, mb, seq, accum, budget = CASES[name]
            config, spec = _config(model), _spec(mb, seq, accum)
            hw = _probed(config, spec, machine, args.repeats)
            tr = stack.enter_context(Trainer(config, spec, budget, hardware=hw, device="sim"))
            if tr.plan.hardware.units is None:
                raise SystemExit(f"{name}: the plan did not use the unit profile")
            runs[name] = {"trainer": tr, "batch": _batch(config.vocab_size, mb, seq, accum, 0), "ratios": [],
                          "times": [], "ir": _traced(config, spec), "fresh": []}
            print(f"{name}: {tr.plan.ir.model} mb {mb} x {seq}, {accum} micro-batch(es), budget "
                  f"{budget / MiB:.0f} MiB, {tr.plan.n_slots} slot(s), predicted "
                  f"{tr.plan.step_time_s * 1e3:.1f} ms", flush=True)
        for r in range(args.rounds + 1):
            for run in runs.values():
                tr = run["trainer"]
                fresh = _fresh_prediction(run, machine, args.repeats) if r and args.reprobe else None
                first = tr.engine.step_index
                for _ in range(args.steps + 1):
                    tr.train_step(run["batch"])
                tr.device.synchronize()
                finals = [tr.engine.final_time(first + k) for k in range(args.steps + 1)]
                periods = [b - a for a, b in zip(finals, finals[1:])]
                if r:  # round 0 warms up
                    run["times"] += periods
                    run["ratios"].append(statistics.median(periods) / tr.plan.step_time_s)
                    if fresh is not None:
                        run["fresh"].append(statistics.median(periods) / fresh)
            print(f"round {r} done ({time.perf_counter() - t0:.0f} s)", flush=True)
        rows = []
        for name, run in runs.items():
            tr = run["trainer"]
            p = tr.plan
            measured = statistics.median(run["times"])
            rows.append({"case": name, "model": p.ir.model, "micro_batch": p.train.micro_batch,
                         "seq_len": p.train.seq_len, "grad_accum": p.train.grad_accum,
                         "budget_mib": CASES[name][4] / MiB, "slots": p.n_slots,
                         "predicted_ms": p.step_time_s * 1e3, "measured_ms": measured * 1e3,
                         "ratio": measured / p.step_time_s, "ratio_min": min(run["ratios"]),
                         "ratio_max": max(run["ratios"]),
                         "fresh_ratio": statistics.median(run["fresh"]) if run["fresh"] else None,
                         "fresh_ratios": run["fresh"]})
    fresh = " | measured/fresh-probe predicted (median; per round) |" if args.reprobe else " |"
    print("\n| case | model | micro-batches | budget | slots | predicted ms | measured ms | measured/predicted "
          f"| per-round range{fresh}\n|---|---|---|---|---|---|---|---|---|{'---|' if args.reprobe else ''}")
    for x in rows:
        extra = (f" {x['fresh_ratio']:.2f}; {', '.join(f'{v:.2f}' for v in x['fresh_ratios'])} |"
                 if args.reprobe else "")
        print(f"| {x['case']} | {x['model']} | {x['grad_accum']} x {x['micro_batch']}x{x['seq_len']} | "
              f"{x['budget_mib']:.0f} MiB | {x['slots']} | {x['predicted_ms']:.1f} | {x['measured_ms']:.1f} | "
              f"{_mark(x['ratio'])} | {x['ratio_min']:.2f}-{x['ratio_max']:.2f} |{extra}")
    within = sum(abs(x["ratio"] - 1) <= 0.10 for x in rows)
    print(f"\nwithin 10% (bold): {within} of {len(rows)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
