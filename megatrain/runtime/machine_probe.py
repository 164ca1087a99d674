"""`megatrain probe`: measure the machine it runs on and return a Hardware profile (planner/hardware.py).

Where it sits: in the runtime, whose kernels (the host optimizer, the cast, store creation) it times. It
writes the JSON that `--hardware FILE` and `load_hardware(FILE)` read, replacing a preset's assumed efficiency
factors with measurements (FlexGen's lesson: datasheet numbers mislead a cost model).
Try it: `megatrain probe --device cpu --quick` (seconds), or on a GPU box `megatrain probe --out gpu.json`.

Measured: matmul FLOP/s per compute dtype (square matmuls, the best of several runs), host memory copy
bandwidth, the host memory bandwidth of a streaming read-modify-write (`host_stream_bytes_per_s`: the best of
x *= s and x += y over arrays 8x the caches, bytes read + written per second: the bound the host optimizer is
measured against), host AdamW throughput (torch's fused CPU AdamW, the exact host policy's step, converted to
bytes/s with costs.ADAMW_BYTES["exact"] so the estimator gets back params/s), every host policy's own step
rate (`host_optimizer_bytes_per_s`, runtime/host_state.py step_rate, in the policy's traffic bytes/s), store
creation's first touch and drawing of initial weights (`creation_rates`: planner/creation.py), the
compute-dtype cast's fp32 -> bf16 rates per thread count and on the device (`cast_fields`: planner/cast.py), and on
CUDA the pinned host->device and device->host bandwidth. Nominal peaks for MFU come from the matching preset when the GPU
is one we know, else the measured rate stands in.
"""

from __future__ import annotations

import os
import statistics
import time

from megatrain.planner.costs import ADAMW_BYTES
from megatrain.planner.hardware import PRESETS, GiB, Hardware


def _best(fn, repeats: int, sync) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def _matmul(torch, device: str, dtype, n: int, repeats: int, sync) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    reps = 4
    t = _best(lambda: [a @ b for _ in range(reps)], repeats, sync)
    return 2 * n**3 * reps / t


def _adamw(torch, n: int, repeats: int) -> float:
    """Host AdamW params/s: the fused CPU kernel over fp32 master, gradient and moments (the exact policy)."""
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    try:
        opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW([p], lr=1e-4, foreach=True)
    return n / _best(opt.step, repeats, lambda: None)


def stream_bandwidth(torch, nbytes: int, repeats: int) -> float:
    """Host memory bytes/s (read + written) of the best streaming in-place update: x *= s (8 B/element) or
    x += y (12 B/element), fp32 arrays of `nbytes` each (at least twice the last-level cache, at most 1/16 of
    host memory), the access pattern of an optimizer step, on huge pages as the host store's state is
    (runtime/host_memory.py). NOTE: on this 2-core VM with 4 KiB pages the same loop measured 22-24 GB/s,
    against 31-33 on 2 MiB pages; and 256 MiB arrays, inside its 480 MiB L3, read up to 30."""
    from . import cpus, host_memory

    nbytes = max(nbytes, min(2 * (cpus.largest_cache_bytes() or 0), _host_bytes() // 16)) // 4 * 4
    x = host_memory.empty((nbytes // 4,), torch.float32).fill_(1.0)
    y = host_memory.empty((nbytes // 4,), torch.float32).zero_()
    scale = _best(lambda: x.mul_(0.999), repeats, lambda: None)
    add = _best(lambda: x.add_(y), repeats, lambda: None)
    return max(2 * nbytes / scale, 3 * nbytes / add)


def creation_rates(torch, nbytes: int, params: int, repeats: int) -> tuple[float, float]:
    """Store creation's two rates, through the store's own code (runtime/host_init.py): bytes/s of the first
    touch of `nbytes` of fresh memory on the creation pool, half zero-filled as moments are and half touched as
    masters are, the median of `repeats` allocations all held to the end, so that none reuses pages another
    freed (a store's are new to it); and initial weights drawn per second, all of init_into's threads drawing
    `params` each at once, the best of `repeats`. It runs first in a probe, before other measurements free
    memory. NOTE: on a VM that hands freed memory back to its host (free page reporting), a page freed a moment
    ago faults in up to 10x faster than one the host took back; a store meets mostly the second kind."""
    from concurrent.futures import ThreadPoolExecutor

    from . import host_init, host_memory

    half = nbytes // 2 // 4 * 4
    held, took = [], []
    for _ in range(repeats):
        held += [host_memory.empty((half // 4,), torch.float32) for _ in range(2)]
        t = time.perf_counter()
        host_init.run([(host_init.zero_chunk, held[-2]), (host_init.touch_chunk, held[-1])])
        took.append(time.perf_counter() - t)
    del held
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    outs = [torch.zeros(params) for _ in range(threads)]  # present: the store's masters are touched first
    gens = [torch.Generator().manual_seed(k) for k in range(threads)]

    def draw(k: int):  # as models.eager._draw draws a weight
        return torch.randn((params,), generator=gens[k], out=outs[k]).mul_(0.02)

    with ThreadPoolExecutor(threads) as pool:
        drawn = _best(lambda: list(pool.map(draw, range(threads))), repeats, lambda: None)
    return 2 * half / statistics.median(took), threads * params / drawn


def policy_rates(n: int, repeats: int, threads: int | None = None) -> dict[str, float]:
    """Each host policy's optimizer step in its traffic bytes/s (what costs.py divides by), unclipped under
    its name and clipping under `NAME+clip` (the clip factor is applied inside the same pass: the same
    traffic, a little more work), on `threads` intra-op threads (None: the calling thread's)."""
    import torch

    from .host_state import step_rate

    own = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        out = {}
        for name in ADAMW_BYTES:
            out[name] = step_rate(name, n, repeats) * ADAMW_BYTES[name]
            out[f"{name}+clip"] = step_rate(name, n, repeats, clip=True) * ADAMW_BYTES[name]
        return out
    finally:
        torch.set_num_threads(own)


def host_optimizer_threads(device: str) -> int:
    """The intra-op threads the host optimizer runs on in training on `device` (runtime/cpus.py: on cuda the
    cores less the issuing and casting workers' and the main thread's, on the sim device half the calling
    thread's), so the probe measures its rates as a run will step."""
    from . import cpus

    return cpus.resolve("cuda" if device == "cuda" else "sim", bind=False).threads["host"]


def _optimizer_path() -> str:
    """How the host optimizer whose rates were measured runs here (runtime/host_kernel.py)."""
    from . import host_kernel

    why = host_kernel.why_not()
    return "host optimizer: one pass (runtime/host_kernel.c)" if why is None else f"host optimizer: torch ops ({why})"


def cast_thread_counts(top: int, h2d: int) -> list[int]:
    """The thread counts the cast is measured at: 1, 2, 4, ... up to the cores `top`, `top` itself and the h2d
    worker's `h2d` (every count up to 8; powers of two past it, so a 128-core host probes in seconds)."""
    counts = set(range(1, min(top, 8) + 1)) | {1 << k for k in range(top.bit_length()) if 1 << k <= top}
    return sorted(counts | {top, min(h2d, top)})


def cast_fields(torch, device: str, n: int, repeats: int, sync) -> tuple[dict, str]:
    """The compute-dtype cast's rates (planner/cast.py) as Hardware fields, and a note for its source: the host's
    fp32 -> bf16 cast of `n` elements per thread count (cast_thread_counts; the C cast where it runs,
    runtime/cast_kernel.py, else torch's copy_), the threads the h2d worker casts on in a run (runtime/cpus.py),
    and the device's cast: a GPU kernel on CUDA; on the sim device torch's copy_ on the h2d worker's thread,
    which is what its "gpu" place runs."""
    from . import cast_kernel, cpus

    threads = cpus.resolve("cuda" if device == "cuda" else "sim", bind=False).threads["h2d"]
    rates = {k: cast_kernel.cast_rate(n, k, repeats) for k in cast_thread_counts(cast_kernel.cpu_threads(), threads)}
    if device == "cuda":
        src = torch.randn(n, device="cuda")
        dst = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        dev = n / _best(lambda: dst.copy_(src), repeats, sync)
    else:
        dev = cast_kernel.cast_rate(n, threads, repeats, kernel=False)
    why = cast_kernel.why_not()
    path = "C (runtime/cast_kernel.c)" if why is None else f"torch copy_ ({why})"
    note = (f"cast: {path} {rates[min(threads, max(rates))] / 1e9:.2f} G elements/s on the h2d worker's {threads} "
            f"thread(s), device {dev / 1e9:.3g} G/s")
    return {"host_cast_elements_per_s": rates, "cast_threads": threads, "device_cast_elements_per_s": dev}, note


def _host_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


# the square matmul each dtype's FLOP/s is measured at: large enough that a GPU runs at its sustained rate
MATMUL_SIZES = {"cuda": {"bfloat16": 8192, "float32": 8192}, "cpu": {"bfloat16": 256, "float32": 512}}


def disk_rates(folder, nbytes: int) -> tuple[float, float, str]:
    """(bytes/s, seconds per file, what was measured) of checkpoint writes into `folder` (its nearest existing
    folder): one file of `nbytes` written and fsynced as a checkpoint's are, and the median of five small
    files' write + fsync. The temporary file is removed."""
    write, latency, _, note = disk_probe(folder, nbytes)
    return write, latency, note


def disk_probe(folder, nbytes: int) -> tuple[float, float, float, str]:
    """`disk_rates` and the read rate: (write bytes/s, seconds per file, read bytes/s, what was measured). The
    file is written as a checkpoint's are (tensorfiles.py: sha256-hashed on the writing thread, fsynced) and
    read back as a resume reads one (read and hashed), its pages dropped from the page cache first
    (posix_fadvise; where the system keeps them anyway, as on tmpfs, the read is memory's): on a drive faster
    than one core's sha256 (about 1.7 GB/s) the hash sets both rates."""
    import hashlib
    import os
    import statistics
    import tempfile
    import time
    from pathlib import Path

    where = Path(folder)
    while not where.is_dir() and where != where.parent:
        where = where.parent
    block = os.urandom(16 << 20)  # incompressible, as weights are
    fd, name = tempfile.mkstemp(prefix=".megatrain-probe-", dir=where)
    try:
        start, digest = time.perf_counter(), hashlib.sha256()
        for at in range(0, nbytes, len(block)):
            os.write(fd, block[: nbytes - at])
            digest.update(block[: nbytes - at])
        os.fsync(fd)
        rate = nbytes / (time.perf_counter() - start)
        small = []
        for _ in range(5):
            start = time.perf_counter()
            os.pwrite(fd, block[:4096], 0)
            os.fsync(fd)
            small.append(time.perf_counter() - start)
        if hasattr(os, "posix_fadvise"):  # clean after the fsync: the read below comes from the drive
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buf, digest = bytearray(len(block)), hashlib.sha256()
        with open(name, "rb", buffering=0) as f:
            start = time.perf_counter()
            while got := f.readinto(buf):
                digest.update(memoryview(buf)[:got])
            read = nbytes / (time.perf_counter() - start)
    finally:
        os.close(fd)
        os.unlink(name)
    return rate, statistics.median(small), read, (f"disk {rate / 1e9:.2f} GB/s write + sha256 + fsync, {read / 1e9:.2f} GB/s "
                                                  f"read + sha256 of {nbytes >> 20} MiB in {where}")


def probe(device: str = "auto", quick: bool = False, disk=None) -> Hardware:
    """Measure this machine. `device`: "cuda", "cpu" (the sim device), or "auto"; `disk`: the folder whose
    write and read bandwidths checkpoints are priced at (default: the temporary folder)."""
    import tempfile

    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device; run on a GPU machine or use --device cpu")
    repeats = 2 if quick else 5
    touch, draws = creation_rates(torch, 256 << 20, (1 if quick else 4) << 20, repeats)  # first: see there
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sizes = MATMUL_SIZES["cuda" if cuda else "cpu"]
    flops = {name: _matmul(torch, device, getattr(torch, name), n, repeats, sync) for name, n in sizes.items()}
    nbytes = (64 if quick else 256) * 2**20
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    copy_bw = nbytes / _best(lambda: dst.copy_(src), repeats, lambda: None)
    stream = stream_bandwidth(torch, nbytes, repeats)
    adam = _adamw(torch, (4 if quick else 16) * 2**20, repeats) * ADAMW_BYTES["exact"]
    host_threads = host_optimizer_threads(device)
    rates = policy_rates((4 if quick else 16) * 2**20, repeats, host_threads)
    cast, cast_note = cast_fields(torch, device, (4 if quick else 16) << 20, repeats, sync)
    disk_bw, disk_lat, disk_read, disk_note = disk_probe(disk or tempfile.gettempdir(), nbytes)
    cast = {**cast, "disk_write_bytes_per_s": disk_bw, "disk_file_latency_s": disk_lat,
            "disk_read_bytes_per_s": disk_read}
    host, path = _host_bytes(), (f"{_optimizer_path()} on {host_threads} thread(s), as training runs it; store "
                                 f"creation: first touch {touch / 1e9:.2f} GB/s, {draws / 1e6:.0f}M weights/s; "
                                 f"{disk_note}")
    if cuda:
        props = torch.cuda.get_device_properties(0)
        pinned = torch.empty(nbytes * 4, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes * 4, dtype=torch.uint8, device="cuda")
        h2d = nbytes * 4 / _best(lambda: dev.copy_(pinned, non_blocking=True), repeats, sync)
        d2h = nbytes * 4 / _best(lambda: pinned.copy_(dev, non_blocking=True), repeats, sync)
        name = props.name
        known = next((k for k in PRESETS if k != "cpu" and _matches(k, name)), None)
        peak = PRESETS[known]().peak_flops if known else flops
        return Hardware(name=f"probed {name}", gpu_memory_bytes=props.total_memory, matmul_flops=flops,
                        peak_flops=peak, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, host_memory_bytes=host,
                        host_memory_bytes_per_s=adam, host_stream_bytes_per_s=stream,
                        host_optimizer_bytes_per_s=rates, host_touch_bytes_per_s=touch,
                        host_init_params_per_s=draws, **cast, source=f"megatrain probe on {name} ({'quick' if quick else 'full'}); nominal peak from "
                        f"{known or 'the measurement'}; host copy {copy_bw / 1e9:.1f} GB/s; {path}; {cast_note}")
    return Hardware(name="probed cpu", device="cpu", gpu_memory_bytes=host // 2, matmul_flops=flops, peak_flops=flops,
                    h2d_bytes_per_s=copy_bw, d2h_bytes_per_s=copy_bw, host_memory_bytes=host,
                    host_memory_bytes_per_s=adam, host_stream_bytes_per_s=stream,
                    host_optimizer_bytes_per_s=rates, host_touch_bytes_per_s=touch, host_init_params_per_s=draws,
                    allocator_margin=0.0, reserved_bytes=0, op_overhead_s=2e-5, **cast,
                    copy_latency_s=2e-5, source=f"megatrain probe --device cpu ({'quick' if quick else 'full'}): "
                    f"the sim device copies with host memcpy; half the host memory is its pool; {path}; {cast_note}")


def _matches(preset: str, device_name: str) -> bool:
    n = device_name.lower().replace(" ", "")
    return {"h100-sxm": "h100" in n and ("sxm" in n or "hbm3" in n), "h100-pcie": "h100" in n and "pcie" in n,
            "h200": "h200" in n and "gh200" not in n, "gh200": "gh200" in n, "a100-80g": "a100" in n and "80" in n,
            "rtx4090": "4090" in n}.get(preset, False)
