"""Routing quality at small scale: dense, token choice (aux loss, bias balancing) and Expert Threshold.

Run: `.venv/bin/python benchmarks/quality_moe.py` (about 10 minutes on 2 CPU cores; `--steps`, `--seeds` and
`--routers` shrink it; `--json FILE` keeps the per-run figures). Results: docs/RESULTS.md, "Mixture-of-experts
routing".

Every run trains with megatrain's streamed runtime (Trainer, sim device) on the built-in corpus (byte tokens),
the same tokens in the same order for every model of a seed, and reports the validation loss at the end,
load balance over the last tenth of the steps and the median tokens/s. Models, at matched active parameters
(the tiny preset's attention; the dense FFN is SwiGLU 352, 135,168 weights per block):
- dense: 4 dense blocks.
- tc-aux, tc-bias, et: block 0 dense, blocks 1-3 MoE with 8 ReLU² experts of width 256 (2d) + a shared one:
  top-1 routing gives 132,096 active FFN weights per block (router included), 98% of dense's.
  tc: sigmoid gate, top-1; aux: Switch loss, alpha 1e-2; bias: DeepSeek loss-free, u 1e-3.
  et: sigmoid gate, capacity factor 0.5, momentum 0.99 and expert-choice warmup for the first 20% of the
  steps (the paper's 0.999 and 4000 steps are windows longer than these runs).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from quality_runs import train_run

from megatrain.models import ModelConfig, preset
from megatrain.models.config import MoEConfig
from megatrain.models.moe import active_params
from megatrain.runtime.corpus import cached_default_corpus

ROUTERS = ("dense", "tc-aux", "tc-bias", "et")


def model(router: str, steps: int, et_momentum: float = 0.99, et_warmup: float = 0.2) -> ModelConfig:
    dense = preset("tiny")
    if router == "dense":
        return dense.model_copy(update={"name": "dense"})
    moe = {"n_experts": 8, "expert_dim": 256, "top_k": 1, "gate": "sigmoid"}
    moe |= {"tc-aux": {"router": "tc", "balance": "aux", "aux_loss_coef": 1e-2},
            "tc-bias": {"router": "tc", "balance": "bias", "bias_rate": 1e-3},
            "et": {"router": "et", "momentum": et_momentum, "warmup_steps": int(et_warmup * steps),
                   "capacity_factor": 0.5}}[router]
    return ModelConfig(**{**dense.model_dump(), "name": router, "moe": MoEConfig(**moe)})


def run(router: str, seed: int, steps: int, data, **et) -> dict:
    config = model(router, steps, **et)
    out, tail = train_run(config, seed, steps, data)
    out |= {"router": router, "active_params": active_params(config)}
    for key in ("moe_load_max_over_mean", "moe_experts_per_token", "moe_zero_expert_share", "moe_drop_rate",
                "moe_pad_rate"):
        if key in tail[0]:
            out[key] = statistics.mean(r[key] for r in tail)
    return out


def stat(runs: list[dict], key: str, fmt: str) -> str:
    """Mean ± standard deviation over seeds, or "-" where the runs lack the figure."""
    if key not in runs[0]:
        return "-"
    vals = [r[key] for r in runs]
    sd = f" ± {statistics.stdev(vals):{fmt}}" if len(vals) > 1 else ""
    return f"{statistics.mean(vals):{fmt}}{sd}"


def table(results: list[dict]) -> str:
    rows = ["| model | params (active) | val loss | max/mean load | experts/token | zero-expert | drop / pad "
            "| tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for router in dict.fromkeys(r["router"] for r in results):
        rs = [r for r in results if r["router"] == router]
        drop_pad = (f"{stat(rs, 'moe_drop_rate', '.3f')} / {stat(rs, 'moe_pad_rate', '.3f')}"
                    if "moe_drop_rate" in rs[0] else "-")
        rows.append(f"| {router} | {rs[0]['params'] / 1e6:.2f}M ({rs[0]['active_params'] / 1e6:.2f}M) | "
                    f"{stat(rs, 'val_loss', '.4f')} | {stat(rs, 'moe_load_max_over_mean', '.2f')} | "
                    f"{stat(rs, 'moe_experts_per_token', '.2f')} | {stat(rs, 'moe_zero_expert_share', '.2f')} | "
                    f"{drop_pad} | {stat(rs, 'tokens_per_s', ',.0f')} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--et-momentum", type=float, default=0.99, help="ET's EMA momentum (default 0.99)")
    ap.add_argument("--et-warmup", type=float, default=0.2, help="ET's expert-choice warmup, a fraction of --steps")
    ap.add_argument("--json", metavar="FILE", help="write every run's figures")
    args = ap.parse_args()
    torch.set_num_threads(1)  # NOTE: the cores are shared; one intra-op thread keeps the timings steady
    data = cached_default_corpus()
    results = []
    for seed in range(args.seeds):
        for router in args.routers.split(","):
            results.append(run(router, seed, args.steps, data, et_momentum=args.et_momentum,
                               et_warmup=args.et_warmup))
            r = results[-1]
            print(f"seed {seed} {router:8s} val {r['val_loss']:.4f} train {r['train_loss']:.4f} "
                  f"{r['tokens_per_s']:,.0f} tok/s ({r['seconds']:.0f} s)", flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
