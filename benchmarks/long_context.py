"""Long-context plans (issue 15): the issue's cases, how long they take to plan, and the longest context that plans.

Run: `.venv/bin/python benchmarks/long_context.py [--longest] [--json FILE]`. Each case is traced and planned
from scratch in this process (tracing included, as `megatrain plan` does it), three times; the table gives the
median and the plan of the last round. `--longest` bisects, per hardware, the longest llama3-8b context (a
multiple of 16,384 tokens) that plans in the GPU budget. Nominal hardware presets: nothing here ran on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from megatrain.ir.trace import MAX_TOKENS
from megatrain.models import ModelConfig, preset
from megatrain.planner import InfeasiblePlanError, TrainSpec, plan
from megatrain.planner.loading import trace_model

CASES = [("llama2-7b", 262144, "h100-sxm", "80GiB"), ("llama3-8b", 524288, "h100-sxm", "80GiB"),
         ("llama3-8b", 1048576, "h200", None)]
STEP = 16384


def config(name: str, seq_len: int) -> ModelConfig:
    """The preset with max_seq_len raised to `seq_len`, as `{"base": name, "max_seq_len": seq_len}` gives."""
    return ModelConfig(**{**preset(name).model_dump(), "max_seq_len": max(seq_len, preset(name).max_seq_len)})


def plan_case(name: str, seq_len: int, hardware: str, budget: str | None):
    """(plan, trace seconds, total seconds) of tracing and planning one case from scratch."""
    t0 = time.perf_counter()
    ir = trace_model(config(name, seq_len), 1, seq_len, "bfloat16")
    t1 = time.perf_counter()
    p = plan(ir, hardware, TrainSpec(micro_batch=1, seq_len=seq_len), budget)
    return p, t1 - t0, time.perf_counter() - t0


def row(p, seconds: list[float], traced: list[float]) -> dict:
    ir = p.ir
    compute = sum(u.forward_s + u.backward_s for u in p.units)
    attn = sum(u.attn_flops_fwd + u.attn_flops_bwd for u in ir.units) / max(1, sum(u.flops_fwd + u.flops_bwd
                                                                                     for u in ir.units))
    return {"model": ir.model, "seq_len": ir.seq_len, "hardware": p.hardware.name,
            "budget_gib": round(p.gpu_budget_bytes / 2**30, 1), "chunk_tokens": ir.chunk_tokens,
            "peak_gib": round(p.peak_gpu_bytes / 2**30, 1), "host_gib": round(p.host_bytes / 2**30),
            "step_s": round(p.step_time_s, 1), "tokens_per_s": round(p.tokens_per_s),
            "mfu": round(p.mfu, 3), "bottleneck": f"{p.bottleneck} {p.bottleneck_share:.0%}",
            "critical_path_s": {k: round(v, 2) for k, v in p.critical_path_s.items()},
            "busy_s": {k: round(v, 2) for k, v in p.busy_s.items()},
            "compute_fwd_bwd_s": round(compute, 1), "attention_flop_share": round(attn, 3),
            "plan_seconds_median": round(statistics.median(seconds), 2),
            "trace_seconds_median": round(statistics.median(traced), 2), "traced_seq_len": ir.traced_seq_len}


def longest(name: str, hardware: str, budget: str | None) -> int:
    """The longest multiple of STEP tokens that plans."""
    lo, hi = 0, MAX_TOKENS // STEP  # lo plans (0: trivially), hi + 1 is the cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            plan_case(name, mid * STEP, hardware, budget)
            lo = mid
        except InfeasiblePlanError:
            hi = mid - 1
    return lo * STEP


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--longest", action="store_true", help="also bisect the longest llama3-8b context per GPU")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    plan_case("tiny", 128, "cpu", None)  # NOTE: the first trace in a process pays torch's one-time setup
    out = {"cases": [], "longest": []}
    for name, seq, hw, budget in CASES:
        secs, traced = [], []
        for _ in range(args.rounds):
            p, t_trace, t_all = plan_case(name, seq, hw, budget)
            secs.append(t_all)
            traced.append(t_trace)
        out["cases"].append(row(p, secs, traced))
        print(json.dumps(out["cases"][-1]))
    if args.longest:
        for hw, budget in (("h100-sxm", "80GiB"), ("h200", None)):
            seq = longest("llama3-8b", hw, budget)
            p, t_trace, t_all = plan_case("llama3-8b", seq, hw, budget)
            out["longest"].append({**row(p, [t_all], [t_trace]), "cap": seq + STEP > MAX_TOKENS})
            print(json.dumps(out["longest"][-1]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
