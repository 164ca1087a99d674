"""The compute-dtype cast in C (cast_kernel.c): fp32 to bf16 with torch's bits, split across threads.

Where it sits: runtime/cast.py casts each chunk of a "host" load into the pinned staging ring with `cast`, and the
"copy" placement's optimizer step writes its bf16 copy through host_kernel.step's `copy` (mt_adamw_copy);
runtime/machine_probe.py measures `cast` per thread count (`cast_rate`). The library is host_kernel.py's (built
with host_kernel.c from both sources), and its `_check_cast` compares it with torch's `.to(torch.bfloat16)` on
special values and random bit patterns before a machine uses it; without it (no compiler, a mismatch,
MEGATRAIN_HOST_KERNEL=0) `cast` is torch's copy_, the same bits, slower on few threads.
Try it: `python -c "from megatrain.runtime import cast_kernel; print(cast_kernel.available(), cast_kernel.why_not())"`.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from . import host_kernel
from .host_adamw import OMP_SETTLE_S

MIN_PIECE = 1 << 16  # elements: a thread's piece at least this long, so casting it outlasts waking the thread
ALIGN = 64  # pieces start at multiples of it: no two threads write one cache line

# "pool", "pool_size"; the checked library is host_kernel's state ("cast_lib", "cast_why_not"): one reset forgets both
_state: dict = {}
_lock = threading.Lock()


def available() -> bool:
    """Whether `cast` runs the C loop (built, loaded and checked with host_kernel's library, once)."""
    host_kernel.available()
    return "cast_lib" in host_kernel._state


def why_not() -> str | None:
    """Why the C cast is not used here (None: it is)."""
    if available():
        return None
    return host_kernel._state.get("cast_why_not") or host_kernel.why_not()



def cast(src: torch.Tensor, dst: torch.Tensor, threads: int | None = None) -> None:
    """dst.copy_(src) for a contiguous fp32 `src` and bf16 `dst` on the host, the same bits: the C loop split
    across `threads` (default: the calling thread's intra-op threads, as a stream worker sets them), the
    caller taking the first piece; torch's copy_ where the C cast is not available."""
    n = src.numel()
    if not available() or src.dtype != torch.float32 or dst.dtype != torch.bfloat16 or dst.numel() != n or \
            src.device.type != "cpu" or dst.device.type != "cpu" or not (src.is_contiguous() and dst.is_contiguous()):
        dst.copy_(src)
        return
    k = min(threads or torch.get_num_threads(), max(1, n // MIN_PIECE))
    fn = host_kernel._state["cast_lib"].mt_cast_bf16
    if k <= 1:
        fn(src.data_ptr(), dst.data_ptr(), n)
        return
    piece = -(-n // k // ALIGN) * ALIGN
    pool = _pool(k - 1)
    jobs = [pool.submit(fn, src.data_ptr() + 4 * a, dst.data_ptr() + 2 * a, min(n, a + piece) - a)
            for a in range(piece, n, piece)]
    fn(src.data_ptr(), dst.data_ptr(), min(n, piece))
    for j in jobs:
        j.result()


def _pool(size: int) -> ThreadPoolExecutor:
    """The cast's own worker threads (not the host optimizer's: the two run at once on different streams)."""
    with _lock:
        pool = _state.get("pool")
        if pool is None or _state.get("pool_size", 0) < size:
            pool = _state["pool"] = ThreadPoolExecutor(size, thread_name_prefix="host-cast")
            _state["pool_size"] = size
        return pool


def cast_rate(n: int, threads: int, repeats: int = 5, kernel: bool = True) -> float:
    """Elements per second of `cast` (`kernel`) or torch's copy_ (not `kernel`) of `n` fp32 elements into
    bf16 on `threads` threads, the best of `repeats`: a source out of cache (a unit's master), the destination
    a buffer written before as the staging ring is (machine_probe.py)."""
    import time

    from . import cpus, host_memory

    src = host_memory.empty((n,), torch.float32).normal_()
    dst = host_memory.empty((n,), torch.bfloat16).zero_()
    flush = torch.ones(max(8 << 20, 2 * (cpus.largest_cache_bytes() or 0) // 4))
    own = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = float("inf")
        for _ in range(repeats + 1):  # the first warms up (pages, the pool's threads)
            flush.sum()
            time.sleep(OMP_SETTLE_S)  # the flush's OpenMP team stops spinning on the cores the cast uses
            t = time.perf_counter()
            if kernel:
                cast(src, dst, threads)
            else:
                dst.copy_(src)
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(own)
    return n / best


def cpu_threads() -> int:
    """The cores this process may run on (what a probe sweeps thread counts up to)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
