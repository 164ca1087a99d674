"""The systems a user would pick instead, on the same model, tokens per step and precision as
benchmarks/gpu_step.py: PyTorch FSDP2 with CPUOffloadPolicy (world size 1) and DeepSpeed ZeRO-3 with CPU offload.

Usage (one system and case per process, as benchmarks/gpu/run.sh runs it):
    python -P benchmarks/gpu/peers.py --system fsdp2 --case 1b@2048 --out peers.jsonl
The model is megatrain's own eager model (models/transformer.py, build_eager) with its chunked loss, so the
FLOPs are the same; parameters, gradients and AdamW state live on the host (fp32), compute is bf16 with fp32
gradient reduction, every block its own shard group. DeepSpeed uses its CPU Adam when its extension builds and
says so; otherwise torch AdamW (`zero_force_ds_cpu_optimizer: false`), also said in the row. A system that
is not installed gives a row saying so. One JSON line: tokens/s, model TFLOP/s (gpu_step's count), MFU, peak
allocated and reserved GPU memory, host RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpu_step  # noqa: E402  (its cases and FLOP count)


class LossModel(torch.nn.Module):
    """The eager model's summed token loss through its chunked head (runtime/reference.py), as one module
    whose forward a wrapper (FSDP2's root, DeepSpeed's engine) can own."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, targets, n_tokens):
        from megatrain.models import routing
        from megatrain.runtime.reference import _loss_sum

        logs = [routing.RoutingLog() for _ in self.model.blocks]
        return _loss_sum(self.model, tokens, targets, False, 1024, logs, 1.0 / n_tokens) / n_tokens


def _batch(config, spec, device):
    g = torch.Generator().manual_seed(0)
    shape = (spec.micro_batch, spec.seq_len)
    return [(torch.randint(0, config.vocab_size, shape, generator=g).to(device),
             torch.randint(0, config.vocab_size, shape, generator=g).to(device)) for _ in range(spec.grad_accum)]


def fsdp2(config, spec, device="cuda"):
    """FSDP2 over a one-rank mesh; on `cpu` (the CI rehearsal of this wiring) gloo and no offload policy."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from megatrain.models import build_eager

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(device, (1,))
    kw = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if device == "cuda":
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    model = LossModel(build_eager(config, dtype=torch.float32))
    for block in model.model.blocks:
        fully_shard(block, **kw)
    if not config.tie_embeddings:  # a tied embedding and head share one parameter: the root holds it
        fully_shard(model.model.embed, **kw)
        fully_shard(model.model.head, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch):
        n = sum(y.numel() for _, y in batch)
        for i, (x, y) in enumerate(batch):
            model.set_requires_gradient_sync(i == len(batch) - 1)
            model(x, y, n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    where = "on the host (FSDP2 CPUOffloadPolicy)" if device == "cuda" else "on the CPU (no offload: rehearsal)"
    return step, {"optimizer": f"torch AdamW {where}", "params": model.parameters}


def deepspeed_zero3(config, spec, device="cuda"):
    import deepspeed

    from megatrain.models import build_eager

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29518")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    model = LossModel(build_eager(config, dtype=torch.float32))
    opt, note = None, "torch AdamW (DeepSpeed's CPU Adam is not prebuilt in this install: built on first use it "
    note += "would compile for minutes, past this case's time limit)"
    if _cpu_adam_prebuilt():
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            opt, note = DeepSpeedCPUAdam(model.parameters(), lr=1e-4), "DeepSpeedCPUAdam"
        except Exception as e:  # a prebuilt op that does not load on this machine
            note = f"torch AdamW (DeepSpeed's CPU Adam did not load: {type(e).__name__}: {str(e)[:120]})"
    if opt is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cfg = {"train_micro_batch_size_per_gpu": spec.micro_batch, "gradient_accumulation_steps": spec.grad_accum,
           "bf16": {"enabled": True}, "zero_force_ds_cpu_optimizer": False,
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                 "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)

    def step(batch):
        n = sum(y.numel() for _, y in batch)
        for x, y in batch:
            loss = engine(x, y, n)
            engine.backward(loss)
            engine.step()

    return step, {"optimizer": note, "params": model.parameters}


def _cpu_adam_prebuilt() -> bool:
    """Whether DeepSpeed was installed with its CPU Adam op compiled (DS_BUILD_CPU_ADAM=1), as ds_report reads
    it: otherwise the first DeepSpeedCPUAdam() JIT-compiles the extension (about a minute with nvcc)."""
    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        return False
    return bool(installed_ops.get("cpu_adam"))


SYSTEMS = {"fsdp2": ("torch.distributed.fsdp", fsdp2), "deepspeed": ("deepspeed", deepspeed_zero3)}


def run(system: str, case: str, steps: int, micro_batch: int, grad_accum: int, device: str = "cuda") -> dict:
    import importlib.util

    from megatrain.planner import TrainSpec

    config, seq = gpu_step.parse_case(case, 4096)
    spec = TrainSpec(micro_batch=micro_batch, seq_len=seq, grad_accum=grad_accum, dtype="bf16", lr=1e-4,
                     total_steps=1000)
    row = {"system": system, "case": case, "model": config.name, "seq_len": seq,
           "tokens_per_step": spec.tokens_per_step}
    module, build = SYSTEMS[system]
    if importlib.util.find_spec(module.split(".")[0]) is None or (
            system == "fsdp2" and importlib.util.find_spec(module) is None):
        return {**row, "skipped": f"{module} is not installed in this image"}
    step, notes = build(config, spec, device)
    params = notes.pop("params")
    batch = _batch(config, spec, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    before = [p.detach().full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
              for p in params()] if device == "cpu" else None
    step(batch)  # warm-up
    sync()
    if device == "cpu":  # the rehearsal: a step ran and changed the weights
        after = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in params()]
        return {**row, **notes, "device": "cpu", "weights_changed": sum(not torch.equal(a, b)
                                                                        for a, b in zip(before, after)),
                "n_params": len(after)}
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(batch)
        sync()
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    flops = gpu_step.model_flops_per_token(config, seq) * spec.tokens_per_step
    from megatrain.planner import hardware_preset

    peak = hardware_preset("h200").peak_flops.get("bfloat16", 0.0)
    return {**row, **notes, "measured_step_s": step_s, "tokens_per_s": spec.tokens_per_step / step_s,
            "model_tflops": flops / step_s / 1e12, "mfu": flops / step_s / peak if peak else None,
            "peak_device_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(), "host_rss_bytes": gpu_step._rss_bytes()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    ap.add_argument("--case", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: one warm-up step with gloo and no offload, the CI rehearsal of the wiring")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("peers: no CUDA device; nothing measured", file=sys.stderr)
        return 1
    try:
        row = run(args.system, args.case, args.steps, args.micro_batch, args.grad_accum, args.device)
    except Exception as e:  # a peer failing is a row, not a lost run
        row = {"system": args.system, "case": args.case, "error": f"{type(e).__name__}: {e}"[:500]}
    line = json.dumps(row)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
