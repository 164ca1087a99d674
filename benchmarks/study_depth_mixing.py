"""Depth-mixing study that can rank (issue 18, part 1): residual, DenseFormer, DepthSSD-1/8, HC, Block AttnRes.

Run: `nice -n 19 .venv/bin/python benchmarks/study_depth_mixing.py --seeds 0,1,2,3` (resumable: finished runs
are records in `--results`, default benchmarks/results/study_depth_mixing.jsonl; a run in flight resumes from
its checkpoint under `--work`; rerun the same command to go on). `--table` prints the table and the decision
rule's verdict from the results without training. Results: docs/RESULTS.md, "Depth mixing".

Model: the tiny preset (d 128, 4 heads / 2 kv, SwiGLU 352, byte vocabulary) at 12 blocks: 24 sub-layers, so a
generic 25 x 25 depth matrix has semiseparable rank 13 and N = 8 is a real constraint. Training (study_runs.py:
Trainer, sim device): 16 x 256 tokens a step, fp32, AdamW lr 3e-3 (10% warmup, cosine to 0.1 lr), betas
(0.9, 0.95), weight decay 0.1 on weight matrices only (models.decays: no decay on norms or `.mix.`
coefficients), clip 1.0. Validation: 16 batches of 16 x 256 = 65,536 held-out tokens at 25/50/75/100% of
the run. Seeds are paired: a seed fixes init of every shared tensor and the data order, for every variant.

Variants: residual; DenseFormer 1x1; DepthSSD N = 1 (the learnable-gain control: a rank-1 state) and N = 8;
Hyper-Connections static n = 4; Block AttnRes with 6 blocks of 4 sub-layers; `--variants` adds the rank
sweep depthssd:2, depthssd:4, and the noise arm `noise` (issue 43): the residual model with the learning rate
times 1 + 1e-6, a change with no systematic effect that still sends the run down another trajectory. Its paired
difference to the residual is what chaos alone gives a seed; its sd floors the sd of the rule's interval
(stats.paired). The 2026-12-01/03 runs had no noise arm: their verdict has no floor, and says so.

Decision rule (fixed before the results, docs/RESULTS.md): rank helps iff DepthSSD-8's final validation loss
is below DenseFormer's and the residual's on every seed, and below DepthSSD-1's with a paired 95% t interval
of (DepthSSD-8 - DepthSSD-1) entirely below 0. Anything else is reported as not shown.

Descriptive comparisons (issue 43, after the runs): every pair of the six variants, 15 comparisons, printed
with Holm-corrected intervals (stats.holm) beside the rule's own uncorrected one; only those Holm rejects are
called differences.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from stats import holm
from study_runs import done, finish, paired, train

from megatrain.models import ModelConfig, preset
from megatrain.planner import TrainSpec
from megatrain.runtime.corpus import cached_default_corpus

VARIANTS = ("residual", "denseformer", "depthssd:1", "depthssd:8", "hc:4", "attnres:6")
RANK_SWEEP = ("depthssd:2", "depthssd:4")
NOISE = "noise"  # the residual at lr x (1 + NOISE_LR_DELTA)
NOISE_LR_DELTA = 1e-6
ROOT = Path(__file__).resolve().parents[1]
VAL_BATCHES = 16
# validation holds every unit's carry-out of a batch (DepthSSD-8: 16 MiB a unit, DenseFormer: the block outputs
# so far), which outgrew study_runs' 256 MiB pool at 12 blocks; training numbers do not depend on the pool
BUDGET = 2**30


def model(mixing: str, n_layers: int = 12) -> ModelConfig:
    mixing = "residual" if mixing == NOISE else mixing
    return ModelConfig(**{**preset("tiny").model_dump(), "name": mixing, "n_layers": n_layers,
                          "depth_mixing": mixing})


def spec(steps: int, seed: int, micro_batch: int = 16, seq_len: int = 256, variant: str = "") -> TrainSpec:
    lr = 3e-3 * (1 + NOISE_LR_DELTA) if variant == NOISE else 3e-3
    return TrainSpec(micro_batch=micro_batch, seq_len=seq_len, grad_accum=1, dtype="fp32", lr=lr,
                     warmup_steps=steps // 10, total_steps=steps, weight_decay=0.1, clip_norm=1.0, seed=seed)


def key(variant: str, seed: int, steps: int) -> str:
    return f"{variant}|seed{seed}|{steps}"


def evals(steps: int) -> list[int]:
    return sorted({max(1, round(steps * f)) for f in (0.25, 0.5, 0.75, 1.0)})


def table(recs: list[dict], variants: list[str], steps: int) -> str:
    by = {(r["variant"], r["seed"]): r for r in recs if r["steps"] == steps}
    seeds = sorted({s for _, s in by})
    points = evals(steps)
    rows = [f"| variant | params | val loss at {', '.join(map(str, points))} steps (mean over seeds) | final "
            "per seed | Δ vs residual, paired (mean [95% CI]) | Δ vs DepthSSD-1 | s/run | tokens/s |",
            "|---|---|---|---|---|---|---|---|"]
    for v in variants:
        rs = [by[v, s] for s in seeds if (v, s) in by]
        if not rs:
            continue
        curve = " / ".join(f"{statistics.mean(r['val'][str(p)] for r in rs):.4f}" for p in points)
        per_seed = " / ".join(f"{r['val_loss']:.4f}" for r in rs)

        def delta(base: str, v: str = v) -> str:
            d = [by[v, s]["val_loss"] - by[base, s]["val_loss"] for s in seeds if (v, s) in by and (base, s) in by]
            if not d or v == base:
                return "-"
            m, lo, hi = paired(d)
            return f"{m:+.4f} [{lo:+.4f}, {hi:+.4f}]" if len(d) > 1 else f"{m:+.4f}"

        rows.append(f"| {v} | {rs[0]['params']:,} | {curve} | {per_seed} | {delta('residual')} | "
                    f"{delta('depthssd:1')} | {statistics.mean(r['seconds'] for r in rs):.0f} | "
                    f"{statistics.mean(r['tokens_per_s'] for r in rs):,.0f} |")
    return "\n".join(rows) + f"\n\nseeds: {', '.join(map(str, seeds))}"


def noise_floor(by: dict[tuple[str, int], float]) -> tuple[float, int | None]:
    """(sd, degrees of freedom) of the noise arm's paired difference to the residual over the seeds that have
    both; (0, None) where fewer than two seeds have it."""
    d = [by[NOISE, s] - by["residual", s] for (v, s) in by if v == NOISE and ("residual", s) in by]
    return (statistics.stdev(d), len(d) - 1) if len(d) > 1 else (0.0, None)


def verdict(recs: list[dict], steps: int) -> str:
    by = {(r["variant"], r["seed"]): r["val_loss"] for r in recs if r["steps"] == steps}
    need = ("residual", "denseformer", "depthssd:1", "depthssd:8")
    seeds = sorted(s for s in {s for _, s in by} if all((v, s) in by for v in need))
    if not seeds:
        return "verdict: no seed has all four of residual, denseformer, depthssd:1, depthssd:8"
    below = [by["depthssd:8", s] < min(by["denseformer", s], by["residual", s]) for s in seeds]
    sd, df = noise_floor(by)
    m, lo, hi = paired([by["depthssd:8", s] - by["depthssd:1", s] for s in seeds], sd, df)
    ok = all(below) and len(seeds) > 1 and hi < 0
    floor = f"noise floor sd {sd:.4f} ({df + 1} seeds)" if df else "no noise arm run: no floor"
    return (f"verdict on {len(seeds)} seed(s): DepthSSD-8 below DenseFormer and residual on {sum(below)} of "
            f"{len(seeds)}; DepthSSD-8 - DepthSSD-1 = {m:+.4f} [{lo:+.4f}, {hi:+.4f}] ({floor}) -> "
            + ("rank helps (rule met)" if ok else "rule NOT met: the benefit of rank is not shown"))


def holm_table(recs: list[dict], steps: int, variants: tuple[str, ...] = VARIANTS) -> str:
    """Every pair of `variants` (later minus earlier, per seed), Holm-corrected over the family at 5%: the
    interval at the level Holm's step tests it at, and whether Holm rejects a zero difference."""
    by = {(r["variant"], r["seed"]): r["val_loss"] for r in recs if r["steps"] == steps}
    sd, df = noise_floor(by)
    named = {}
    for i, a in enumerate(variants):
        for b in variants[i + 1:]:
            d = [by[b, s] - by[a, s] for (v, s) in sorted(by) if v == a and (b, s) in by]
            if len(d) > 1:
                named[f"{b} - {a}"] = d
    if not named:
        return ""
    rows = ["| comparison | seeds | uncorrected 95% | Holm: level, interval | Holm rejects 0 |",
            "|---|---|---|---|---|"]
    for k, (iv, rej) in sorted(holm(named, 0.05, sd, df).items(), key=lambda kv: kv[1][0].p):
        m, lo, hi = paired(named[k], sd, df)
        rows.append(f"| {k} | {iv.n} | {m:+.4f} [{lo:+.4f}, {hi:+.4f}] | {iv.level:.2%}: {iv.fmt()} | "
                    f"{'yes' if rej else 'no'} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seeds", default="0,1,2,3", help="comma-separated seeds (default 0,1,2,3)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks/results/study_depth_mixing.jsonl")
    ap.add_argument("--work", type=Path, default=ROOT / "out/study/depth", help="checkpoints of runs in flight")
    ap.add_argument("--table", action="store_true", help="print the table and verdict only")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--val-batches", type=int, default=VAL_BATCHES, help="validation batches (default 16: 65,536 "
                    "tokens)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    variants, seeds = args.variants.split(","), [int(s) for s in args.seeds.split(",")]
    if not args.table:
        data = cached_default_corpus()
        for seed in seeds:  # seeds outermost: a partial study has whole seeds
            for v in variants:
                k = key(v, seed, args.steps)
                if k in done(args.results):  # reread: another process may share the results file
                    continue
                work = args.work / k.replace("|", "_").replace(":", "-")
                rec = train(k, model(v), spec(args.steps, seed, variant=v), evals(args.steps), data, work,
                            args.val_batches, budget=BUDGET)
                rec |= {"variant": v, "seed": seed, "steps": args.steps,
                        "tokens": args.steps * spec(args.steps, seed).tokens_per_step}
                finish(args.results, rec, work)
                print(f"{v:>12} seed {seed}: val {rec['val_loss']:.4f} ({rec['seconds']:.0f} s)", flush=True)
    recs = list(done(args.results).values())
    print(table(recs, [v for v in [*VARIANTS, *RANK_SWEEP, NOISE] if v in variants or args.table], args.steps))
    print(verdict(recs, args.steps))
    print(holm_table(recs, args.steps))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
