"""Training throughput of the depth mixings: the eager model's forward and backward, per variant and shape.

    python -P benchmarks/depth_throughput.py --out depth_throughput.json            # a GPU: 125m and 1b, bf16
    python -P benchmarks/depth_throughput.py --rehearse --out x.json               # tiny sizes on the CPU
    python -P benchmarks/depth_throughput.py --device cpu --dtype fp32 --shapes small:4x256 \\
        --variants depthssd:8:chunk=1,depthssd:8 --steps 5 --count-bytes             # CPU step time, bytes moved

Variants: the residual, DenseFormer with its in-place running sum (models/depth/denseformer.py `dwa`) and with a
naive stack-then-reduce, Hyper-Connections (4 streams, static), Block AttnRes (the divisor of 2 x n_layers
nearest 8 blocks) and DepthSSD-8 reading its state per sub-layer (`chunk=1`) and per block (`chunk=2`, the
default). A shape is `preset:BxT` (micro-batch B of T tokens). Every variant of a shape runs on the same
synthetic tokens; weights are drawn on the device (values do not change the work), the mixings' own from their
init (models/depth). The step is `model(tokens, targets)` (full logits, summed cross-entropy) then backward: the
same head in every variant, so differences are the mixing's. Timing: CUDA events around each measured step on a
GPU (the median), the wall clock on the CPU. Model TFLOP/s counts the residual model's FLOPs
(benchmarks/gpu_step.py model_flops_per_token) for every variant: it is tokens/s in other units, the mixing's
own work counted as overhead.

`--count-bytes` also counts, in one step under a dispatch mode, the bytes each non-view aten op reads and writes
(its tensor arguments and results): per token, for the state traffic of a mixing (docs/RESULTS.md).

Output: one JSON object (--out): the device, the rows (shape, variant, tokens/s, model TFLOP/s, step ms, peak
memory, status) and a status line that benchmarks/gpu/summary.py reads. `--budget-s` stops starting runs that
the time left cannot hold (a run is estimated as the slowest so far of its shape), each said as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

import megatrain  # noqa: F401  (first: under MEGATRAIN_FAKE_CUDA it installs the fake before torch.cuda is asked)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpu_step's FLOP count (-P drops the script's folder)

VARIANTS = ["residual", "denseformer", "denseformer-stack", "hc:4", "attnres", "depthssd:8:chunk=1", "depthssd:8"]
DEVICE_SHAPES = ["125m:8x1024", "1b:4x2048"]
REHEARSAL_SHAPES = ["tiny:1x32", "tiny:1x64"]


def stacked_dwa(alpha, xs):
    """DenseFormer's DWA as a naive implementation writes it: stack the sources, weigh, reduce."""
    stack = torch.stack(xs)
    return (alpha.to(stack.dtype).view(-1, *([1] * xs[0].dim())) * stack).sum(0)


def denseformer_dwa(alpha, xs):
    from megatrain.models.depth import denseformer

    return denseformer.dwa(alpha, xs)


def attnres_blocks(n_layers: int, want: int = 8) -> int:
    return min((k for k in range(1, 2 * n_layers + 1) if (2 * n_layers) % k == 0), key=lambda k: (abs(k - want), k))


def spec_of(variant: str, n_layers: int) -> str:
    if variant == "denseformer-stack":
        return "denseformer"
    if variant == "attnres":
        return f"attnres:{attnres_blocks(n_layers)}"
    return variant


def parse_shape(text: str):
    from megatrain.models import load_model_config

    name, _, bt = text.partition(":")
    b, _, t = (bt or "1x1024").partition("x")
    return load_model_config(name), int(b), int(t)


def build(config, device: str, dtype: torch.dtype, seed: int = 0):
    """The eager model on `device`: matrices N(0, init_std), norms 1, the mixing's parameters at their init."""
    from megatrain.models import depth
    from megatrain.models.eager import EagerModel

    with torch.device("meta"):
        model = EagerModel(config)
    model = model.to_empty(device=device)
    if config.tie_embeddings:
        model.head.lm_head.weight = model.embed.embed_tokens.weight
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mix = depth.init_param(config, name, tuple(p.shape), g)
            if mix is not None:
                p.copy_(mix)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, config.init_std)
    return model.to(dtype)


class ByteCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes that non-view aten ops read and write: every tensor argument and result, once per op."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func is not torch.ops.aten.detach.default:
            flat = torch.utils._pytree.tree_leaves((args, kwargs or {}, out))
            self.bytes += sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
        return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(config, batch: int, seq: int, device: str, dtype: torch.dtype, steps: int, warmup: int,
            count_bytes: bool) -> dict:
    model = build(config, device, dtype)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)

    def step():
        model(x, y).backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(warmup):
        step()
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    row = {"step_s": statistics.median(times), "step_s_all": [round(t, 5) for t in times]}
    if device == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    if count_bytes:
        with ByteCount() as bc:
            step()
        row["bytes_per_token"] = bc.bytes / (batch * seq)
    return row  # the model goes with this frame, before the next variant is built


def run(shapes: list[str], variants: list[str], device: str, dtype: torch.dtype, steps: int, warmup: int,
        budget_s: float, count_bytes: bool, log=print, saved=lambda rows: None, clock=time.perf_counter) -> list[dict]:
    from gpu_step import model_flops_per_token

    from megatrain.models import ModelConfig
    from megatrain.models.depth import denseformer

    t_start, rows = clock(), []
    for shape in shapes:
        base, batch, seq = parse_shape(shape)
        slowest = 0.0
        for variant in variants:
            spec = spec_of(variant, base.n_layers)
            row = {"shape": shape, "variant": variant, "spec": spec, "tokens": batch * seq}
            left = budget_s - (clock() - t_start)
            if left <= 0 or left < slowest * 1.2:
                rows.append({**row, "status": f"skipped: {left:.0f} s left of the budget, a run took {slowest:.0f} s"})
                log(f"{shape} {variant}: skipped (budget)")
                continue
            config = ModelConfig(**{**base.model_dump(), "depth_mixing": spec})
            t0 = clock()
            dwa = denseformer.dwa
            try:
                if variant == "denseformer-stack":
                    denseformer.dwa = stacked_dwa
                got = measure(config, batch, seq, device, dtype, steps, warmup, count_bytes)
                tps = batch * seq / got["step_s"]
                row.update(got, status="measured", tokens_per_s=round(tps, 1),
                           model_tflops=round(model_flops_per_token(base, seq) * tps / 1e12, 3))
            except torch.OutOfMemoryError as e:
                row["status"] = f"failed: out of memory ({str(e).splitlines()[0][:120]})"
            finally:
                denseformer.dwa = dwa
                if device == "cuda":
                    torch.cuda.empty_cache()
            slowest = max(slowest, clock() - t0)
            rows.append(row)
            saved(rows)  # a run cut off by its limit still leaves what it measured
            log(f"{shape} {variant}: {row['status']}" + (f", {row['tokens_per_s']:,.0f} tokens/s, "
                f"{row['model_tflops']:.1f} TFLOP/s, step {row['step_s'] * 1e3:.1f} ms" if "tokens_per_s" in row
                else ""))
    return rows


def ratios(rows: list[dict]) -> list[str]:
    """Per shape: DepthSSD chunked over per-sub-layer reads, DenseFormer in place over the stack."""
    out = []
    by = {(r["shape"], r["variant"]): r.get("tokens_per_s") for r in rows}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        pairs = [("depthssd:8", "depthssd:8:chunk=1", "DepthSSD-8 chunked/per sub-layer"),
                 ("denseformer", "denseformer-stack", "DenseFormer in place/stack"),
                 ("depthssd:8", "denseformer", "DepthSSD-8/DenseFormer")]
        got = [f"{what} {by[(shape, a)] / by[(shape, b)]:.2f}x" for a, b, what in pairs
               if by.get((shape, a)) and by.get((shape, b))]
        if got:
            out.append(f"{shape}: " + ", ".join(got))
    return out


def status_line(rows: list[dict], device_name: str, rehearse: bool) -> str:
    measured = [r for r in rows if r["status"] == "measured"]
    failed = [r for r in rows if r["status"].startswith("failed")]
    skipped = [r for r in rows if r["status"].startswith("skipped")]
    if not measured:
        return "failed: no run measured" + (f" ({failed[0]['variant']}: {failed[0]['status']})" if failed else "")
    head = "rehearsed" if rehearse else "measured"
    text = f"{head}: {len(measured)} of {len(rows)} runs on {device_name}"
    if failed:
        text += f"; failed: {', '.join(r['shape'] + ' ' + r['variant'] for r in failed)}"
    if skipped:
        text += f"; {len(skipped)} skipped for time"
    if rehearse:  # one step of tiny models on a CPU: the ratios would be noise
        return text
    return text + ("; " + "; ".join(ratios(rows)) if ratios(rows) else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rehearse", action="store_true", help="tiny shapes, 1 warm-up and 1 step (the CPU rehearsal)")
    ap.add_argument("--shapes", help=f"comma-separated preset:BxT (default {','.join(DEVICE_SHAPES)})")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on a GPU, fp32 on the CPU")
    ap.add_argument("--steps", type=int, default=None, help="measured steps a run (default 5; rehearsal 1)")
    ap.add_argument("--warmup", type=int, default=None, help="default 2; rehearsal 1")
    ap.add_argument("--budget-s", type=float, default=230.0, help="start no run the time left cannot hold")
    ap.add_argument("--count-bytes", action="store_true", help="also count the bytes ops move in one step")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--out", help="the JSON result (default: stdout only)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shapes = (a.shapes or ",".join(REHEARSAL_SHAPES if a.rehearse else DEVICE_SHAPES)).split(",")
    steps, warmup = a.steps or (1 if a.rehearse else 5), a.warmup if a.warmup is not None else (1 if a.rehearse else 2)
    a.dtype = a.dtype or ("bf16" if device == "cuda" else "fp32")  # CPUs run bf16 matmuls far below fp32
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    def save(rows: list[dict]) -> dict:
        result = {"stage": "depth-throughput", "device": name, "dtype": a.dtype, "steps": steps, "warmup": warmup,
                  "status": status_line(rows, name, a.rehearse), "rows": rows}
        if a.out:
            with open(f"{a.out}.tmp", "w") as f:
                f.write(json.dumps(result, indent=1) + "\n")
            os.replace(f"{a.out}.tmp", a.out)
        return result

    rows = run(shapes, a.variants.split(","), device, dtype, steps, warmup, a.budget_s, a.count_bytes,
               log=lambda s: print(f"depth_throughput: {s}", file=sys.stderr, flush=True), saved=save)
    result = save(rows)
    print(result["status"])
    return 0 if not result["status"].startswith("failed") else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
