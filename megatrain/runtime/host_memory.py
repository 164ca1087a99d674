"""Host memory at exact sizes: one pinned region per allocation call, pageable buffers one by one, all counted.

Where it sits: the host store (store.py) asks for every host buffer of a run at once (`HostArena.allocate`);
the plan counts the same buffers with the same rule (planner/host_policy.py `host_layout`), so on the sim
device the bytes allocated equal the plan's host bytes (tests/runtime/test_host_policy.py).

Why not `torch.empty(..., pin_memory=True)`: that goes through torch's caching host allocator, which rounds
every block up to a power of two (llama2-7b: 37.7 GiB of pinned buffers become 49.5 GiB) and the rounding is
invisible to a host-memory check. Here the pinned buffers are views into one region: a plain (pageable)
allocation of the exact total, each buffer at a PIN_ALIGN boundary, the region's start aligned to a page
inside one page of slack; on CUDA that page-aligned range is page-locked in place with cudaHostRegister
(`torch.cuda.cudart()`, the call torch's own checkpoint stager uses) and unregistered when the arena closes;
its pages are faulted in on several threads first (host_init.py), which registering would do on one.
A non_blocking copy from registered memory is a true DMA; the caching allocator's bookkeeping never sees it.
The sim device allocates the same region the same way, without the registration.

Huge pages: every buffer and region is advised MADV_HUGEPAGE (`advise_huge_pages`) before anything touches
it, so where the kernel's transparent huge pages are `madvise` or `always` it is backed by 2 MiB pages. The
host optimizer streams each unit's state once per step with the rest of the model's state touched in between,
so with 4 KiB pages every page of every array costs a page walk that misses the caches: the one-pass step
measured 5-9% faster on 2 MiB pages (docs/RESULTS.md "Host optimizer throughput"), and a 1.5 TB host store
needs 3 GB of page tables at 4 KiB. Same bytes, same accounting; where the kernel says no, nothing changes.
"""

from __future__ import annotations

import ctypes
import math
import sys
import threading
import weakref
from dataclasses import dataclass

import torch

from megatrain.planner.host_policy import PAGE, aligned, pinned_region_bytes

from .host_init import touch_all


@dataclass(frozen=True)
class HostBuffer:
    """One host buffer to allocate: its name, what it counts as (a host_layout component), shape, dtype."""

    name: str
    component: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pinned: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
_libc = None


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back the 2 MiB-aligned part of `t`'s memory with transparent huge pages (madvise
    MADV_HUGEPAGE; it must come before the pages are first touched). False where that part is empty, the
    platform is not Linux or the kernel refuses (THP compiled out); `never` in sysfs accepts and does nothing."""
    global _libc
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if hi <= lo or not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc.madvise(lo, hi - lo, MADV_HUGEPAGE) == 0


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty advised for huge pages (uninitialised: nothing has touched it)."""
    t = torch.empty(shape, dtype=dtype)
    advise_huge_pages(t)
    return t


def _unregister(ptrs: list[int]) -> None:
    cudart = torch.cuda.cudart()
    while ptrs:
        cudart.cudaHostUnregister(ptrs.pop())


class HostArena:
    """Allocates and counts host buffers; `kind` "cuda" page-locks the pinned regions, "sim" does not."""

    def __init__(self, kind: str = "sim"):
        if kind not in ("sim", "cuda"):
            raise ValueError(f"host arena kind must be sim or cuda, got {kind!r}")
        self.kind = kind
        self.by_component: dict[str, int] = {}
        self._registered: list[int] = []
        self._regions: list[torch.Tensor] = []  # NOTE: held so no region is freed while still registered
        self._lock = threading.Lock()
        if kind == "cuda":
            self._finalizer = weakref.finalize(self, _unregister, self._registered)

    @property
    def allocated_bytes(self) -> int:
        """Every byte this arena allocated: pinned regions (with their alignment) and pageable buffers."""
        return sum(self.by_component.values())

    def allocate(self, buffers: list[HostBuffer]) -> dict[str, torch.Tensor]:
        """Allocate `buffers` (uninitialised): the pinned ones as views of one new region, the others one by
        one. Returns name -> tensor of the buffer's shape and dtype."""
        out: dict[str, torch.Tensor] = {}
        pinned = [b for b in buffers if b.pinned]
        with self._lock:
            for b in buffers:
                if not b.pinned:
                    out[b.name] = empty(b.shape, b.dtype)
                    self._count(b.component, b.nbytes)
            if pinned:
                region_bytes = pinned_region_bytes(b.nbytes for b in pinned)
                region = empty((region_bytes,), torch.uint8)  # advised before cudaHostRegister touches it
                self._regions.append(region)
                base = -region.data_ptr() % PAGE
                if self.kind == "cuda":
                    # NOTE: registering pins every page, faulting in the absent ones on this one thread:
                    # fault them in on the creation pool first (host_init)
                    touch_all(region)
                    self._register(region.data_ptr() + base, region_bytes - PAGE)
                offset = base
                for b in pinned:
                    out[b.name] = region[offset : offset + b.nbytes].view(b.dtype).view(b.shape)
                    self._count(b.component, b.nbytes)
                    offset += aligned(b.nbytes)
                self._count("pinned_alignment", region_bytes - sum(b.nbytes for b in pinned))
        return out

    def _count(self, component: str, nbytes: int) -> None:
        self.by_component[component] = self.by_component.get(component, 0) + nbytes

    def _register(self, ptr: int, nbytes: int) -> None:
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))  # 1: cudaHostRegisterPortable
        if err != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes:,} bytes of host memory failed (cudaError {err}); "
                               "the machine may limit page-locked memory: check `ulimit -l` and free host memory")
        self._registered.append(ptr)

    def close(self) -> None:
        """Unregister the pinned regions (idempotent); the memory stays valid, pageable, while views live."""
        if self.kind == "cuda":
            self._finalizer()
