"""Routing study in the ET paper's regime as far as a CPU allows (issue 18, part 2): TC (aux loss, bias
balancing), EC evaluated causally from its own EMA cutoff, and ET, at routing pools of 1k, 4k (and 16k) tokens.

Run: `nice -n 19 .venv/bin/python benchmarks/study_moe.py --seeds 0,1,2` (resumable like study_depth_mixing.py:
finished runs are records in `--results`, default benchmarks/results/study_moe.jsonl; rerun to go on).
`--table` prints the tables from the results without training. Results: docs/RESULTS.md,
"Mixture-of-experts routing".

Model (as benchmarks/quality_moe.py): the tiny preset (d 128, 4 blocks); block 0 dense, blocks 1-3 MoE with
8 ReLU² experts of width 256 plus a shared one, sigmoid gate, top-1 (k = N/8 tokens per expert and pool).
Training (study_runs.py: Trainer, sim device): `--tokens` tokens a step (default 4,096 = 32 x 128), fp32,
AdamW lr 3e-3 (10% warmup, cosine to 0.1 lr), weight decay 0.1 on matrices (router and experts included),
clip 1.0. The routing pool is the micro-batch: pool P = P/128 sequences, grad_accum = tokens / P, so every
pool size of a seed trains on the same windows in the same order (the Batcher draws a step's windows in one
call) and only the pooling differs. Validation: 65,536 held-out tokens at 25/50/75/100% of the run, in eval
mode: ET and EC route by the pure test r >= c_eff (causal), TC by its top-1.

Arms:
- tc-aux: Switch aux loss, alpha 1e-2.
- tc-bias: DeepSeek loss-free bias, u = 2 / (0.1 x steps) (0.1 at 200 steps): b can move by 2 logits, the
  spread of the router's logits, within a tenth of the run (tests/models/test_moe.py checks the rate).
- ec: expert choice top-k over the pool in training; its EMA of the per-step k-th logits (momentum below)
  is its causal threshold at evaluation (the paper's evaluation of EC).
- et: EC warmup for the first 20% of the steps, then the threshold with capacity factor 0.5.
EMA momentum for ec and et: beta = 1 - 1 / (0.05 x steps), a window of 5% of the run (the paper's 0.999 over
about 19k steps). Per step the records keep the threshold lag (c_eff minus the pool's k-th logit, mean and
mean |.| over experts and MoE blocks), the threshold rate (pairs with r >= c_eff per target), experts per
token, max/mean load and drop/pad rates.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from study_runs import done, finish, paired, train

from megatrain.models import ModelConfig, preset
from megatrain.models.moe import MoEConfig, active_params
from megatrain.planner import TrainSpec
from megatrain.runtime.corpus import cached_default_corpus

ARMS = ("tc-aux", "tc-bias", "ec", "et")
ROOT = Path(__file__).resolve().parents[1]
SEQ = 128
VAL_TOKENS = 65_536
KEEP = ("moe_threshold_lag", "moe_threshold_lag_abs", "moe_threshold_rate", "moe_experts_per_token",
        "moe_load_max_over_mean", "moe_zero_expert_share", "moe_drop_rate", "moe_pad_rate")


def momentum(steps: int) -> float:
    return 1.0 - 1.0 / max(2.0, 0.05 * steps)


def bias_rate(steps: int) -> float:
    return 2.0 / (0.1 * steps)


def model(arm: str, steps: int) -> ModelConfig:
    dense = preset("tiny")
    moe = {"n_experts": 8, "expert_dim": 256, "top_k": 1, "gate": "sigmoid"}
    moe |= {"tc-aux": {"router": "tc", "balance": "aux", "aux_loss_coef": 1e-2},
            "tc-bias": {"router": "tc", "balance": "bias", "bias_rate": bias_rate(steps)},
            "ec": {"router": "ec", "momentum": momentum(steps), "ec_eval": "threshold"},
            "et": {"router": "et", "momentum": momentum(steps), "warmup_steps": int(0.2 * steps),
                   "capacity_factor": 0.5}}[arm]
    return ModelConfig(**{**dense.model_dump(), "name": arm, "moe": MoEConfig(**moe)})


def spec(steps: int, seed: int, pool: int, tokens: int) -> TrainSpec:
    assert pool % SEQ == 0 and tokens % pool == 0, (pool, tokens)
    return TrainSpec(micro_batch=pool // SEQ, seq_len=SEQ, grad_accum=tokens // pool, dtype="fp32", lr=3e-3,
                     warmup_steps=steps // 10, total_steps=steps, weight_decay=0.1, clip_norm=1.0, seed=seed)


def key(arm: str, pool: int, seed: int, steps: int, tokens: int) -> str:
    return f"{arm}|pool{pool}|seed{seed}|{steps}x{tokens}"


def evals(steps: int) -> list[int]:
    return sorted({max(1, round(steps * f)) for f in (0.25, 0.5, 0.75, 1.0)})


def keep(rec: dict) -> dict:
    return {k: round(rec[k], 5) for k in KEEP if k in rec}


def _tail(r: dict, k: str, frac: float = 0.1) -> float | None:
    """Mean of a per-step figure over the last `frac` of the run's steps."""
    steps = r["per_step"][-max(1, round(frac * len(r["per_step"]))):]
    vals = [s[k] for s in steps if k in s]
    return statistics.mean(vals) if vals else None


def _post_warmup(r: dict, k: str) -> float | None:
    """Mean of a per-step figure after the first 20% of the steps (ET's warmup)."""
    steps = [s for s in r["per_step"] if s["step"] > 0.2 * r["n_steps"]]
    vals = [s[k] for s in steps if k in s]
    return statistics.mean(vals) if vals else None


def _ms(vals: list[float | None], fmt: str) -> str:
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    sd = f" ± {statistics.stdev(vals):{fmt.lstrip('+')}}" if len(vals) > 1 else ""
    return f"{statistics.mean(vals):{fmt}}{sd}"


def table(recs: list[dict], ref: str = "tc-aux") -> str:
    """One row per (pool, arm): val loss (mean ± sd and per seed), paired Δ vs `ref` at the same pool (TC
    does not depend on the pool but for its aux statistics: a TC run of any pool of the seed is used when its
    own pool is missing), routing figures."""
    groups: dict[tuple[int, str], list[dict]] = {}
    for r in recs:
        groups.setdefault((r["pool"], r["arm"]), []).append(r)
    rows = ["| pool | arm | seeds | val loss | per seed | Δ vs tc-aux, paired (mean [95% CI]) | Δ vs ec | "
            "experts/token (last 10%) | max/mean load | threshold lag, post-warmup (mean / mean abs) | "
            "threshold rate | s/run |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def base(arm: str, pool: int, seed: int) -> float | None:
        same = [r for r in groups.get((pool, arm), []) if r["seed"] == seed]
        if not same and arm.startswith("tc"):
            same = [r for (p, a), rs in groups.items() if a == arm for r in rs if r["seed"] == seed]
        return same[0]["val_loss"] if same else None

    def delta(rs: list[dict], arm: str, pool: int) -> str:
        d = [r["val_loss"] - b for r in rs if (b := base(arm, pool, r["seed"])) is not None]
        if not d or rs[0]["arm"] == arm:
            return "-"
        m, lo, hi = paired(d)
        return f"{m:+.4f} [{lo:+.4f}, {hi:+.4f}]" if len(d) > 1 else f"{m:+.4f}"

    for (pool, arm) in sorted(groups, key=lambda g: (g[0], ARMS.index(g[1]))):
        rs = sorted(groups[pool, arm], key=lambda r: r["seed"])
        lag = (f"{_ms([_post_warmup(r, 'moe_threshold_lag') for r in rs], '+.3f')} / "
               f"{_ms([_post_warmup(r, 'moe_threshold_lag_abs') for r in rs], '.3f')}"
               if arm in ("ec", "et") else "-")
        rate = _ms([_post_warmup(r, "moe_threshold_rate") for r in rs], ".2f") if arm in ("ec", "et") else "-"
        per_seed = " / ".join(f"{r['val_loss']:.4f}" for r in rs)
        rows.append(f"| {pool:,} | {arm} | {','.join(str(r['seed']) for r in rs)} | "
                    f"{_ms([r['val_loss'] for r in rs], '.4f')} | {per_seed} | "
                    f"{delta(rs, 'tc-aux', pool)} | {delta(rs, 'ec', pool)} | "
                    f"{_ms([_tail(r, 'moe_experts_per_token') for r in rs], '.2f')} | "
                    f"{_ms([_tail(r, 'moe_load_max_over_mean') for r in rs], '.2f')} | {lag} | {rate} | "
                    f"{statistics.mean(r['seconds'] for r in rs):.0f} |")
    return "\n".join(rows)


def verdict(recs: list[dict]) -> str:
    """The decision rules of docs/RESULTS.md (fixed before the runs) applied to the finished runs: scale effect,
    threshold estimate at fault, ET beats token choice. The rules count seeds out of 3; with fewer seeds
    the figures are printed and the rule is reported as not applicable."""
    val = {(r["arm"], r["pool"], r["seed"]): r["val_loss"] for r in recs}
    runs = {(r["arm"], r["pool"], r["seed"]): r for r in recs}

    def tc(arm: str, pool: int, seed: int) -> float | None:  # as table(): a TC run of any pool of the seed
        if (arm, pool, seed) in val:
            return val[arm, pool, seed]
        return next((v for (a, _, s), v in sorted(val.items()) if a == arm and s == seed), None)

    def seeds_with(keys: list[tuple[str, int]]) -> list[int]:
        return sorted(s for s in {s for _, _, s in val}
                      if all((tc(a, p, s) if a.startswith("tc") else val.get((a, p, s))) is not None for a, p in keys))

    def get(a: str, p: int, s: int) -> float:
        return tc(a, p, s) if a.startswith("tc") else val[a, p, s]

    def fmt(d: list[float]) -> str:
        m, lo, hi = paired(d)
        return f"{m:+.4f} [{lo:+.4f}, {hi:+.4f}]" if len(d) > 1 else f"{m:+.4f}"

    out = []
    # 1. scale effect: (arm - tc-aux) smaller at 4k than at 1k, for ec and et, on the mean and >= 2 of 3 seeds
    parts, ok_all, n_min = [], True, 3
    for arm in ("ec", "et"):
        ss = seeds_with([(arm, 1024), (arm, 4096), ("tc-aux", 1024), ("tc-aux", 4096)])
        if not ss:
            parts.append(f"{arm}: no seed has both pools")
            ok_all, n_min = False, 0
            continue
        ch = [(get(arm, 4096, s) - get("tc-aux", 4096, s)) - (get(arm, 1024, s) - get("tc-aux", 1024, s)) for s in ss]
        k = sum(c < 0 for c in ch)
        ok_all &= statistics.mean(ch) < 0 and k >= 2
        n_min = min(n_min, len(ss))
        parts.append(f"{arm}: Δ(4k) - Δ(1k) = {fmt(ch)}, smaller at 4k on {k} of {len(ss)} seeds")
    res = ("supported" if ok_all else "NOT supported") if n_min >= 3 else \
        f"rule not applicable (needs 3 seeds, has {n_min}); as far as the rule's terms go: " + \
        ("consistent with it" if ok_all else "not consistent with it")
    out.append("scale effect: " + "; ".join(parts) + f" -> {res}")
    # 2. threshold estimate at fault: et above ec at both pools (mean, >= 2 of 3), and off target after warmup
    parts, above, n_min = [], True, 3
    for pool in (1024, 4096):
        ss = seeds_with([("et", pool), ("ec", pool)])
        if not ss:
            parts.append(f"pool {pool}: no seed has et and ec")
            above, n_min = False, 0
            continue
        d = [val["et", pool, s] - val["ec", pool, s] for s in ss]
        k = sum(x > 0 for x in d)
        above &= statistics.mean(d) > 0 and k >= 2
        n_min = min(n_min, len(ss))
        parts.append(f"pool {pool}: et - ec = {fmt(d)}, et above on {k} of {len(ss)}")
    ets = [r for (a, _, _), r in runs.items() if a == "et"]
    rate = [_post_warmup(r, "moe_threshold_rate") for r in ets]
    ept = [_post_warmup(r, "moe_experts_per_token") for r in ets]
    off = [abs(x - 1) > 0.1 or abs(y - 1) > 0.1 for x, y in zip(rate, ept, strict=True) if x is not None and y is not None]
    pairs = [(x, y) for x, y in zip(rate, ept, strict=True) if x is not None and y is not None]
    off_mean = bool(pairs) and (abs(statistics.mean(x for x, _ in pairs) - 1) > 0.1
                                or abs(statistics.mean(y for _, y in pairs) - 1) > 0.1)
    parts.append(f"et after warmup: threshold rate {_ms(rate, '.3f')}, experts/token {_ms(ept, '.3f')} (mean over "
                 f"runs {'off' if off_mean else 'on'} target, > 0.1 from 1 in {sum(off)} of {len(off)} runs)")
    fault = above and off_mean
    res = ("supported" if fault else "NOT supported") if n_min >= 3 else \
        f"rule not applicable (needs 3 seeds, has {n_min}); as far as the rule's terms go: " + \
        ("consistent with it" if fault else "not consistent with it")
    out.append("threshold estimate at fault: " + "; ".join(parts) + f" -> {res}")
    # 3. ET beats token choice: et - tc-aux and et - tc-bias with a paired 95% interval entirely below 0
    for pool in (1024, 4096):
        parts, beats = [], True
        for ref in ("tc-aux", "tc-bias"):
            ss = seeds_with([("et", pool), (ref, pool)])
            if len(ss) < 2:
                parts.append(f"et - {ref}: {len(ss)} seed(s)")
                beats = False
                continue
            d = [val["et", pool, s] - get(ref, pool, s) for s in ss]
            beats &= paired(d)[2] < 0
            parts.append(f"et - {ref} = {fmt(d)} ({len(ss)} seeds)")
        out.append(f"ET beats token choice at pool {pool}: " + "; ".join(parts) + (" -> yes" if beats else " -> not shown"))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per optimizer step (default 4,096)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--pools", default="1024,4096", help="routing pools in tokens (default 1024,4096)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks/results/study_moe.jsonl")
    ap.add_argument("--work", type=Path, default=ROOT / "out/study/moe", help="checkpoints of runs in flight")
    ap.add_argument("--table", action="store_true", help="print the table only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not args.table:
        data = cached_default_corpus()
        for seed in [int(s) for s in args.seeds.split(",")]:
            for pool in [int(p) for p in args.pools.split(",")]:
                for arm in args.arms.split(","):
                    k = key(arm, pool, seed, args.steps, args.tokens)
                    if k in done(args.results):
                        continue
                    work = args.work / k.replace("|", "_")
                    config = model(arm, args.steps)
                    rec = train(k, config, spec(args.steps, seed, pool, args.tokens), evals(args.steps), data,
                                work, max(1, VAL_TOKENS // pool), keep)
                    rec |= {"arm": arm, "pool": pool, "seed": seed, "n_steps": args.steps, "tokens_per_step":
                            args.tokens, "tokens": args.steps * args.tokens, "active_params": active_params(config),
                            "momentum": config.moe.momentum, "bias_rate": config.moe.bias_rate}
                    finish(args.results, rec, work)
                    print(f"seed {seed} pool {pool} {arm:8s} val {rec['val_loss']:.4f} ({rec['seconds']:.0f} s)",
                          flush=True)
    recs = list(done(args.results).values())
    print(table(recs))
    print(verdict(recs))


if __name__ == "__main__":
    main()
