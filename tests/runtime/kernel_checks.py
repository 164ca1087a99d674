"""The C kernels' exhaustive checks of their vector loops against their element functions (host_kernel.c's
fp8 and bf16 conversions, cast_kernel.c's bf16 cast), split between this process's cores (ctypes lets go of
the GIL). The entry points are in the library the runtime loads; only tests call them."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from megatrain.runtime import host_kernel


def on_every_core(check, stride: int) -> int:
    parts = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ThreadPoolExecutor(parts, thread_name_prefix="host-kernel-check") as pool:
        counts = list(pool.map(lambda part: check(stride, part, parts), range(parts)))
    return -1 if min(counts) < 0 else sum(counts)


def fp8_check(stride: int = 1) -> int:
    """How many inputs the AVX-512 fp8 conversions of host_kernel.c get wrong against its element functions
    (every code; every `stride`-th fp32 of [-448, 448] and a little past); -1 where that code is not built
    (no AVX-512)."""
    return on_every_core(host_kernel._state["lib"].mt_fp8_check, stride)


def bf16_check(stride: int = 1) -> int:
    """How many fp32 inputs the AVX-512 stochastic rounding of host_kernel.c's bf16 moments gets wrong against
    its element loop's (every `stride`-th fp32 bit pattern); -1 where that code is not built (no AVX-512)."""
    return on_every_core(host_kernel._state["lib"].mt_bf16_check, stride)


def vector_check(stride: int = 1) -> int:
    """Mismatches of cast_kernel.c's vector loop against its element function over every `stride`-th fp32 bit
    pattern; -1 where the vector code is not built."""
    return on_every_core(host_kernel._state["cast_lib"].mt_cast_check, stride)
