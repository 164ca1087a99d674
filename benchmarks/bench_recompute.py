"""A block's recompute + backward with the products its backward never reads left unevaluated, against the same
work with every product computed (megatrain/models/unevaluated.py), untiled and tiled, interleaved in one process.

Run: `.venv/bin/python benchmarks/bench_recompute.py` (about a minute; `--model`, `--seq`, `--chunk`, `--rounds`,
`--out FILE.json`). What is timed is what a streamed backward does for a unit without a kept graph: the
block's forward with autograd from its checkpoint (`recompute=True`), then autograd.grad of its output; the
"full" way computes the down projection (and, tiled, the tiles' projections and the MLP tiles of the
recompute) as before. Gradients of both ways are checked equal bit for bit before timing. fp32, micro-batch 1,
one intra-op thread by default (`--threads`). Figures: docs/RESULTS.md, issue 20.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from megatrain.models import StepInputs, init_weights, preset, rope_tables, run_unit, templates
from megatrain.models import layers as transformer
from megatrain.models.units import template_key


def _case(model: str, seq: int, chunk: int | None):
    c = preset(model)
    tmpl = templates(c)[template_key(c, "blocks.1")]
    w = init_weights(c, seed=1)
    params = {n: w[f"blocks.1.{n}"] for n, _ in tmpl.named_parameters()}
    cos, sin = rope_tables(c, seq, torch.float32)
    inputs = StepInputs(cos=cos, sin=sin, chunk_tokens=chunk, target="cpu")
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(1, seq, c.d_model, generator=g), torch.randn(1, seq, c.d_model, generator=g)

    def run(lean: bool):
        unread = transformer._unread
        if not lean:  # the tiles' recompute runs the piece as the forward does
            transformer._unread = lambda piece: piece
        try:
            p = {n: v.detach().requires_grad_() for n, v in params.items()}
            xc = x.detach().requires_grad_()
            out = run_unit(tmpl, p, (xc,), inputs, None, **({"recompute": True} if lean else {}))
            return torch.autograd.grad(out, [*p.values(), xc], [dy])
        finally:
            transformer._unread = unread

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=1024, help="the tiled case's chunk (tokens)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for label, chunk in (("untiled", None), (f"tiled {args.chunk}", args.chunk)):
        run = _case(args.model, args.seq, chunk)
        full, lean = run(False), run(True)
        assert all(torch.equal(a, b) for a, b in zip(full, lean)), "gradients differ"
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for way in (False, True):
                t0 = time.perf_counter()
                run(way)
                times[way].append(time.perf_counter() - t0)
        ratios = [f / u for f, u in zip(times[False], times[True])]
        rows.append({"case": label, "full_s": statistics.median(times[False]),
                     "unevaluated_s": statistics.median(times[True]), "ratios": ratios,
                     "ratio": statistics.median(ratios)})
    print(f"{args.model}, 1 x {args.seq} tokens, fp32, {args.threads} thread(s): recompute + backward of one block")
    print("\n| case | full s | unevaluated s | full / unevaluated: median (range) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['full_s']:.3f} | {r['unevaluated_s']:.3f} | **{r['ratio']:.2f}** "
              f"({min(r['ratios']):.2f}-{max(r['ratios']):.2f}) |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "seq": args.seq, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
