"""The device run's preflight (benchmarks/gpu/run.sh's second stage, at most 20 s): what the plans need,
measured on this machine, written as the hardware profile every case then plans with (`--hardware FILE`).

Usage: python -P benchmarks/gpu/preflight.py --profile hw.json --json preflight.json [--host-mem SIZE] [--quick]
Measured, each the best of a few runs (megatrain/runtime/machine_probe.py's helpers where the tree has them, so the figures
mean what the planner means by them; a field this tree's profile lacks stays in preflight.json alone):
- bf16 matmul FLOP/s (8192^3 on the GPU)                            -> matmul_flops.bfloat16
- pinned host->device and device->host bytes/s (512 MiB)            -> h2d_bytes_per_s, d2h_bytes_per_s
- host first-touch bytes/s: fresh pages written once, what allocating the host store costs, slow on a machine
  whose memory grows as it is used (preflight.json), and store creation's own rates (probe.creation_rates)
                                                                    -> host_touch_bytes_per_s, host_init_params_per_s
- host stream bytes/s (probe.stream_bandwidth)                      -> host_stream_bytes_per_s
- fp32 -> bf16 cast elements/s per thread count, and on the GPU (probe.cast_fields)
                                                                    -> host_cast_elements_per_s, cast_threads,
                                                                       device_cast_elements_per_s
- the host optimizer: every host policy's step rate on the threads training gives it (probe.policy_rates)
  and fused AdamW's (probe._adamw)                                  -> host_optimizer_bytes_per_s,
                                                                       host_memory_bytes_per_s
- host memory: the kind's documented size (both lent kinds: 128 GiB) less HEADROOM_GIB for the OS, the driver
  and the processes' own memory, or --host-mem; never MemTotal or MemAvailable at start, which on the lent
  machines are far below what the machine gives as it is used    -> host_memory_bytes
The rest of the profile (nominal peaks for MFU, reserve, margins, latencies) is the preset whose name the GPU's
matches (h200, h100-sxm, ...; h200 when none does, e.g. the fake CUDA backend's). A measurement that would run
past the deadline is left out and named in preflight.json's "not_measured"; the profile keeps the preset's.
preflight.json also gives what run.sh plans the cases with: megatrain's GPU budget (GPU_BUDGET_SHARE of the
GPU) and the peers' case (peers.py choose_case, from these figures).
"""

from __future__ import annotations

import time

START = time.monotonic()  # the deadline counts from here: torch's import and CUDA's start are in the 20 s

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

KIND_HOST_GIB = 128  # the lent kinds' documented host memory (nvidia-h100-x1 and nvidia-h200 alike)
HEADROOM_GIB = 8  # left to the OS, the CUDA driver's own pinned pools and each process's Python and torch
DEADLINE_S = 14.0  # from the process's start; the stage's limit is 20 s, and a measurement started takes a few
MEASURED_FIELDS = ("h2d_bytes_per_s", "d2h_bytes_per_s", "host_stream_bytes_per_s", "host_optimizer_bytes_per_s",
                   "host_touch_bytes_per_s", "host_init_params_per_s", "host_cast_elements_per_s", "cast_threads",
                   "device_cast_elements_per_s")
GPU_BUDGET_SHARE = 0.9  # megatrain's GPU budget: the GPU less a tenth (the CUDA context, NCCL, fragmentation)


def _best(fn, repeats: int, sync=lambda: None) -> float:
    from megatrain.runtime.machine_probe import _best as best

    return best(fn, repeats, sync)


def first_touch(nbytes: int) -> float:
    """Bytes/s of writing `nbytes` of fresh anonymous memory once (page faults and zeroing included): the
    rate at which the host store's allocation gets its memory from the machine."""
    t = time.perf_counter()
    x = torch.empty(nbytes // 4, dtype=torch.float32)
    x.fill_(1.0)
    s = time.perf_counter() - t
    del x
    return nbytes / s


def cast_rates(n: int, repeats: int, max_threads: int) -> tuple[dict[str, float], str]:
    """fp32 -> bf16 elements/s of `n` elements per thread count (1, 2, 4, ... up to the cores), and which cast
    was timed: the runtime's (megatrain/runtime/cast_kernel.py's C loop split across threads) where the tree has it, else
    torch's copy_, which is what the runtime runs then."""
    counts = sorted({1 << i for i in range(8) if (1 << i) <= max_threads} | {max_threads})
    try:
        from megatrain.runtime import cast_kernel

        how = "megatrain/runtime/cast_kernel.py" + ("" if cast_kernel.available() else f" ({cast_kernel.why_not()})")
        fn = cast_kernel.cast
    except ImportError:
        how, fn = "torch copy_", (lambda src, dst, threads: dst.copy_(src))
    src, dst = torch.randn(n), torch.zeros(n, dtype=torch.bfloat16)
    own, out = torch.get_num_threads(), {}
    try:
        for k in counts:
            torch.set_num_threads(k)
            out[str(k)] = n / _best(lambda k=k: fn(src, dst, k), repeats)
    finally:
        torch.set_num_threads(own)
    return out, how


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def measure(quick: bool, deadline_s: float = DEADLINE_S) -> tuple[dict, list[str]]:
    """The figures (name -> value) and the names of those left out for time."""
    from megatrain.planner.costs import ADAMW_BYTES
    from megatrain.runtime import machine_probe as probe

    got, skipped = {}, []
    sync = torch.cuda.synchronize
    mib = 2**20
    n_mm, n_copy = (256, 16 * mib) if quick else (8192, 512 * mib)
    n_touch, n_cast, n_opt = (64 * mib, mib, 2**18) if quick else (2048 * mib, 32 * mib, 8 * mib)
    repeats = 2 if quick else 3

    def matmul():
        return {"bf16_matmul_flops": probe._matmul(torch, "cuda", torch.bfloat16, n_mm, repeats, sync)}

    def link():
        pinned = torch.empty(n_copy, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n_copy, dtype=torch.uint8, device="cuda")
        return {"h2d_bytes_per_s": n_copy / _best(lambda: dev.copy_(pinned, non_blocking=True), repeats, sync),
                "d2h_bytes_per_s": n_copy / _best(lambda: pinned.copy_(dev, non_blocking=True), repeats, sync)}

    def host():
        out = {"host_stream_bytes_per_s": probe.stream_bandwidth(torch, n_copy, repeats)}
        if hasattr(probe, "creation_rates"):  # the store's own creation code, as `megatrain probe` times it
            touch, draws = probe.creation_rates(torch, n_touch // 8, n_opt // 2, repeats)
            out.update(host_touch_bytes_per_s=touch, host_init_params_per_s=draws)
        return {"first_touch_bytes_per_s": first_touch(n_touch), **out}

    def cast():
        if hasattr(probe, "cast_fields"):  # the profile's own cast fields, as `megatrain probe` measures them
            fields, note = probe.cast_fields(torch, "cuda", n_cast, repeats, sync)
            rates = {str(k): v for k, v in fields["host_cast_elements_per_s"].items()}
            return {**fields, "cast_bf16_elements_per_s": rates, "cast_kernel": note}
        rates, how = cast_rates(n_cast, repeats, _cores())
        return {"cast_bf16_elements_per_s": rates, "cast_kernel": how}

    def optimizer():
        threads = probe.host_optimizer_threads("cuda")
        return {"host_optimizer_threads": threads,
                "host_optimizer_bytes_per_s": probe.policy_rates(n_opt, repeats, threads),
                "adamw_bytes_per_s": probe._adamw(torch, n_opt, repeats) * ADAMW_BYTES["exact"],
                "host_optimizer_path": probe._optimizer_path()}

    # host first (fresh pages: nothing freed before it), then what the plans price most, the cast last
    for name, fn in (("host", host), ("matmul", matmul), ("link", link), ("optimizer", optimizer), ("cast", cast)):
        if time.monotonic() - START > deadline_s:
            skipped.append(name)
            continue
        t = time.perf_counter()
        try:
            got.update(fn())
        except Exception as e:  # one measurement failing leaves the preset's figure, said in the JSON
            skipped.append(f"{name} ({type(e).__name__}: {str(e)[:160]})")
        got[f"{name}_s"] = round(time.perf_counter() - t, 3)
    return got, skipped


def profile(figures: dict, host_bytes: int, base: str | None = None):
    """The hardware profile: the preset the GPU's name matches, its measured fields replaced."""
    from megatrain.planner.hardware import GPU_NAMES, Hardware, hardware_preset

    name = torch.cuda.get_device_name(0)
    preset = base or next((p for key, p in GPU_NAMES if key in name), "h200")
    hw = hardware_preset(preset)
    new = {"name": f"preflight {name}", "host_memory_bytes": host_bytes,
           "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
           "source": f"benchmarks/gpu/preflight.py on {name}: measured matmul, link, host stream and optimizer "
                     f"rates; the rest from the {preset} preset; host memory {host_bytes / 2**30:.0f} GiB"}
    if "bf16_matmul_flops" in figures:
        new["matmul_flops"] = {**hw.matmul_flops, "bfloat16": figures["bf16_matmul_flops"]}
    # the measured fields this tree's profile has (the store-creation and cast ones are newer than the rest)
    for key in MEASURED_FIELDS:
        if key in figures and key in Hardware.model_fields:
            new[key] = figures[key]
    if "adamw_bytes_per_s" in figures:
        new["host_memory_bytes_per_s"] = figures["adamw_bytes_per_s"]
    return hw.replace(**new)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="the hardware profile to write (gpu_step.py --hardware)")
    ap.add_argument("--json", required=True, help="every figure measured, with what has no profile field")
    ap.add_argument("--host-mem", default=None, help=f"host memory to plan with (default: the kind's documented "
                    f"{KIND_HOST_GIB} GiB less {HEADROOM_GIB} GiB of headroom)")
    ap.add_argument("--preset", default=None, help="the preset the unmeasured fields come from (default: the "
                    "one the GPU's name matches)")
    ap.add_argument("--quick", action="store_true", help="small sizes: the CPU rehearsal under fake CUDA")
    ap.add_argument("--peer-limit-s", type=float, default=28.0, help="each peer run's limit (peers.py choose_case)")
    args = ap.parse_args(argv)
    import megatrain  # noqa: F401  (MEGATRAIN_FAKE_CUDA=1 installs the fake backend on import)
    from megatrain.planner import parse_bytes

    if not torch.cuda.is_available():
        print("preflight: no CUDA device; nothing measured", file=sys.stderr)
        return 1
    host = parse_bytes(args.host_mem) if args.host_mem else (KIND_HOST_GIB - HEADROOM_GIB) * 2**30
    figures, skipped = measure(args.quick, 45.0 if args.quick else DEADLINE_S)  # the rehearsal's limit is 60 s
    hw = profile(figures, host, args.preset)
    with open(args.profile, "w") as f:
        f.write(hw.model_dump_json(indent=1))
    out = {"gpu": torch.cuda.get_device_name(0), "host_memory_bytes": host,
           "host_memory_from": "--host-mem" if args.host_mem else f"kind: {KIND_HOST_GIB} GiB less {HEADROOM_GIB} "
           "GiB headroom", **figures, "not_measured": skipped, "profile": args.profile,
           # what run.sh plans the cases with, worked out here so that it starts no other Python with torch
           "gpu_budget_bytes": int(GPU_BUDGET_SHARE * hw.gpu_memory_bytes)}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from peers import choose_case

    out["peer_case"], out["peer_case_why"] = choose_case(out, args.peer_limit_s)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    gb = 1e9
    print(f"preflight: {out['gpu']}: bf16 {figures.get('bf16_matmul_flops', 0) / 1e12:.1f} TFLOP/s, "
          f"h2d {figures.get('h2d_bytes_per_s', 0) / gb:.1f} GB/s, d2h {figures.get('d2h_bytes_per_s', 0) / gb:.1f} "
          f"GB/s, first touch {figures.get('first_touch_bytes_per_s', 0) / gb:.1f} GB/s, stream "
          f"{figures.get('host_stream_bytes_per_s', 0) / gb:.1f} GB/s, host {host / 2**30:.0f} GiB"
          + (f"; not measured: {', '.join(skipped)}" if skipped else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
