"""One block's real memory on CPU, untiled and tiled, against the trace (issue 15's CPU demonstration).

Run: `.venv/bin/python benchmarks/tiled_memory.py --model CONFIG --seq-len 32768 --chunk 4096 [--dtype fp32]`.
Each variant runs in its own process on real CPU tensors: a block's no-grad forward, then its forward with
autograd and backward (as the engine's forward and backward instructions run it), with the tracer's
allocation tracker (megatrain/ir/scaled.LiveBytes, program buffers excluded as the planner counts them) and the process's
peak RSS growth over its inputs. It prints both next to the meta trace's figures (a scaled trace for long
sequences): the workspace the plan adds to its buffers.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def measure(model: str, seq: int, chunk: int | None, dtype: str) -> dict:
    import torch

    from megatrain.ir.scaled import LiveBytes
    from megatrain.ir.trace import DTYPES, _unit_inputs, canonical_dtype, trace
    from megatrain.models import load_model_config, run_unit, templates

    config = load_model_config(model)
    dt = DTYPES[canonical_dtype(dtype)]
    ir = trace(config, 1, seq, dtype, target="cpu", chunk_tokens=chunk)
    u = ir.units[1]
    tm = templates(config)[u.template]
    inputs = _unit_inputs("block", config, 1, seq, dt, 1024, "cpu", chunk=chunk)
    g = torch.Generator().manual_seed(0)
    params = {n: (torch.randn(p.shape, generator=g) * 0.02).to(dt).requires_grad_() for n, p in tm.named_parameters()}
    carry = tuple(torch.randn(s.shape, generator=g).to(dt).requires_grad_() for s in u.carry_in)
    grad_out = tuple(torch.randn(s.shape, generator=g).to(dt) for s in u.carry_out)
    existing = [*params.values(), *carry, *grad_out, inputs.cos, inputs.sin]
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.no_grad(), LiveBytes(None, existing) as fwd:
        out = run_unit(tm, params, carry, inputs)
        fwd.exclude(out)
    del out
    with LiveBytes(None, existing) as bwd:
        out = run_unit(tm, params, carry, inputs)
        grads = torch.autograd.grad(out, [*params.values(), *carry], grad_out)
        bwd.exclude(grads[len(params):])
        del out, grads
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0

    def peak(m):
        return max(sum(n for _, n in s) for s in m.sums)

    return {"chunk_tokens": chunk, "seq_len": seq, "measured_fwd_bytes": peak(fwd), "measured_bwd_bytes": peak(bwd),
            "traced_fwd_bytes": u.peak_fwd_bytes, "traced_bwd_bytes": u.peak_bwd_bytes,
            "traced_at": ir.traced_seq_len, "rss_growth_bytes": rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--chunk", type=int, required=True)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--one", choices=("untiled", "tiled"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        chunk = None if args.one == "untiled" else args.chunk
        print(json.dumps(measure(args.model, args.seq_len, chunk, args.dtype)))
        return
    for one in ("untiled", "tiled"):  # separate processes: each peak RSS is its own
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--seq-len", str(args.seq_len),
                              "--chunk", str(args.chunk), "--dtype", args.dtype, "--one", one],
                             capture_output=True, text=True, check=True)
        print(out.stdout.strip())


if __name__ == "__main__":
    main()
