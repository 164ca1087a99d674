"""Depth mixing quality at small scale: residual, DenseFormer, Hyper-Connections, Block AttnRes, DepthSSD.

Run: `.venv/bin/python benchmarks/quality_depth_mixing.py` (about 15 minutes on 2 CPU cores; `--steps`,
`--seeds` and `--variants` shrink it; `--json FILE` keeps the per-run figures). Results: docs/RESULTS.md,
"Depth mixing".

Every run trains with megatrain's streamed runtime (Trainer, sim device, the whole model on device) on the
built-in corpus (byte tokens), the same tokens in the same order for every variant of a seed, and reports
the validation loss at the end. Speed is measured apart, after the quality runs: one Trainer per variant,
steps on the same batch interleaved round-robin in one process (`--speed-rounds`), so the ratios to the
residual are taken under the same machine load (the runs of a shared machine are not). The model is the tiny preset deepened to 8 blocks
(16 sub-layers, d 128): deep enough that a rank-8 state is a real constraint (a generic 17 x 17 depth
matrix has semiseparable rank 9) and small enough to train on a CPU. Variants: residual; DenseFormer 1x1;
Hyper-Connections static and dynamic with n = 4; Block AttnRes with 4 blocks (S = 4 sub-layers); DepthSSD
with N = 1 and N = 8.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import ExitStack

import torch
from quality_runs import BUDGET, train_run, train_spec

from megatrain.models import ModelConfig, preset
from megatrain.runtime.config import RunConfig
from megatrain.runtime.corpus import cached_default_corpus
from megatrain.runtime.trainer import Trainer

VARIANTS = ("residual", "denseformer", "hc:4", "hc-dynamic:4", "attnres:4", "depthssd:1", "depthssd:8")


def model(mixing: str, d_model: int = 128) -> ModelConfig:
    """The tiny preset at 8 blocks; a wider `d_model` keeps head_dim 32, the kv ratio and ffn = 2.75 d."""
    wide = {"d_model": d_model, "n_heads": d_model // 32, "n_kv_heads": d_model // 64, "ffn_dim": 11 * d_model // 4}
    return ModelConfig(**{**preset("tiny").model_dump(), **(wide if d_model != 128 else {}), "name": mixing,
                          "n_layers": 8, "depth_mixing": mixing})


def run(mixing: str, seed: int, steps: int, data) -> dict:
    return {"variant": mixing, **train_run(model(mixing), seed, steps, data)[0]}


def speed(variants: list[str], rounds: int, d_model: int = 128) -> dict[str, float]:
    """Median seconds per step of each variant, steps interleaved round-robin on one batch."""
    train = train_spec(steps=100)
    g = torch.Generator().manual_seed(0)
    batch = [(torch.randint(0, 256, (8, 128), generator=g), torch.randint(0, 256, (8, 128), generator=g))]
    with ExitStack() as stack:
        trainers = {v: stack.enter_context(Trainer(RunConfig(model=model(v, d_model), train=train, gpu_mem=4 * BUDGET,
                                                             device="sim"))) for v in variants}
        times: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(rounds + 1):
            for v, t in trainers.items():
                t0 = time.perf_counter()
                t.train_step(batch)
                t.device.synchronize()
                if r:  # round 0 warms up
                    times[v].append(time.perf_counter() - t0)
    return {v: statistics.median(ts) for v, ts in times.items()}


def table(runs: list[dict], variants: list[str], seconds: dict[str, float] | None) -> str:
    base = {r["seed"]: r for r in runs if r["variant"] == "residual"}
    lines = ["| variant | params | val loss (mean ± sd) | Δ vs residual (mean ± sd) | tokens/s vs residual |",
             "|---|---|---|---|---|"]
    for v in variants:
        rs = [r for r in runs if r["variant"] == v]
        losses = [r["val_loss"] for r in rs]
        sd = statistics.stdev(losses) if len(losses) > 1 else 0.0
        delta = [r["val_loss"] - base[r["seed"]]["val_loss"] for r in rs if r["seed"] in base]
        dsd = statistics.stdev(delta) if len(delta) > 1 else 0.0
        rate = f"{seconds['residual'] / seconds[v]:.2f}x" if seconds and "residual" in seconds else "-"
        lines.append(f"| {v} | {rs[0]['params']:,} | {statistics.mean(losses):.4f} ± {sd:.4f} | "
                     + (f"{statistics.mean(delta):+.4f} ± {dsd:.4f}" if delta else "-") + f" | {rate} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--speed-rounds", type=int, default=5, help="interleaved timed steps per variant (0: none)")
    ap.add_argument("--runs", metavar="FILE", help="take the quality runs from this --json file instead of training")
    ap.add_argument("--speed-d-model", type=int, default=128, help="model width of the speed rounds (default 128)")
    ap.add_argument("--speed-only", action="store_true", help="no quality runs: time the variants and stop")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if args.speed_only:
        seconds = speed(variants, args.speed_rounds, args.speed_d_model)
        print(f"d_model {args.speed_d_model}, seconds per step and tokens/s vs residual: " + ", ".join(
            f"{v} {s:.3f} ({seconds['residual'] / s:.2f}x)" for v, s in seconds.items()))
        return
    if args.runs:
        with open(args.runs) as f:
            runs = json.load(f)
    else:
        data = cached_default_corpus()
        runs = []
        for seed in range(args.seeds):  # seeds outermost: the variants of a seed run under similar load
            for v in variants:
                r = run(v, seed, args.steps, data)
                runs.append(r)
                print(f"{v:>14} seed {seed}: val {r['val_loss']:.4f}, {r['seconds']:.0f} s", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(runs, f, indent=1)
    seconds = speed(variants, args.speed_rounds) if args.speed_rounds else None
    if seconds:
        print("seconds per step: " + ", ".join(f"{v} {s:.3f}" for v, s in seconds.items()))
    print(table(runs, variants, seconds))


if __name__ == "__main__":
    main()
