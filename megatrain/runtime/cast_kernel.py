"""The compute-dtype cast in C (cast_kernel.c): fp32 to bf16 with torch's bits, split across threads.

Where it sits: runtime/cast.py casts each chunk of a "host" load into the pinned staging ring with `cast`, and
the "copy" placement's optimizer step writes its bf16 copy through host_kernel.step's `copy`
(mt_adamw_copy); planner/probe.py measures `cast` per thread count (`cast_rate`). The library is host_kernel.py's
(built with host_kernel.c from both sources), and `check` compares it with torch's `.to(torch.bfloat16)` on
special values and random bit patterns before a machine uses it; without it (no compiler, a mismatch,
MEGATRAIN_HOST_KERNEL=0) `cast` is torch's copy_, the same bits, slower on few threads.
Try it: `python -c "from megatrain.runtime import cast_kernel; print(cast_kernel.available(), cast_kernel.why_not())"`.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

MIN_PIECE = 1 << 16  # elements: a thread's piece at least this long (a thread's wake-up is ~10 us; 64K cast in ~20)
ALIGN = 64  # pieces start at multiples of it: no two threads write one cache line

_state: dict = {}  # "pool", "pool_size"; the checked library is host_kernel's state ("cast_lib", "cast_why_not")
_lock = threading.Lock()


def declare(lib) -> None:
    """ctypes signatures of cast_kernel.c's entry points in the loaded library."""
    lib.mt_cast_bf16.restype = None
    lib.mt_cast_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.mt_cast_check.restype = ctypes.c_int64
    lib.mt_cast_check.argtypes = [ctypes.c_uint32] * 3
    lib.mt_adamw_copy.restype = None
    lib.mt_adamw_copy.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2


def special_values() -> torch.Tensor:
    """fp32 values where a bf16 rounding can go wrong: zeros, infinities, NaNs of both signs with several
    payloads, the subnormals' ends, the largest finite (rounds to inf), and halfway cases with an even and an
    odd last kept bit, each of both signs."""
    pos = [0x00000000, 0x7F800000, 0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7FA00000, 0x00000001, 0x00007FFF,
           0x00008000, 0x00018000, 0x007FFFFF, 0x00800000, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001,
           0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x3F800000, 0x4B3F8000]
    bits = pos + [u | 0x80000000 for u in pos]
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def check(lib) -> None:
    """Use `lib`'s cast only if it gives torch's bits: special values at every offset of a vector and its
    tail, and 2^20 random bit patterns (NaNs and subnormals among them)."""
    gen = torch.Generator().manual_seed(0)
    cases = [special_values()]
    cases += [torch.cat([torch.randn(k, generator=gen), special_values()]) for k in range(0, 33)]
    cases.append(torch.randint(-2**31, 2**31, (1 << 20,), dtype=torch.int64, generator=gen).to(torch.int32)
                 .view(torch.float32))
    for x in cases:
        want, got = x.to(torch.bfloat16), torch.empty(x.numel(), dtype=torch.bfloat16)
        lib.mt_cast_bf16(x.data_ptr(), got.data_ptr(), x.numel())
        if not torch.equal(want.view(torch.int16), got.view(torch.int16)):
            bad = (want.view(torch.int16) != got.view(torch.int16)).nonzero()[0].item()
            _kernel_state()["cast_why_not"] = (f"its bits differ from torch's .to(bfloat16) on this machine (fp32 "
                                               f"bits {x.view(torch.int32)[bad].item() & 0xFFFFFFFF:#010x})")
            return
    _kernel_state()["cast_lib"] = lib


def _kernel_state() -> dict:
    """host_kernel's module state, which holds the checked cast too (so one reset forgets both)."""
    from . import host_kernel

    return host_kernel._state


def available() -> bool:
    """Whether `cast` runs the C loop (built, loaded and checked with host_kernel's library, once)."""
    from . import host_kernel

    host_kernel.available()
    return "cast_lib" in host_kernel._state


def ready() -> bool:
    """Whether the checked C cast is loaded, without loading it (host_kernel's self-check steps through
    host_state while it loads)."""
    return "cast_lib" in _kernel_state()


def why_not() -> str | None:
    """Why the C cast is not used here (None: it is)."""
    from . import host_kernel

    if available():
        return None
    return host_kernel._state.get("cast_why_not") or host_kernel.why_not()


def vector_check(stride: int = 1) -> int:
    """Mismatches of cast_kernel.c's vector loop against its element function over every `stride`-th fp32 bit
    pattern, split between this process's cores; -1 where the vector code is not built."""
    from .host_kernel import _check_on_every_core

    return _check_on_every_core(_kernel_state()["cast_lib"].mt_cast_check, stride)


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
    fn = _kernel_state()["cast_lib"].mt_cast_bf16
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
    a buffer written before as the staging ring is (planner/probe.py)."""
    import time

    from . import cpus, host_memory
    from .host_state import OMP_SETTLE_S

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
