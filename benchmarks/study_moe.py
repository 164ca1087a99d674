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
- tc-bias: DeepSeek loss-free bias at the paper's rate u = 0.001 per step (BIAS_RATE: "Auxiliary-Loss-Free Load
  Balancing Strategy for Mixture-of-Experts", Wang et al., arXiv 2408.15664, the rate its experiments settle on;
  DeepSeek-V3 trains with the same 0.001; docs/log/2026-12-01-moe-quality.md's runs used it too). At 200 steps
  b moves by at most 0.2 logits, so this arm stays close to unbalanced top-1 in a run this short. Until
  2026-12-06 the arm ran at u = 2 / (0.1 x steps) (0.1 a step at 200 steps, 100x the paper's); those records
  carry their rate and are reported as `tc-bias@0.1`, never mixed with the paper-rate arm (issue 43).
- ec: expert choice top-k over the pool in training; its EMA of the per-step k-th logits (momentum below)
  is its causal threshold at evaluation (the paper's evaluation of EC).
- et: EC warmup for the first 20% of the steps, then the threshold with capacity factor 0.5.
- noise: tc-aux with the learning rate times 1 + 1e-6 (issue 43), the noise-floor arm: its paired difference to
  tc-aux is what chaos alone gives a seed, and its sd floors the sd of every interval a decision reads
  (stats.paired). Where it has not run, the floor is the older control, tc-aux at 4k minus tc-aux at 1k pools
  (the same model on the same windows; only the aux statistics' pool differs), and the verdict says which.
EMA momentum for ec and et: beta = 1 - 1 / (0.05 x steps), a window of 5% of the run (the paper's 0.999 over
about 19k steps). Per step the records keep the threshold lag (c_eff minus the pool's k-th logit, mean and
mean |.| over experts and MoE blocks), the threshold rate (pairs with r >= c_eff per target), experts per
token, max/mean load and drop/pad rates.

Seed counts (issue 43): the rules say "at least 2 of 3 seeds"; they are SEED_RULE = stats.SeedRule(2, 3), which
with more seeds scales as the fraction (2 of 3 -> 7 of 10), never "at least 2" of any number, and with fewer
than 3 reports the rule as not applicable. Descriptive comparisons (every pair of arms at a pool) are printed
with Holm-corrected intervals beside the rules' own.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from stats import SeedRule, holm
from study_runs import done, finish, paired, train

from megatrain.models import ModelConfig, preset
from megatrain.models.config import MoEConfig
from megatrain.models.moe import active_params
from megatrain.planner import TrainSpec
from megatrain.runtime.corpus import cached_default_corpus

ARMS = ("tc-aux", "tc-bias", "ec", "et", "noise")
OLD_ARMS = ("tc-bias@0.1",)  # records of the arm at an earlier design's rate: reported, never decided on
BIAS_RATE = 1e-3
NOISE_LR_DELTA = 1e-6
SEED_RULE = SeedRule(2, 3)
ROOT = Path(__file__).resolve().parents[1]
SEQ = 128
VAL_TOKENS = 65_536
KEEP = ("moe_threshold_lag", "moe_threshold_lag_abs", "moe_threshold_rate", "moe_experts_per_token",
        "moe_load_max_over_mean", "moe_zero_expert_share", "moe_drop_rate", "moe_pad_rate")


def momentum(steps: int) -> float:
    return 1.0 - 1.0 / max(2.0, 0.05 * steps)


def model(arm: str, steps: int) -> ModelConfig:
    dense = preset("tiny")
    arm = "tc-aux" if arm == "noise" else arm
    moe = {"n_experts": 8, "expert_dim": 256, "top_k": 1, "gate": "sigmoid"}
    moe |= {"tc-aux": {"router": "tc", "balance": "aux", "aux_loss_coef": 1e-2},
            "tc-bias": {"router": "tc", "balance": "bias", "bias_rate": BIAS_RATE},
            "ec": {"router": "ec", "momentum": momentum(steps), "ec_eval": "threshold"},
            "et": {"router": "et", "momentum": momentum(steps), "warmup_steps": int(0.2 * steps),
                   "capacity_factor": 0.5}}[arm]
    return ModelConfig(**{**dense.model_dump(), "name": arm, "moe": MoEConfig(**moe)})


def spec(steps: int, seed: int, pool: int, tokens: int, arm: str = "") -> TrainSpec:
    assert pool % SEQ == 0 and tokens % pool == 0, (pool, tokens)
    lr = 3e-3 * (1 + NOISE_LR_DELTA) if arm == "noise" else 3e-3
    return TrainSpec(micro_batch=pool // SEQ, seq_len=SEQ, grad_accum=tokens // pool, dtype="fp32", lr=lr,
                     warmup_steps=steps // 10, total_steps=steps, weight_decay=0.1, clip_norm=1.0, seed=seed)


def key(arm: str, pool: int, seed: int, steps: int, tokens: int) -> str:
    # the rate is in tc-bias's key: a run at another rate is another arm, never skipped as done
    rate = f"|u{BIAS_RATE:g}" if arm == "tc-bias" else ""
    return f"{arm}|pool{pool}|seed{seed}|{steps}x{tokens}{rate}"


def relabel(recs: list[dict]) -> list[dict]:
    """The records with tc-bias runs at a rate other than BIAS_RATE renamed tc-bias@RATE (OLD_ARMS)."""
    out = []
    for r in recs:
        if r["arm"] == "tc-bias" and r.get("bias_rate") != BIAS_RATE:
            r = {**r, "arm": f"tc-bias@{r['bias_rate']:g}"}
        out.append(r)
    return out


def _order(arm: str) -> int:
    return (ARMS + OLD_ARMS).index(arm) if arm in ARMS + OLD_ARMS else len(ARMS + OLD_ARMS)


def noise_floor(recs: list[dict]) -> tuple[float, int | None, str]:
    """(sd, degrees of freedom, what it is) of the noise the decisions' intervals are floored at: the noise arm
    minus tc-aux at the same pool and seed where the noise arm ran, else tc-aux at 4k minus tc-aux at 1k."""
    val = {(r["arm"], r["pool"], r["seed"]): r["val_loss"] for r in recs}
    d = [v - val["tc-aux", p, s] for (a, p, s), v in sorted(val.items()) if a == "noise" and ("tc-aux", p, s) in val]
    what = "noise arm - tc-aux"
    if len(d) < 2:
        d = [val["tc-aux", 4096, s] - val["tc-aux", 1024, s] for (a, p, s) in sorted(val)
             if a == "tc-aux" and p == 1024 and ("tc-aux", 4096, s) in val]
        what = "tc-aux 4k - 1k (no noise arm run)"
    if len(d) < 2:
        return 0.0, None, "none (fewer than 2 seeds of a control)"
    sd = statistics.stdev(d)
    return sd, len(d) - 1, f"{what}: sd {sd:.4f} over {len(d)} values"


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

    for (pool, arm) in sorted(groups, key=lambda g: (g[0], _order(g[1]))):
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


def _seed_rule(successes: list[int], seeds: list[int]) -> tuple[bool | None, str]:
    """(all passed, the rule as applied) for SEED_RULE over comparisons with `successes` of `seeds` each; None:
    some comparison has fewer seeds than the rule was written for."""
    try:
        return all(SEED_RULE.passed(k, n) for k, n in zip(successes, seeds)), SEED_RULE.describe(min(seeds))
    except ValueError as e:
        return None, str(e)


def verdict(recs: list[dict]) -> str:
    """The decision rules of docs/RESULTS.md (fixed before the runs) applied to the finished runs: scale effect,
    threshold estimate at fault, ET beats token choice. Seed counts by SEED_RULE (module docstring); the
    intervals of the third rule floored at the noise arm's sd."""
    recs = relabel(recs)
    val = {(r["arm"], r["pool"], r["seed"]): r["val_loss"] for r in recs}
    runs = {(r["arm"], r["pool"], r["seed"]): r for r in recs}
    sd, df, floor_what = noise_floor(recs)

    def tc(arm: str, pool: int, seed: int) -> float | None:  # as table(): a TC run of any pool of the seed
        if (arm, pool, seed) in val:
            return val[arm, pool, seed]
        return next((v for (a, _, s), v in sorted(val.items()) if a == arm and s == seed), None)

    def seeds_with(keys: list[tuple[str, int]]) -> list[int]:
        return sorted(s for s in {s for _, _, s in val}
                      if all((tc(a, p, s) if a.startswith("tc") else val.get((a, p, s))) is not None for a, p in keys))

    def get(a: str, p: int, s: int) -> float:
        return tc(a, p, s) if a.startswith("tc") else val[a, p, s]

    def fmt(d: list[float], floor: bool = False) -> str:
        m, lo, hi = paired(d, sd, df) if floor else paired(d)
        return f"{m:+.4f} [{lo:+.4f}, {hi:+.4f}]" if len(d) > 1 else f"{m:+.4f}"

    def applied(ok: bool, rule: bool | None, how: str) -> str:
        if rule is None:
            return f"rule not applicable ({how}); as far as its terms go: " + ("consistent" if ok else "not consistent")
        return f"{'supported' if ok and rule else 'NOT supported'} ({how})"

    out = [f"noise floor: {floor_what}"]
    # 1. scale effect: (arm - tc-aux) smaller at 4k than at 1k, for ec and et, on the mean and on SEED_RULE's seeds
    parts, ok_all, ks, ns = [], True, [], []
    for arm in ("ec", "et"):
        ss = seeds_with([(arm, 1024), (arm, 4096), ("tc-aux", 1024), ("tc-aux", 4096)])
        if not ss:
            parts.append(f"{arm}: no seed has both pools")
            ok_all, ks, ns = False, ks + [0], ns + [0]
            continue
        ch = [(get(arm, 4096, s) - get("tc-aux", 4096, s)) - (get(arm, 1024, s) - get("tc-aux", 1024, s)) for s in ss]
        k = sum(c < 0 for c in ch)
        ok_all &= statistics.mean(ch) < 0
        ks, ns = ks + [k], ns + [len(ss)]
        parts.append(f"{arm}: Δ(4k) - Δ(1k) = {fmt(ch)}, smaller at 4k on {k} of {len(ss)} seeds")
    rule, how = _seed_rule(ks, ns)
    out.append("scale effect: " + "; ".join(parts) + f" -> {applied(ok_all and bool(rule), rule, how)}")
    # 2. threshold estimate at fault: et above ec at both pools (mean, SEED_RULE), and off target after warmup
    parts, above, ks, ns = [], True, [], []
    for pool in (1024, 4096):
        ss = seeds_with([("et", pool), ("ec", pool)])
        if not ss:
            parts.append(f"pool {pool}: no seed has et and ec")
            above, ks, ns = False, ks + [0], ns + [0]
            continue
        d = [val["et", pool, s] - val["ec", pool, s] for s in ss]
        k = sum(x > 0 for x in d)
        above &= statistics.mean(d) > 0
        ks, ns = ks + [k], ns + [len(ss)]
        parts.append(f"pool {pool}: et - ec = {fmt(d)}, et above on {k} of {len(ss)}")
    ets = [r for (a, _, _), r in runs.items() if a == "et"]
    rate = [_post_warmup(r, "moe_threshold_rate") for r in ets]
    ept = [_post_warmup(r, "moe_experts_per_token") for r in ets]
    pairs = [(x, y) for x, y in zip(rate, ept, strict=True) if x is not None and y is not None]
    off = [abs(x - 1) > 0.1 or abs(y - 1) > 0.1 for x, y in pairs]
    off_mean = bool(pairs) and (abs(statistics.mean(x for x, _ in pairs) - 1) > 0.1
                                or abs(statistics.mean(y for _, y in pairs) - 1) > 0.1)
    parts.append(f"et after warmup: threshold rate {_ms(rate, '.3f')}, experts/token {_ms(ept, '.3f')} (mean over "
                 f"runs {'off' if off_mean else 'on'} target, > 0.1 from 1 in {sum(off)} of {len(off)} runs)")
    rule, how = _seed_rule(ks, ns)
    out.append("threshold estimate at fault: " + "; ".join(parts)
               + f" -> {applied(above and off_mean and bool(rule), rule, how)}")
    # 3. ET beats token choice: et - tc-aux and et - tc-bias with a paired 95% interval entirely below 0, the sd
    # at least the noise floor's
    for pool in (1024, 4096):
        parts, beats = [], True
        for ref in ("tc-aux", "tc-bias"):
            ss = seeds_with([("et", pool), (ref, pool)])
            if len(ss) < 2:
                parts.append(f"et - {ref}: {len(ss)} seed(s)")
                beats = False
                continue
            d = [val["et", pool, s] - get(ref, pool, s) for s in ss]
            beats &= paired(d, sd, df)[2] < 0
            parts.append(f"et - {ref} = {fmt(d, True)} ({len(ss)} seeds)")
        out.append(f"ET beats token choice at pool {pool}: " + "; ".join(parts) + (" -> yes" if beats else " -> not shown"))
    return "\n".join(out)


def holm_table(recs: list[dict]) -> str:
    """Every pair of arms at each pool (later minus earlier in ARMS order, per seed), Holm-corrected at 5% over
    all of them, the sd floored at the noise floor's: descriptive, beside the rules."""
    recs = relabel(recs)
    val = {(r["arm"], r["pool"], r["seed"]): r["val_loss"] for r in recs}
    sd, df, _ = noise_floor(recs)
    arms = sorted({a for a, _, _ in val}, key=_order)
    named = {}
    for pool in sorted({p for _, p, _ in val}):
        for i, a in enumerate(arms):
            for b in arms[i + 1:]:
                d = [val[b, pool, s] - val[a, pool, s] for (x, p, s) in sorted(val) if (x, p) == (a, pool)
                     and (b, pool, s) in val]
                if len(d) > 1:
                    named[f"pool {pool}: {b} - {a}"] = d
    if not named:
        return ""
    rows = ["| comparison | seeds | 95%, floored | Holm: level, interval | Holm rejects 0 |", "|---|---|---|---|---|"]
    for k, (iv, rej) in sorted(holm(named, 0.05, sd, df).items(), key=lambda kv: kv[1][0].p):
        m, lo, hi = paired(named[k], sd, df)
        rows.append(f"| {k} | {iv.n} | {m:+.4f} [{lo:+.4f}, {hi:+.4f}] | {iv.level:.2%}: {iv.fmt()} | "
                    f"{'yes' if rej else 'no'} |")
    return "\n".join(rows)


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
                    rec = train(k, config, spec(args.steps, seed, pool, args.tokens, arm), evals(args.steps), data,
                                work, max(1, VAL_TOKENS // pool), keep)
                    rec |= {"arm": arm, "pool": pool, "seed": seed, "n_steps": args.steps, "tokens_per_step":
                            args.tokens, "tokens": args.steps * args.tokens, "active_params": active_params(config),
                            "momentum": config.moe.momentum, "bias_rate": config.moe.bias_rate}
                    finish(args.results, rec, work)
                    print(f"seed {seed} pool {pool} {arm:8s} val {rec['val_loss']:.4f} ({rec['seconds']:.0f} s)",
                          flush=True)
    recs = list(done(args.results).values())
    print(table(relabel(recs)))
    print(verdict(recs))
    print(holm_table(recs))


if __name__ == "__main__":
    main()
