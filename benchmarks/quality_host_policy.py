"""What each host policy costs in quality: the compressed AdamW update shadowing the exact one (issue 43).

Run: `.venv/bin/python benchmarks/quality_host_policy.py --beta2 0.95,0.999 --steps 5000 --seeds 6 --json s.json`
(split between processes with `--first-seed`/`--seeds` and joined with `--table a.json b.json`). Results:
docs/RESULTS.md, "Host memory policies: quality"; each policy's upper bound is megatrain/planner/host_policy.py's
`quality_cost`, which `--host-policy auto` reads.

The shadow estimator. One model trains under `exact` (fp32 AdamW, bit-identical to torch's fused kernel); every
step its fp32 gradient, the clip factor taken from it and the learning rate are also handed to one shadow per
compressed policy: a copy of the weights, started equal, with that policy's own state (bf16 or fp8 moments,
the gradient rounded to the policy's held dtype), stepped by the policy's own host update
(host_state.adamw_step, the function training runs). A shadow never computes a gradient of its own, so its
weights differ from exact's only by what the compressed update changed, accumulated along exact's trajectory:
no chaotic divergence enters (two independent runs differ by about 1.4% of loss per seed from chaos alone, the
noise that made the earlier paired-run rule flip). At each evaluation point every model's validation loss is
taken on the same held-out batches; a seed's cost is L(shadow) / L(exact) - 1 at the run's end. What it leaves
out: the shadow's error never feeds back into its gradients, so an error the loss would pull back in a real
run is not pulled back here, and one the loss would amplify is not amplified.

Noise arm: `control`, exact's update with the learning rate times 1 + 1e-6, stepped as a shadow like the
policies. Its cost is what a change with no systematic effect gives under this estimator; its per-seed sd floors
the sd of every policy's interval (stats.paired).

Decision rule, written before the shadow runs (2026-12-06): at each beta2 of 0.95 and 0.999, a policy's cost
is the mean over seeds of the end-of-run cost, with a two-sided 95% t interval over the seeds (n - 1 degrees of
freedom, the sd at least the control's); auto may take the policy only when the interval's upper end is at
most megatrain/planner/host_policy.QUALITY_TOLERANCE (0.5%) at both beta2. host_policy.py stores the larger of
the two upper ends as the policy's `quality_cost`, so auto's `quality_cost <= QUALITY_TOLERANCE` is this rule.
A policy that fails is reported as failing with its figures; no rounding change is made in the same session.

Setup: the tiny preset at `--layers` (2) blocks (d 128, byte vocabulary), 4 x 128 tokens a step from the
built-in corpus (Batcher: windows from (seed, step)), fp32, AdamW lr 3e-3 with 10% warmup and cosine decay to
0.1, betas (0.9, beta2), weight decay 0.1 on matrices, clip 1.0; validation on `--val-batches` x 8 x 128
held-out tokens at 10 evenly spaced points. Per evaluation point the records also keep each shadow's weight drift
||W - W_exact|| / ||W_exact - W_0|| and the median relative error of its second moment against exact's (signed: a bias shows).

`--paired` runs the superseded estimator (independent runs under each policy, paired by seed; the 2026-12-01/04
figures in docs/log/2026-12-01-host-policy.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from quality_runs import train_run
from stats import paired

from megatrain.models import ModelConfig, build_eager, decays, preset, routing
from megatrain.planner import TrainSpec
from megatrain.planner.host_policy import ORDER, QUALITY_TOLERANCE
from megatrain.runtime.corpus import cached_default_corpus
from megatrain.runtime.data import Batcher, TokenFile, eval_batches
from megatrain.runtime.host_adamw import DTYPES, grad_dtype, new_moments
from megatrain.runtime.host_state import adamw_step
from megatrain.runtime.optim import clip_coefficient, lr_at
from megatrain.runtime.reference import _loss_sum

SHADOWS = tuple(p for p in ORDER if p != "exact") + ("control",)
CONTROL_LR = 1 + 1e-6


def model(layers: int) -> ModelConfig:
    return ModelConfig(**{**preset("tiny").model_dump(), "name": f"tiny-{layers}", "n_layers": layers})


def shadow_spec(steps: int, seed: int, beta2: float) -> TrainSpec:
    return TrainSpec(micro_batch=4, seq_len=128, grad_accum=1, dtype="fp32", lr=3e-3, warmup_steps=steps // 10,
                     total_steps=steps, weight_decay=0.1, clip_norm=1.0, seed=seed, betas=(0.9, beta2))


class _Shadow:
    """A copy of the model's weights with one policy's AdamW state, stepped from gradients it is handed."""

    def __init__(self, config: ModelConfig, seed: int, policy: str):
        self.model = build_eager(config, seed=seed)
        self.policy = "exact" if policy == "control" else policy
        self.lr_scale = CONTROL_LR if policy == "control" else 1.0
        named = list(self.model.named_parameters())
        self.params = [p.detach() for _, p in named]
        self.decay = [decays(n, tuple(p.shape)) for n, p in named]
        self.moments = [new_moments(self.policy, tuple(p.shape), n) for n, p in named]
        self.steps = [torch.zeros(()) for _ in self.params]

    def step(self, grads: list[torch.Tensor], clip: torch.Tensor, spec: TrainSpec, lr: float) -> None:
        held = [g.to(grad_dtype(self.policy)) for g in grads]  # the policy's held dtype, after the fp32 norm
        adamw_step(self.policy, self.params, held, self.moments, self.steps, spec, lr * self.lr_scale, self.decay,
                   clip)

    def second_moments(self) -> list[torch.Tensor]:
        """fp32 v per parameter (fp8: dequantised by block, without the floor: what was stored)."""
        out = []
        for m in self.moments:
            v = m.exp_avg_sq
            if v.dtype == DTYPES["fp8"]:
                blocks = torch.zeros(-(-v.numel() // 256) * 256)
                blocks[: v.numel()] = v.view(-1).float()
                v = (blocks.view(-1, 256) * m.sq_scale[:, None]).view(-1)[: v.numel()]
            out.append(v.float().view(-1))
        return out


@torch.no_grad()
def _val_loss(m: torch.nn.Module, batches) -> float:
    total = n = 0
    for tok, tgt in batches:
        logs = [routing.RoutingLog() for _ in m.blocks]
        total += float(_loss_sum(m, tok, tgt, False, 1024, logs, 1.0))
        n += tgt.numel()
    return total / n


def shadow_run(config: ModelConfig, seed: int, steps: int, beta2: float, data, val_batches: int = 16,
               policies: tuple[str, ...] = SHADOWS, points: int = 10) -> dict:
    """One seed: exact trains, every policy in `policies` shadows it (module docstring). Returns the record:
    per evaluation point the validation loss of exact and each shadow, each shadow's cost, weight drift and
    second-moment error."""
    t0 = time.perf_counter()
    spec = shadow_spec(steps, seed, beta2)
    exact = _Shadow(config, seed, "exact")
    shadows = {p: _Shadow(config, seed, p) for p in policies}
    start = [p.clone() for p in exact.params]
    batcher = Batcher(TokenFile.open(data[0], config.vocab_size), spec.micro_batch, spec.seq_len, 1, seed=seed)
    val = eval_batches(TokenFile.open(data[1], config.vocab_size), 8, spec.seq_len, val_batches)
    evals = sorted({max(1, round(steps * (i + 1) / points)) for i in range(points)})
    record = {"seed": seed, "beta2": beta2, "steps": steps, "params": config.n_params(), "points": []}
    for step in range(steps):
        ((tok, tgt),) = batcher.batch(step)
        for p in exact.model.parameters():
            p.grad = None
        logs = [routing.RoutingLog() for _ in exact.model.blocks]
        (_loss_sum(exact.model, tok, tgt, False, 1024, logs, 1.0 / tgt.numel()) / tgt.numel()).backward()
        grads = [p.grad.detach().clone() for p in exact.model.parameters()]
        clip = clip_coefficient(torch.nn.utils.get_total_norm(grads), spec.clip_norm)
        lr = lr_at(spec, step)
        for s in shadows.values():
            s.step(grads, clip, spec, lr)
        exact.step(grads, clip, spec, lr)
        if step + 1 in evals:
            record["points"].append(_point(step + 1, exact, shadows, start, val))
    record["seconds"] = round(time.perf_counter() - t0, 1)
    return record


def _point(step: int, exact: _Shadow, shadows: dict[str, _Shadow], start, val) -> dict:
    base = _val_loss(exact.model, val)
    moved = sum(float((p - p0).pow(2).sum()) for p, p0 in zip(exact.params, start)) ** 0.5
    v_exact = torch.cat(exact.second_moments())
    live = v_exact > 0
    out = {"step": step, "exact": base}
    for name, s in shadows.items():
        loss = _val_loss(s.model, val)
        drift = sum(float((p - q).pow(2).sum()) for p, q in zip(s.params, exact.params)) ** 0.5
        v = torch.cat(s.second_moments())
        out[name] = {"val": loss, "cost": loss / base - 1, "drift": drift / max(moved, 1e-30),
                     "v_rel_err": float(((v[live] - v_exact[live]) / v_exact[live]).median())}
    return out


def _decide(runs: list[dict], policy: str, beta2: float):
    """(interval, auto may take it at this beta2) for `policy` from the end-of-run costs (the rule above)."""
    rs = [r for r in runs if r["beta2"] == beta2]
    costs = [r["points"][-1][policy]["cost"] for r in rs if policy in r["points"][-1]]
    ctrl = [r["points"][-1]["control"]["cost"] for r in rs if "control" in r["points"][-1]]
    floor = statistics.stdev(ctrl) if len(ctrl) > 1 and policy != "control" else 0.0
    iv = paired(costs, 0.95, floor, len(ctrl) - 1 if len(ctrl) > 1 else None)
    return iv, iv.n > 1 and iv.high <= QUALITY_TOLERANCE


def shadow_table(runs: list[dict]) -> str:
    betas = sorted({r["beta2"] for r in runs})
    rows = ["| policy | beta2 | seeds | steps | end-of-run cost, mean [95% CI] | cost sd | weight drift | v rel. "
            "error | within 0.5% at the upper end |", "|---|---|---|---|---|---|---|---|---|"]
    verdicts: dict[str, list[bool]] = {}
    for policy in SHADOWS:
        for b in betas:
            rs = [r for r in runs if r["beta2"] == b and policy in r["points"][-1]]
            if not rs:
                continue
            iv, ok = _decide(runs, policy, b)
            verdicts.setdefault(policy, []).append(ok)
            costs = [r["points"][-1][policy]["cost"] for r in rs]
            sd = statistics.stdev(costs) if len(costs) > 1 else 0.0
            drift = statistics.mean(r["points"][-1][policy]["drift"] for r in rs)
            verr = statistics.mean(r["points"][-1][policy]["v_rel_err"] for r in rs)
            rows.append(f"| {policy} | {b} | {len(rs)} | {rs[0]['steps']:,} | {iv.fmt(3, pct=True)} | {sd:.3%} | "
                        f"{drift:.3g} | {verr:+.3g} | {'(noise arm)' if policy == 'control' else 'yes' if ok else 'no'} |")
    rows.append("")
    for policy, oks in verdicts.items():
        if policy != "control":
            upper = max(_decide(runs, policy, b)[0].high for b in betas)
            rows.append(f"{policy}: auto may take it: {'yes' if all(oks) and len(oks) == len(betas) else 'no'} "
                        f"(largest upper end {upper:+.3%}, tolerance {QUALITY_TOLERANCE:.1%})")
    return "\n".join(rows)


def trajectory(runs: list[dict], policy: str, beta2: float) -> str:
    """Mean cost over seeds at each evaluation point: whether it settles or grows with the run."""
    rs = [r for r in runs if r["beta2"] == beta2 and policy in r["points"][-1]]
    if not rs:
        return ""
    pts = [p["step"] for p in rs[0]["points"]]
    return f"{policy} at beta2 {beta2}: " + ", ".join(
        f"{s}: {statistics.mean(r['points'][i][policy]['cost'] for r in rs):+.3%}" for i, s in enumerate(pts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--beta2", default="0.95,0.999", help="comma-separated AdamW beta2 values")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--val-batches", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write every run's record here")
    ap.add_argument("--table", nargs="+", metavar="RUNS_JSON", help="no runs: the table of earlier --json files")
    ap.add_argument("--paired", action="store_true", help="the superseded paired-run estimator (600 steps, "
                    "8 blocks, 8 x 128 tokens a step, beta2 0.95)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.paired:
        return paired_runs(args)
    if args.table:
        runs = [r for name in args.table for r in json.load(open(name))["runs"]]
    else:
        data, config, runs = cached_default_corpus(), model(args.layers), []
        for b in [float(x) for x in args.beta2.split(",")]:
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                runs.append(shadow_run(config, seed, args.steps, b, data, args.val_batches))
                end = runs[-1]["points"][-1]
                print(f"beta2 {b} seed {seed}: " + ", ".join(f"{p} {end[p]['cost']:+.3%}" for p in SHADOWS)
                      + f" ({runs[-1]['seconds']:.0f} s)", flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"runs": runs}, f)
    print(shadow_table(runs))
    for b in sorted({r["beta2"] for r in runs}):
        for p in SHADOWS:
            print(trajectory(runs, p, b))


def paired_runs(args) -> None:
    """The superseded estimator: exact and each policy trained apart, seed by seed; the cost is the mean paired
    relative difference of final validation loss (quality_runs.train_run: 600 steps, 8 blocks)."""
    data, config = cached_default_corpus(), model(8)
    val = {}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for policy in ORDER:
            out, _ = train_run(config, seed, 600, data, host_policy=policy)
            val[policy, seed] = out["val_loss"]
            print(f"seed {seed} {policy:<13} val {out['val_loss']:.4f} ({out['seconds']:.0f} s)", flush=True)
    for policy in ORDER[1:]:
        costs = [val[policy, s] / val["exact", s] - 1 for s in range(args.first_seed, args.first_seed + args.seeds)]
        print(f"{policy}: {paired(costs).fmt(3, pct=True)}")


if __name__ == "__main__":
    main()
