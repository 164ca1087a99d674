"""Predicted against measured steady-state step time, planned with a probe of this machine (issue 20).

Run: `.venv/bin/python benchmarks/bench_prediction.py` (about 10 minutes on 2 shared CPU cores; `--cases
tiny-1,small-4` picks cases, `--steps`, `--rounds`, `--repeats`, `--out FILE.json`). For each case it probes
the model's units on the sim device (`probe_hardware`, what `megatrain probe --model` runs; cached under
$MEGATRAIN_PROFILES when set), plans with that profile, and measures the steady step time of the plan's
program: the time between the final states (host optimizer done) of consecutive steps, median over the
steps after a warm-up. Each case runs in a process of its own (`--worker`), as a user runs one Trainer: with
all ten Trainers in one process, `small`'s steps measured 1.12-1.13 of their prediction where the small cases
alone measured 1.05-1.08 (cause not isolated: fifty stream threads in one process). The cases' rounds are
interleaved round-robin, so each ratio is taken under the same machine load; the cases probe one after
another, before the rounds.
Prints a markdown table: predicted ms, measured median ms, measured/predicted, and the spread (min-max of
per-round ratios over rounds of `--steps` steps).

`--reprobe` separates the cost model's error from the machine's drift: before each measured round of a case
its units are probed again (not cached) and the plan's own program is priced with that fresh profile
(estimate_time, the planner's estimator); the table then also gives the median of measured over
fresh-probe predicted per round. The plan, and the headline ratio, stay those of the first probe.

NOTE: on the sim device the streams share the host's cores, so the measured step depends on what else the
machine runs; the probe measures the same machine's slowdowns (megatrain/planner/contention.py), not another's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from megatrain.ir.trace import trace
from megatrain.models import ModelConfig, preset
from megatrain.planner import TrainSpec
from megatrain.planner.costs import CostModel
from megatrain.planner.estimate import estimate_time
from megatrain.runtime.config import RunConfig
from megatrain.runtime.machine_probe import probe
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
    "small-res-1": ("small", 2, 128, 1, 300 * MiB),
    "small-res-4": ("small", 2, 128, 4, 300 * MiB),
}
# where the units' state lives (RunConfig.resident); the others plan with the default, auto. On the sim device
# the compute binds small, so auto streams every unit: these cases force the first units' state onto the
# device (issue 40), their optimizer step a device_step on the compute stream
RESIDENT = {"small-res-1": 4, "small-res-4": 4}


def _resident(name: str, ir) -> str | dict:
    count = RESIDENT.get(name)
    return "auto" if count is None else {u.name: "device" for u in ir.units[:count]}


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


def _worker(name: str, threads: int, repeats: int, steps: int) -> None:
    """One case in a process of its own, as a user runs one Trainer: probe (or the cached probe), plan, then for
    each line `round` or `reprobe` on stdin run one round of `steps` + 1 steps and answer a JSON line on
    stdout (the steady periods, and with `reprobe` the plan's program priced with a probe measured just before)."""
    torch.set_num_threads(threads)  # the sim device's compute stream takes this count too
    model, mb, seq, accum, budget = CASES[name]
    config, spec = _config(model), _spec(mb, seq, accum)
    machine = probe(device="cpu", quick=True)
    hw = _probed(config, spec, machine, repeats)
    resident = _resident(name, _traced(config, spec))
    with Trainer(RunConfig(model=config, train=spec, gpu_mem=budget, hardware=hw, device="sim",
                           resident=resident)) as tr:
        if tr.plan.hardware.units is None:
            raise SystemExit(f"{name}: the plan did not use the unit profile")
        run = {"trainer": tr, "ir": _traced(config, spec)}
        batch = _batch(config.vocab_size, mb, seq, accum, 0)
        p = tr.plan
        print(json.dumps({"model": p.ir.model, "micro_batch": mb, "seq_len": seq, "grad_accum": accum,
                          "budget_mib": budget / MiB, "slots": p.n_slots, "predicted_s": p.step_time_s,
                          "resident": len(p.resident_units)}), flush=True)
        for line in sys.stdin:
            fresh = _fresh_prediction(run, machine, repeats) if line.strip() == "reprobe" else None
            first = tr.engine.step_index
            for _ in range(steps + 1):
                tr.train_step(batch)
            tr.device.synchronize()
            finals = [tr.engine.final_time(first + k) for k in range(steps + 1)]
            print(json.dumps({"periods": [b - a for a, b in zip(finals, finals[1:])], "fresh_s": fresh}), flush=True)


class _Case:
    """A worker process (`--worker NAME`) and what it answered."""

    def __init__(self, name: str, args):
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", name, "--threads", str(args.threads), "--repeats",
             str(args.repeats), "--steps", str(args.steps)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._answer()
        self.times: list[float] = []
        self.ratios: list[float] = []
        self.fresh: list[float] = []

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.name}: the worker ended (exit {self.proc.wait()})")
        return json.loads(line)

    def round(self, reprobe: bool, measured: bool) -> None:
        self.proc.stdin.write("reprobe\n" if reprobe else "round\n")
        self.proc.stdin.flush()
        got = self._answer()
        if measured:  # round 0 warms up
            med = statistics.median(got["periods"])
            self.times += got["periods"]
            self.ratios.append(med / self.info["predicted_s"])
            if got["fresh_s"] is not None:
                self.fresh.append(med / got["fresh_s"])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


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
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.threads, args.repeats, args.steps)
        return 0
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}")
    t0 = time.perf_counter()
    cases: list[_Case] = []
    try:
        for name in names:  # one at a time: each probes while the others wait
            c = _Case(name, args)
            cases.append(c)
            i = c.info
            print(f"{name}: {i['model']} mb {i['micro_batch']} x {i['seq_len']}, {i['grad_accum']} micro-batch(es), "
                  f"budget {i['budget_mib']:.0f} MiB, {i['slots']} slot(s), {i['resident']} resident unit(s), "
                  f"predicted {i['predicted_s'] * 1e3:.1f} ms", flush=True)
        for r in range(args.rounds + 1):
            for c in cases:
                c.round(reprobe=bool(r) and args.reprobe, measured=bool(r))
            print(f"round {r} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        for c in cases:
            c.close()
    rows = []
    for c in cases:
        i, measured = c.info, statistics.median(c.times)
        rows.append({"case": c.name, "model": i["model"], "micro_batch": i["micro_batch"], "seq_len": i["seq_len"],
                     "grad_accum": i["grad_accum"], "budget_mib": i["budget_mib"], "slots": i["slots"],
                     "resident": i["resident"],
                     "predicted_ms": i["predicted_s"] * 1e3, "measured_ms": measured * 1e3,
                     "ratio": measured / i["predicted_s"], "ratio_min": min(c.ratios), "ratio_max": max(c.ratios),
                     "fresh_ratio": statistics.median(c.fresh) if c.fresh else None, "fresh_ratios": c.fresh})
    fresh = " | measured/fresh-probe predicted (median; per round) |" if args.reprobe else " |"
    print("\n| case | model | micro-batches | budget | slots | resident | predicted ms | measured ms | measured/predicted "
          f"| per-round range{fresh}\n|---|---|---|---|---|---|---|---|---|---|{'---|' if args.reprobe else ''}")
    for x in rows:
        extra = (f" {x['fresh_ratio']:.2f}; {', '.join(f'{v:.2f}' for v in x['fresh_ratios'])} |"
                 if args.reprobe else "")
        print(f"| {x['case']} | {x['model']} | {x['grad_accum']} x {x['micro_batch']}x{x['seq_len']} | "
              f"{x['budget_mib']:.0f} MiB | {x['slots']} | {x['resident']} | {x['predicted_ms']:.1f} | {x['measured_ms']:.1f} | "
              f"{_mark(x['ratio'])} | {x['ratio_min']:.2f}-{x['ratio_max']:.2f} |{extra}")
    within = sum(abs(x["ratio"] - 1) <= 0.10 for x in rows)
    print(f"\nwithin 10% (bold): {within} of {len(rows)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
