"""Streamed training on a real GPU: tokens/s, model TFLOP/s, MFU, memory against the plan, per-stream busy shares.

Run on a machine with an NVIDIA GPU (benchmarks/gpu/run.sh runs it once per case, each case in its own process
under its own time limit, with the preflight's measured profile):
    python -P benchmarks/gpu_step.py --models llama3-8b@8192 --hardware hw.json --gpu-mem 60GiB --out rows.jsonl
A case is `model[:layers][@seq]` (a case without @ runs at --seq-len capped at the model's max_seq_len); the
default is run.sh's: llama3-8b at 8192 tokens (the headline), then qwen2.5-14b at 4096. Synthetic tokens
(uniform over the vocabulary); bf16 compute, fp32 masters on the host.
Host memory is the profile's (preflight.py: the kind's documented size less a headroom) or --host-mem, never
this machine's MemAvailable: the lent machines start with far less memory than they give as it is used, so a
plan for MemAvailable would be refused or squeezed into a compact host policy. The Trainer's own check is held
to the same figure (megatrain/runtime/trainer.py HOST_MEM_ENV). The host-policy pass then picks the most exact host state
that fits (qwen2.5-14b's exact state does not fit 120 GiB; a compressed one does); a case that fits under no
policy is a row saying why.
One JSON line per case, appended to --out as soon as it is made: measured and predicted step time, tokens/s,
model TFLOP/s (6N per token with the head, plus causal attention 6 L d s), MFU against the profile's peak, the
device memory report beside the plan's like figures (trainer.py planned_memory), host RSS against the plan's
host bytes, the seconds the setup (host store allocated and pinned) and the warm-up step took, and each
stream's busy share of the measured steps (the largest is the binding limit). Progress goes to stderr, so a
case cut off by its time limit leaves in the log how far it came.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

DEFAULT_CASES = "llama3-8b@8192,qwen2.5-14b@4096"


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


def _say(msg: str) -> None:
    print(f"gpu_step: {msg}", file=sys.stderr, flush=True)


def host_hardware(args):
    """The profile to plan with, its host memory --host-mem when given (else the profile's own: the
    preflight's documented size, or a preset's)."""
    from megatrain.planner import parse_bytes, resolve_hardware

    hw = resolve_hardware(args.hardware)
    if args.host_mem:
        hw = hw.replace(host_memory_bytes=parse_bytes(args.host_mem))
    return hw


def plan_case(case: str, args):
    """(config, spec, hw, plan, row): the case planned for the profile's host memory; plan is None (and the
    row says why) when no host policy fits."""
    from megatrain.ir.trace import trace
    from megatrain.planner import TrainSpec, parse_bytes, plan

    config, seq = parse_case(case, args.seq_len)
    spec = TrainSpec(micro_batch=args.micro_batch, seq_len=seq, grad_accum=args.grad_accum,
                     dtype="bf16", lr=1e-4, total_steps=1000)
    hw = host_hardware(args)
    budget = parse_bytes(args.gpu_mem)
    row = {"case": case, "model": config.name, "seq_len": seq, "micro_batch": spec.micro_batch,
           "grad_accum": spec.grad_accum, "tokens_per_step": spec.tokens_per_step, "gpu_budget_bytes": budget,
           "host_memory_bytes": hw.host_memory_bytes, "hardware": hw.name}
    target = "cuda" if args.device == "cuda" else "cpu"
    try:
        p = plan(trace(config, spec.micro_batch, seq, spec.dtype, target=target), hw, spec, budget,
                 host_policy=args.host_policy, resident=args.resident)
    except ValueError as e:
        return config, spec, hw, None, {**row, "skipped": f"no plan: {e}"}
    placements: dict[str, int] = {}
    for u in p.units:
        placements[u.placement] = placements.get(u.placement, 0) + 1
    row.update({"params": p.ir.params_total, "host_policy": p.host_policy, "host_bytes": p.host_bytes,
                "predicted_step_s": p.step_time_s, "predicted_tokens_per_s": p.tokens_per_s,
                "bottleneck": p.bottleneck, "unit_placements": placements, "resident": args.resident,
                "resident_units": list(p.resident_units)})
    return config, spec, hw, p, row


def run_case(case: str, args) -> dict:
    from megatrain.runtime import host_kernel
    from megatrain.runtime.config import RunConfig
    from megatrain.runtime.trainer import HOST_MEM_ENV, Trainer

    config, spec, hw, p, row = plan_case(case, args)
    if p is None:
        return row
    _say(f"{case}: planned ({p.host_policy}, host {p.host_bytes / 2**30:.1f} of "
         f"{hw.host_memory_bytes / 2**30:.0f} GiB, predicted {p.step_time_s:.2f} s/step)")
    # the Trainer refuses a plan above MemAvailable: hold it to the host memory planned for instead
    os.environ.setdefault(HOST_MEM_ENV, str(hw.host_memory_bytes))
    g = torch.Generator().manual_seed(0)
    shape = (spec.micro_batch, spec.seq_len)
    batch = [(torch.randint(0, config.vocab_size, shape, generator=g),
              torch.randint(0, config.vocab_size, shape, generator=g)) for _ in range(spec.grad_accum)]
    t0 = time.perf_counter()
    t = Trainer(RunConfig(model=config, train=spec, gpu_mem=p.gpu_budget_bytes, hardware=hw, device=args.device,
                          resident=args.resident), plan=p)
    try:
        setup_s = time.perf_counter() - t0
        _say(f"{case}: host store allocated and pinned in {setup_s:.1f} s")
        t0 = time.perf_counter()
        t.train_step(batch)  # warm-up: allocator, kernels, first optimizer pass
        t.device.synchronize()
        warmup_s = time.perf_counter() - t0
        _say(f"{case}: warm-up step {warmup_s:.1f} s")
        t.device.reset_peak()
        t.engine.start_timeline()
        times = []
        for i in range(args.steps):
            t0 = time.perf_counter()
            t.train_step(batch)
            t.device.synchronize()
            times.append(time.perf_counter() - t0)
            _say(f"{case}: step {i + 1}/{args.steps} {times[-1]:.2f} s")
        step_s = sorted(times)[len(times) // 2]
        flops = model_flops_per_token(config, spec.seq_len) * spec.tokens_per_step
        traced = sum(u.flops_fwd + u.flops_bwd for u in p.ir.units) * spec.grad_accum
        peak_flops = hw.peak_flops.get("bfloat16", 0.0)
        return {**row, "setup_s": setup_s, "warmup_s": warmup_s, "measured_step_s": step_s,
                "step_times_s": times, "tokens_per_s": spec.tokens_per_step / step_s,
                "model_tflops": flops / step_s / 1e12, "traced_tflops": traced / step_s / 1e12,
                "mfu": flops / step_s / peak_flops if peak_flops else None,
                **t.device.memory_report(), **t.planned_memory(),
                "host_rss_bytes": _rss_bytes(), "cpu": t.device.cpu.describe(),
                "host_optimizer": host_kernel.why_not() or "one pass (megatrain/runtime/host_kernel.c)",
                "busy_share": busy_shares(t.engine.measured_spans(), sum(times)),
                "time_ratio_measured_over_predicted": step_s / p.step_time_s}
    finally:
        t.close()


def free_case() -> None:
    """What a case leaves behind, freed before the next one in this process: the Trainer, its Engine, device
    and HostStore hold one another (reference cycles), which only the cyclic GC collects, and the planner
    switches it off while it plans; then the CUDA allocator's cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _status(row: dict, gpu: str) -> str:
    """The row's one-line status for the run's summary (benchmarks/gpu/summary.py reads it)."""
    if "tokens_per_s" in row:
        what = f"{row['tokens_per_s']:,.0f} tokens/s, {row['host_policy']}"
        return f"rehearsed: {what} on {gpu}" if "fake" in gpu.lower() else f"measured: {what}"
    if "skipped" in row:
        return f"skipped: {row['skipped'][:200]}"
    return f"error: {row.get('error', 'no figures')[:200]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=DEFAULT_CASES, help="cases model[:layers][@seq], comma-separated")
    ap.add_argument("--hardware", default="h200", help="a preset or a profile file (run.sh: the preflight's)")
    ap.add_argument("--host-mem", default=None, help="host memory to plan with, overriding the profile's")
    ap.add_argument("--host-policy", default="auto")
    ap.add_argument("--resident", choices=["auto", "none"], default="auto",
                    help="where units' state lives (the planner's residency pass): auto, or none (every unit streamed)")
    ap.add_argument("--gpu-mem", default="40GiB")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--stage", default=None, help="the run.sh stage this row belongs to (its summary reads it)")
    ap.add_argument("--device", choices=["cuda", "sim"], default="cuda", help="sim: the CPU tests' twin")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import megatrain  # noqa: F401  (MEGATRAIN_FAKE_CUDA=1 installs the fake backend on import)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_step: no CUDA device; nothing measured", file=sys.stderr)
        return 1
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "the sim device"
    for name in args.models.split(","):
        try:
            row = run_case(name.strip(), args)
        except Exception as e:  # one model failing must not hide the others' figures
            row = {"case": name, "error": f"{type(e).__name__}: {e}"[:2000]}
        free_case()
        row = {**({"stage": args.stage} if args.stage else {}), "system": "megatrain", **row,
               "status": _status(row, gpu)}
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:  # appended at once: a later case cut off leaves this one
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
