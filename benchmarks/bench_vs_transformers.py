"""Streamed training against Hugging Face transformers on the same CPU, interleaved in one process (issue 20).

Run: `.venv/bin/python benchmarks/bench_vs_transformers.py` (about 10 minutes on 2 shared cores; `--rounds`,
`--steps`, `--out FILE.json`; needs the `bench` extra, which installs transformers). The `small` preset
(d 448, 8 blocks, vocab 256; 19.7M params, 75 MiB of fp32 weights), 4 micro-batches of 2 x 128 tokens per
step, fp32, AdamW (fused) with clipping at 1.0, trained four ways:

- `hf`: transformers' LlamaForCausalLM of the same shape (`models.hf.hf_config`), eager, the whole model and
  its gradients resident, the default (sdpa) attention;
- `hf+ckpt`: the same with `gradient_checkpointing_enable()` (per-layer recompute, what a user turns on to
  save memory);
- `streamed-56MiB`: megatrain on the sim device under a 56 MiB budget (below the model's 75 MiB of weights):
  the planner's schedule, units recomputed from checkpoints;
- `streamed-1GiB`: megatrain with a budget that holds everything: the planner keeps the graphs (no recompute);
- with `--full-recompute`, `streamed-56MiB-full`: the low budget again, its recomputes evaluating the blocks'
  down projections too (as before megatrain/models/unevaluated.py), to measure what leaving them unevaluated saves.

Step time is the steady period of back-to-back steps: for megatrain, the time between the final states (host
optimizer done, `Engine.final_time`) of consecutive steps, so the optimizer's time counts; for transformers,
the wall time of forward, backward, clip and optimizer step. Each round runs `--steps` + 1 steps of each way
in turn (the first of each block is dropped: it waits on nothing of the others' steps but starts cold), so
every ratio is taken under the same machine load. Ratios are paired per round (streamed over HF in the same
round) and the median and range over rounds are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch

from megatrain.models import preset
from megatrain.models.hf import hf_config
from megatrain.planner import TrainSpec
from megatrain.runtime import engine
from megatrain.runtime.config import RunConfig
from megatrain.runtime.trainer import Trainer

MiB = 2**20
SPEC = TrainSpec(micro_batch=2, seq_len=128, grad_accum=4, dtype="fp32", lr=1e-3, clip_norm=1.0, total_steps=10**4)


def _batch(seed: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    shape = (SPEC.micro_batch, SPEC.seq_len)
    return [(torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
            for _ in range(SPEC.grad_accum)]


class HF:
    """LlamaForCausalLM of the preset's shape, trained as a transformers user would."""

    def __init__(self, model: str, checkpointing: bool):
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = {k: v for k, v in hf_config(preset(model), "float32").items() if k not in ("architectures",)}
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(**cfg)).float().train()
        self.model.config.use_cache = False
        if checkpointing:
            kw = {"use_reentrant": False}
            if hasattr(self.model, "activation_checkpointing_enable"):  # the name in newer transformers
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=SPEC.lr, betas=SPEC.betas, eps=SPEC.eps,
                                     weight_decay=SPEC.weight_decay, fused=True)

    def steps(self, batch, n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.opt.zero_grad(set_to_none=True)
            for tokens, targets in batch:
                logits = self.model(input_ids=tokens).logits
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
                (loss / len(batch)).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), SPEC.clip_norm)
            self.opt.step()
            times.append(time.perf_counter() - t0)
        return times


class Streamed:
    def __init__(self, model: str, budget: int, compile_units: bool = False, full_recompute: bool = False):
        self.trainer = Trainer(RunConfig(model=model, train=SPEC, gpu_mem=budget, device="sim", compile_units=compile_units))
        self.full_recompute = full_recompute

    def steps(self, batch, n: int) -> list[float]:
        tr = self.trainer
        first = tr.engine.step_index
        with _full_recompute(self.full_recompute):
            t0 = time.perf_counter()
            for _ in range(n):
                tr.train_step(batch)
            tr.device.synchronize()
        finals = [t0] + [tr.engine.final_time(first + k) for k in range(n)]
        return [b - a for a, b in zip(finals, finals[1:])]


@contextlib.contextmanager
def _full_recompute(on: bool):
    """The backward's recompute evaluating every product (as before megatrain/models/unevaluated.py), for comparison."""
    if not on:
        yield
        return
    saved = engine.recompute_mode
    engine.recompute_mode = lambda kind: {}
    try:
        yield
    finally:
        engine.recompute_mode = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", help="a preset (default small)")
    ap.add_argument("--budgets", default="56,1024", help="the two streamed budgets in MiB: below the model's "
                    "weights, and one that holds everything (default 56,1024)")
    ap.add_argument("--compile-units", action="store_true", help="also run both streamed ways with the units "
                    "through torch.compile (megatrain/runtime/compiled.py); the warm-up round compiles")
    ap.add_argument("--full-recompute", action="store_true", help="also run the low budget with recomputes that "
                    "evaluate every product (the down projection included, as before megatrain/models/unevaluated.py)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds after a warm-up round")
    ap.add_argument("--steps", type=int, default=3, help="steps of each way per round (one more is dropped)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the main thread and the sim "
                    "device's compute stream (default 1: see docs/RESULTS.md on oversubscribed cores)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)  # the sim device's compute stream takes this count too
    batch = _batch(0, preset(args.model).vocab_size)
    low, high = (int(b) for b in args.budgets.split(","))
    streamed = (f"streamed-{low}MiB", f"streamed-{high}MiB")
    ways = {"hf": HF(args.model, False), "hf+ckpt": HF(args.model, True),
            streamed[0]: Streamed(args.model, low * MiB), streamed[1]: Streamed(args.model, high * MiB)}
    if args.compile_units:
        for name, budget in zip(streamed, (low, high)):
            ways[f"{name}+compile"] = Streamed(args.model, budget * MiB, compile_units=True)
        streamed = (*streamed, *(f"{n}+compile" for n in streamed))
    if args.full_recompute:
        ways[f"{streamed[0]}-full"] = Streamed(args.model, low * MiB, full_recompute=True)
        streamed = (*streamed, f"{streamed[0]}-full")
    for name in streamed:
        p = ways[name].trainer.plan
        print(f"{name}: {p.n_slots} slot(s), checkpoints "
              f"{ {k: sum(1 for v in p.placement.values() if v == k) for k in ('device', 'host', 'keep')} }")
    t_start = time.perf_counter()
    per_round: list[dict[str, float]] = []
    try:
        for r in range(args.rounds + 1):
            got = {name: statistics.median(w.steps(batch, args.steps + 1)[1:]) for name, w in ways.items()}
            if r:
                per_round.append(got)
            print(f"round {r}: " + ", ".join(f"{k} {v:.3f} s" for k, v in got.items())
                  + f" ({time.perf_counter() - t_start:.0f} s)", flush=True)
    finally:
        for w in ways.values():
            if isinstance(w, Streamed):
                w.trainer.close()
    tokens = SPEC.tokens_per_step
    rows = {name: {"median_s": statistics.median(x[name] for x in per_round)} for name in ways}
    pairs = {f"{s} / {h}": [x[h] / x[s] for x in per_round]  # tokens/s ratio = time ratio inverted
             for s in streamed for h in ("hf", "hf+ckpt")}
    print("\n| way | median s/step | tokens/s |\n|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['median_s']:.3f} | {tokens / row['median_s']:.0f} |")
    print("\n| streamed tokens/s over transformers tokens/s | median of paired rounds | range |\n|---|---|---|")
    for k, v in pairs.items():
        print(f"| {k} | **{statistics.median(v):.2f}** | {min(v):.2f}-{max(v):.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "rows": rows, "rounds": per_round, "pairs": pairs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
