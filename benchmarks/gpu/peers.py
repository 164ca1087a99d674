"""The systems a user would pick instead, on the same model, tokens, precision, micro-batches and activation
checkpointing as benchmarks/gpu_step.py: DeepSpeed ZeRO-3 with CPU offload and DeepSpeedCPUAdam, and PyTorch
FSDP2 with CPUOffloadPolicy and a fused AdamW (world size 1).

Usage (one system and case per process, as benchmarks/gpu/run.sh runs it, interleaved with megatrain's):
    python -P benchmarks/gpu/peers.py --system fsdp2 --case llama2-7b:8@4096 --out rows.jsonl
    python -P benchmarks/gpu/peers.py --build-cpu-adam --status ds_cpu_adam.txt   # beside the CUDA tests
    python -P benchmarks/gpu/peers.py --choose-case --preflight preflight.json --limit-s 28
The model is megatrain's own eager model (megatrain/models/eager.py, build_eager) with its chunked loss, every
block checkpointed (recomputed in the backward, as megatrain's plan recomputes or offloads its units), so the
FLOPs are the same; fp32 masters, gradients and AdamW moments live on the host, compute is bf16 with fp32
gradient reduction, every block its own shard group; a step is every micro-batch's forward and backward and
the optimizer step. DeepSpeed's CPU Adam is built on the device by DeepSpeed's own JIT op builder while the
CUDA tests run (--build-cpu-adam; ninja and nvcc are on the image) into TORCH_EXTENSIONS_DIR, which the
DeepSpeed run then loads: where that build failed the row says so, rather than timing DeepSpeed with torch's
AdamW (a slower optimizer would flatter megatrain). FSDP2 takes torch's fused AdamW on its CPU-offloaded
parameters, and foreach where fused fails there (the row says which). A system that is not installed gives a
row saying so. One JSON line: tokens/s, model TFLOP/s (gpu_step's count), MFU, peak allocated and reserved GPU
memory, host RSS. `--device cpu` is the CPU rehearsal of the same wiring: gloo, no offload policy (it needs
CUDA), DeepSpeed on its CPU accelerator, one step, and a row saying what ran.
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

# Host bytes per parameter: DeepSpeed ZeRO-3 with both offloads holds fp32 master, both moments and the fp32
# gradient partition (16), the bf16 parameter partition (2), and the fp32 model it starts from until it is cast
# and partitioned (4): 22 at its peak. FSDP2 with CPUOffloadPolicy: fp32 parameters, gradients, moments (16).
# megatrain's exact host state is 12-16. DeepSpeed's bounds the size all three hold.
PEER_HOST_BYTES_PER_PARAM = 22


class LossModel(torch.nn.Module):
    """The eager model's mean token loss through its chunked head (megatrain/runtime/reference.py), every block
    checkpointed, as one module whose forward a wrapper (FSDP2's root, DeepSpeed's engine) can own."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, targets, n_tokens):
        from megatrain.models import routing
        from megatrain.runtime.reference import _loss_sum

        logs = [routing.RoutingLog() for _ in self.model.blocks]
        return _loss_sum(self.model, tokens, targets, True, 1024, logs, 1.0 / n_tokens) / n_tokens


def _batch(config, spec, device):
    g = torch.Generator().manual_seed(0)
    shape = (spec.micro_batch, spec.seq_len)
    return [(torch.randint(0, config.vocab_size, shape, generator=g).to(device),
             torch.randint(0, config.vocab_size, shape, generator=g).to(device)) for _ in range(spec.grad_accum)]


def _say(msg: str) -> None:
    print(f"peers: {msg}", file=sys.stderr, flush=True)


def fsdp2(config, spec, device="cuda"):
    """FSDP2 over a one-rank mesh; on `cpu` (the rehearsal of this wiring) gloo and no offload policy."""
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
    _say("fsdp2: model built")
    for block in model.model.blocks:
        fully_shard(block, **kw)
    if not config.tie_embeddings:  # a tied embedding and head share one parameter: the root holds it
        fully_shard(model.model.embed, **kw)
        fully_shard(model.model.head, **kw)
    fully_shard(model, **kw)
    state = {"opt": torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), "kind": "fused"}

    def step(batch):
        n = sum(y.numel() for _, y in batch)
        for i, (x, y) in enumerate(batch):
            model.set_requires_gradient_sync(i == len(batch) - 1)
            model(x, y, n).backward()
        try:
            state["opt"].step()
        except (RuntimeError, NotImplementedError) as e:  # fused AdamW on offloaded DTensors unsupported here
            if state["kind"] != "fused":
                raise
            state["opt"] = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
            state["kind"] = f"foreach (fused failed: {type(e).__name__}: {str(e)[:120]})"
            state["opt"].step()
        state["opt"].zero_grad(set_to_none=True)

    where = "on the host (CPUOffloadPolicy)" if device == "cuda" else "on the CPU (gloo, no offload policy)"
    return step, {"optimizer": lambda: f"torch AdamW {state['kind']} {where}", "params": model.parameters}


def deepspeed_zero3(config, spec, device="cuda", cpu_adam_status: str | None = None):
    """DeepSpeed ZeRO-3, parameters and optimizer offloaded to pinned host memory, DeepSpeedCPUAdam; on `cpu`
    its CPU accelerator with gloo."""
    if device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed is first imported
    status = cpu_adam_build_status(cpu_adam_status)
    if status is not None and not status.startswith("built"):
        raise SkipPeer(f"DeepSpeedCPUAdam is not built ({status}): DeepSpeed is not timed with another optimizer")
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from megatrain.models import build_eager

    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29518", "RANK": "0", "LOCAL_RANK": "0",
                 "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    model = LossModel(build_eager(config, dtype=torch.float32))
    _say("deepspeed: model built")
    opt = DeepSpeedCPUAdam(model.parameters(), lr=1e-4, adamw_mode=True)
    cfg = {"train_micro_batch_size_per_gpu": spec.micro_batch, "gradient_accumulation_steps": spec.grad_accum,
           "bf16": {"enabled": True}, "steps_per_print": 10**9,
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": device == "cuda"},
                                 "offload_optimizer": {"device": "cpu", "pin_memory": device == "cuda"}}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)

    def step(batch):
        for x, y in batch:  # the engine divides each micro-batch's mean loss by the accumulation steps
            engine.backward(engine(x, y, y.numel()))
            engine.step()  # the optimizer steps at the accumulation boundary, inside the timed step

    where = "offloaded to the host" if device == "cuda" else "on the CPU accelerator (gloo)"
    return step, {"optimizer": lambda: f"DeepSpeedCPUAdam (JIT-built) {where}", "params": model.parameters}


class SkipPeer(Exception):
    """A peer that cannot be run fairly here: its row says why."""


def cpu_adam_build_status(path: str | None) -> str | None:
    """What --build-cpu-adam wrote (None: no build was asked for; the JIT builder then builds on first use)."""
    if path is None:
        return None
    try:
        return Path(path).read_text().strip() or "its build wrote nothing"
    except OSError:
        return "its build did not finish before this run"


def build_cpu_adam(status: str) -> int:
    """Build DeepSpeed's CPU Adam with DeepSpeed's own JIT op builder (into TORCH_EXTENSIONS_DIR, where the
    DeepSpeed run loads it from) and write `built in N s` or `failed: why` to `status`."""
    t = time.perf_counter()
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load(verbose=False)
        note = f"built in {time.perf_counter() - t:.0f} s"
        accel = get_accelerator()
        if accel.device_name() == "cpu":  # the rehearsal: its init JIT-builds shared-memory collectives too
            shm = accel.create_op_builder("ShareMemCommBuilder")
            if shm is not None:
                shm.load(verbose=False)
                note += f" (with the CPU accelerator's shm collectives, {time.perf_counter() - t:.0f} s in all)"
    except Exception as e:  # the row of the DeepSpeed run says this
        note = f"failed after {time.perf_counter() - t:.0f} s: {type(e).__name__}: {str(e)[-300:]}"
    Path(status).write_text(note + "\n")
    _say(f"DeepSpeed CPU Adam {note}")
    return 0 if note.startswith("built") else 1


SYSTEMS = {"fsdp2": ("torch.distributed.fsdp", fsdp2), "deepspeed": ("deepspeed", deepspeed_zero3)}


def run(system: str, case: str, steps: int, micro_batch: int, grad_accum: int, device: str = "cuda",
        cpu_adam_status: str | None = None) -> dict:
    import importlib.util

    from megatrain.planner import TrainSpec

    config, seq = gpu_step.parse_case(case, 4096)
    spec = TrainSpec(micro_batch=micro_batch, seq_len=seq, grad_accum=grad_accum, dtype="bf16", lr=1e-4,
                     total_steps=1000)
    row = {"system": system, "case": case, "model": config.name, "seq_len": seq, "micro_batch": micro_batch,
           "grad_accum": grad_accum, "tokens_per_step": spec.tokens_per_step,
           "activation_checkpointing": "every block"}
    module, build = SYSTEMS[system]
    if importlib.util.find_spec(module.split(".")[0]) is None or (
            system == "fsdp2" and importlib.util.find_spec(module) is None):
        return {**row, "skipped": f"{module} is not installed in this image"}
    kw = {"cpu_adam_status": cpu_adam_status} if system == "deepspeed" else {}
    t0 = time.perf_counter()
    try:
        step, notes = build(config, spec, device, **kw)
    except SkipPeer as e:
        return {**row, "skipped": str(e)}
    setup_s = time.perf_counter() - t0
    _say(f"{system}: set up in {setup_s:.1f} s")
    params = notes.pop("params")
    batch = _batch(config, spec, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    before = [p.detach().full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
              for p in params()] if device == "cpu" else None
    t0 = time.perf_counter()
    step(batch)  # warm-up
    sync()
    warmup_s = time.perf_counter() - t0
    _say(f"{system}: warm-up step {warmup_s:.1f} s")
    row.update(optimizer=notes["optimizer"](), setup_s=setup_s, warmup_s=warmup_s)
    if device == "cpu":  # the rehearsal: a step ran and changed the weights
        after = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in params()]
        return {**row, "device": "cpu", "n_params": len(after),
                "weights_changed": sum(not torch.equal(a, b) for a, b in zip(before, after))}
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        step(batch)
        sync()
        times.append(time.perf_counter() - t0)
        _say(f"{system}: step {i + 1}/{steps} {times[-1]:.2f} s")
    step_s = sorted(times)[len(times) // 2]
    flops = gpu_step.model_flops_per_token(config, seq) * spec.tokens_per_step
    from megatrain.planner import hardware_preset
    from megatrain.planner.hardware import GPU_NAMES

    name = torch.cuda.get_device_name(0)
    peak = hardware_preset(next((p for k, p in GPU_NAMES if k in name), "h200")).peak_flops.get("bfloat16", 0.0)
    return {**row, "optimizer": notes["optimizer"](), "measured_step_s": step_s, "step_times_s": times,
            "tokens_per_s": spec.tokens_per_step / step_s, "model_tflops": flops / step_s / 1e12,
            "mfu": flops / step_s / peak if peak else None, "peak_device_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(), "host_rss_bytes": gpu_step._rss_bytes()}


def choose_case(preflight: dict, limit_s: float, seq: int = 4096, micro_batch: int = 1, grad_accum: int = 4,
                base: str = "llama2-7b") -> tuple[str, str]:
    """(case, why): `base` truncated to the most blocks that (a) all three systems hold in the preflight's host
    memory (DeepSpeed's PEER_HOST_BYTES_PER_PARAM binds) and (b) the preflight's rates predict each peer to set
    up and take a warm-up and two steps in within 80% of `limit_s`: a rough model (setup: every host byte
    touched once; a step: bf16 compute with recompute at 8 N T FLOPs, fp32 parameters over the link three times
    per micro-batch, fused AdamW over N parameters), made to keep a run inside the device run's 8 minutes.
    llama2-7b, not the headline's llama3-8b: its 32K vocabulary leaves a few blocks' truncation a transformer
    (llama3-8b's 128K embedding and head alone are 1.05B parameters)."""
    from megatrain.models import load_model_config
    from megatrain.planner.costs import ADAMW_BYTES

    c = load_model_config(base)
    kv = c.n_kv_heads or c.n_heads
    block = 2 * c.d_model**2 + 2 * c.d_model * (c.d_model // c.n_heads) * kv + 3 * c.d_model * c.ffn_dim
    host = preflight["host_memory_bytes"]
    tokens = seq * micro_batch * grad_accum
    flops = preflight.get("bf16_matmul_flops", 5e14)
    link = preflight.get("h2d_bytes_per_s", 2e10)
    touch = preflight.get("first_touch_bytes_per_s", 2e9)
    adam = preflight.get("adamw_bytes_per_s", 5e10) / ADAMW_BYTES["exact"]

    def params(layers: int) -> int:
        return layers * block + (1 if c.tie_embeddings else 2) * c.vocab_size * c.d_model

    def predicted_s(n: int) -> float:
        step = 8 * n * tokens / flops + 3 * 4 * n * micro_batch * grad_accum / link + n / adam
        return 8.0 + PEER_HOST_BYTES_PER_PARAM * n / touch + 3 * step  # 8 s: Python, torch, CUDA start

    fits = [n for n in range(1, c.n_layers + 1) if PEER_HOST_BYTES_PER_PARAM * params(n) <= host]
    if not fits:
        return f"{base}:1@{seq}", f"no truncation of {base} fits {host / 2**30:.0f} GiB at 22 B/param: 1 block"
    in_time = [n for n in fits if predicted_s(params(n)) <= 0.8 * limit_s] or [1]
    layers = min(max(fits), max(in_time))
    why = (f"{base} with {max(fits)} blocks ({params(max(fits)) / 1e9:.1f}B) is the largest all three hold in "
           f"{host / 2**30:.0f} GiB ({PEER_HOST_BYTES_PER_PARAM} B/param, DeepSpeed's peak); "
           f"{layers} blocks ({params(layers) / 1e9:.1f}B, predicted {predicted_s(params(layers)):.0f} s a run) "
           f"fit the {limit_s:.0f} s a run has")
    return f"{base}:{layers}@{seq}", why


def _status(row: dict, device: str) -> str:
    if "skipped" in row:
        return f"skipped: {row['skipped'][:240]}"
    if "error" in row:
        return f"error: {row['error'][:240]}"
    if device == "cpu":
        return (f"rehearsed: {row['system']} wiring with {row['optimizer']}, per-block checkpointing, bf16 compute: "
                f"one step on the CPU changed {row['weights_changed']} of {row['n_params']} tensors (CPU offload "
                "and NCCL need a GPU)")
    return f"measured: {row['tokens_per_s']:,.0f} tokens/s, {row['optimizer']}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", choices=sorted(SYSTEMS))
    ap.add_argument("--case")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--stage", default=None, help="the run.sh stage this row belongs to")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: one warm-up step with gloo and no offload, the rehearsal of the wiring")
    ap.add_argument("--cpu-adam-status", default=None, help="the file --build-cpu-adam wrote")
    ap.add_argument("--build-cpu-adam", action="store_true", help="build DeepSpeed's CPU Adam and exit")
    ap.add_argument("--status", default=None, help="with --build-cpu-adam: where to write how it went")
    ap.add_argument("--choose-case", action="store_true", help="print the peer case for --preflight and exit")
    ap.add_argument("--preflight", default=None)
    ap.add_argument("--limit-s", type=float, default=28.0)
    args = ap.parse_args(argv)
    if args.build_cpu_adam:
        return build_cpu_adam(args.status or "ds_cpu_adam.txt")
    if args.choose_case:
        case, why = choose_case(json.loads(Path(args.preflight).read_text()), args.limit_s)
        print(case)
        print(f"peers: {why}", file=sys.stderr)
        return 0
    if not (args.system and args.case):
        ap.error("--system and --case are required")
    import megatrain  # noqa: F401  (MEGATRAIN_FAKE_CUDA=1 installs the fake backend on import)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("peers: no CUDA device; nothing measured", file=sys.stderr)
        return 1
    try:
        row = run(args.system, args.case, args.steps, args.micro_batch, args.grad_accum, args.device,
                  args.cpu_adam_status)
    except Exception as e:  # a peer failing is a row, not a lost run
        row = {"system": args.system, "case": args.case, "error": f"{type(e).__name__}: {e}"[:500]}
    row = {**({"stage": args.stage} if args.stage else {}), **row, "status": _status(row, args.device)}
    line = json.dumps(row)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
