"""Streamed training on a real GPU: tokens/s, model TFLOP/s, MFU, memory against the plan, per-stream busy shares.

Run on a machine with an NVIDIA GPU (benchmarks/gpu/run.sh runs it with its defaults, offline):
    .venv/bin/python benchmarks/gpu_step.py --hardware h200 --gpu-mem 40GiB --steps 3 --out gpu_step.jsonl
A case is `model[:layers][@seq]`: the default `1b@2048,llama2-7b:4,llama2-7b,llama3-8b` is the 1B preset at
its longest sequence, a truncated 7B (its first 4 blocks), then llama2-7b and llama3-8b; a case without @ runs
at --seq-len capped at the model's max_seq_len. Synthetic tokens (uniform over the vocabulary); bf16 compute,
fp32 masters on the host. The plan is made for this machine's available host memory, so the host-policy pass
picks the most exact host state that fits (llama2-7b's 12-16 B/param exact state does not fit a 128 GiB
machine; bf16-moments does); a case that fits under no policy is skipped with the reason.
One JSON line per case: measured and predicted step time, tokens/s, model TFLOP/s (6N per token with the
head, plus causal attention 6 L d s), MFU against the profile's peak, the device memory report beside the
plan's like figures (trainer.py planned_memory), host RSS against the plan's host bytes, and each stream's
busy share of the measured steps (the largest is the binding limit).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

DEFAULT_CASES = "1b@2048,llama2-7b:4,llama2-7b,llama3-8b"


def parse_case(text: str, seq_len: int):
    """(config, seq) of a case `model[:layers][@seq]` (module docstring)."""
    from megatrain.models import load_model_config

    text, _, seq = text.strip().partition("@")
    name, _, layers = text.partition(":")
    config = load_model_config(name)
    if layers:
        config = type(config).model_validate({**config.model_dump(), "n_layers": int(layers),
                                              "name": f"{config.name}-{layers}L"})
    return config, int(seq) if seq else min(seq_len, config.max_seq_len)


def model_flops_per_token(config, seq: int) -> float:
    """Training FLOPs per token: 6 x the parameters a token's matmuls touch (every block, the head; not the
    input embedding, which is a lookup, unless tied, when it is the head) plus causal attention's 6 L d s."""
    d, L, V = config.d_model, config.n_layers, config.vocab_size
    kv = config.n_kv_heads or config.n_heads
    attn = d * d * 2 + 2 * d * (d // config.n_heads) * kv
    mlp = 3 * d * config.ffn_dim
    return 6 * (L * (attn + mlp) + V * d) + 6 * L * d * seq


def busy_shares(spans: list[tuple], wall_s: float) -> dict[str, float]:
    """Each stream's share of `wall_s` spent in its ops (spans from Engine.measured_spans())."""
    busy: dict[str, float] = {}
    for stream, _label, _step, start, end, _mem in spans:
        busy[stream] = busy.get(stream, 0.0) + max(0.0, end - start)
    return {s: round(b / wall_s, 4) for s, b in sorted(busy.items())} if wall_s > 0 else {}


def _rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def run_case(case: str, args) -> dict:
    from megatrain.ir.trace import trace
    from megatrain.planner import TrainSpec, parse_bytes, plan, resolve_hardware
    from megatrain.runtime import host_kernel
    from megatrain.runtime.trainer import Trainer, available_host_bytes

    config, seq = parse_case(case, args.seq_len)
    spec = TrainSpec(micro_batch=args.micro_batch, seq_len=seq, grad_accum=args.grad_accum,
                     dtype="bf16", lr=1e-4, total_steps=1000)
    avail = available_host_bytes() or 0
    hw = resolve_hardware(args.hardware)
    if avail:  # NOTE: the profile's host memory is a nominal machine's; plan for this one's
        hw = hw.replace(host_memory_bytes=int(0.9 * avail))
    budget = parse_bytes(args.gpu_mem)
    row = {"case": case, "model": config.name, "seq_len": seq, "micro_batch": spec.micro_batch,
           "grad_accum": spec.grad_accum, "tokens_per_step": spec.tokens_per_step, "gpu_budget_bytes": budget,
           "host_available_bytes": avail}
    try:
        p = plan(trace(config, spec.micro_batch, seq, spec.dtype, target="cuda"), hw, spec, budget)
    except ValueError as e:
        return {**row, "skipped": f"no plan: {e}"}
    row.update({"params": p.ir.params_total, "host_policy": p.host_policy, "host_bytes": p.host_bytes,
                "predicted_step_s": p.step_time_s, "predicted_tokens_per_s": p.tokens_per_s,
                "bottleneck": p.bottleneck})
    if avail and p.host_bytes > 0.9 * avail:
        return {**row, "skipped": f"host state {p.host_bytes / 2**30:.1f} GiB > 90% of available "
                                  f"{avail / 2**30:.1f} GiB under every host policy"}
    vocab = config.vocab_size
    g = torch.Generator().manual_seed(0)
    shape = (spec.micro_batch, seq)
    batch = [(torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
             for _ in range(spec.grad_accum)]
    with Trainer(config, spec, budget, hardware=hw, device="cuda", the_plan=p) as t:
        t.train_step(batch)  # warm-up: allocator, kernels, first optimizer pass
        t.device.synchronize()
        t.device.reset_peak()
        t.engine.start_timeline()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            t.train_step(batch)
            t.device.synchronize()
            times.append(time.perf_counter() - t0)
        step_s = sorted(times)[len(times) // 2]
        flops = model_flops_per_token(config, seq) * spec.tokens_per_step
        traced = sum(u.flops_fwd + u.flops_bwd for u in p.ir.units) * spec.grad_accum
        peak_flops = hw.peak_flops.get("bfloat16", 0.0)
        return {**row, "measured_step_s": step_s, "tokens_per_s": spec.tokens_per_step / step_s,
                "model_tflops": flops / step_s / 1e12, "traced_tflops": traced / step_s / 1e12,
                "mfu": flops / step_s / peak_flops if peak_flops else None,
                **t.device.memory_report(), **t.planned_memory(),
                "host_rss_bytes": _rss_bytes(), "cpu": t.device.cpu.describe(),
                "host_optimizer": host_kernel.why_not() or "one pass (runtime/host_kernel.c)",
                "busy_share": busy_shares(t.engine.measured_spans(), sum(times)),
                "time_ratio_measured_over_predicted": step_s / p.step_time_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=DEFAULT_CASES, help="cases model[:layers][@seq], comma-separated")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--gpu-mem", default="40GiB")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_step: no CUDA device; nothing measured", file=sys.stderr)
        return 1
    sink = open(args.out, "a") if args.out else None
    for name in args.models.split(","):
        try:
            row = run_case(name.strip(), args)
        except Exception as e:  # one model failing must not hide the others' figures
            row = {"case": name, "error": f"{type(e).__name__}: {e}"}
        line = json.dumps(row)
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
