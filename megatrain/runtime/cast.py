"""Where a load's compute-dtype weights come from at run time: the place the plan's `cast` pass chose.

Where it sits: the host store (store.py) builds one `Feed` for its program (`Program.cast`, planner/cast.py;
a program without one casts on the host) and `load_params` hands each unit's (start, end, fp32 master view)
segments to it; the engine binds the "gpu" place's device staging buffer (`cast`, a static program buffer);
the optimizer step writes the "copy" place's bf16 copy (`copies`). Every place gives the slot the same bits:
the master rounded to bf16 to nearest even, torch's `.to(torch.bfloat16)`, so streamed training is the same
whichever the plan takes (tests/runtime/test_exactness.py).

- none (fp32 compute): the pinned fp32 master crosses the link itself.
- host: each chunk is cast into the next of two pinned staging buffers by runtime/cast_kernel.c on the h2d
  worker's threads (Device.stage_copy), then copied; on CUDA the cast of one chunk overlaps the DMA of the one
  before.
- gpu: each chunk of the pinned fp32 master is copied into the device's fp32 staging buffer and cast from it
  into the slot on the same (h2d) stream, which orders the next chunk's copy behind the cast.
- copy: the bf16 copy of every unit's masters (host layout, pinned), written by each optimizer step in its own
  pass, is copied as it is. A unit whose masters may have changed otherwise (initial weights, a checkpoint's
  load, any view handed out by `named_master`, `state_tensors` or `shard_state`: a checkpoint's save too, since
  those views are for reading and writing) is marked stale and its copy cast again at its next load, one host
  cast of the unit.
"""

from __future__ import annotations

import threading

import torch

from megatrain.planner.host_policy import staging_elems, transfer_buffers

from . import cast_kernel
from .host_memory import HostBuffer

Segments = list[tuple[int, int, torch.Tensor]]  # (start, end in the slot, fp32 source view)


class Feed:
    """Base: the fp32 masters copied as they are (fp32 compute)."""

    where = "none"

    def load(self, segments: Segments, dst: torch.Tensor, device) -> None:
        for lo, hi, src in segments:
            device.copy(dst[lo:hi], src)

    def copies(self, unit: str) -> list[torch.Tensor] | None:
        """The bf16 views an optimizer step of `unit` writes its updated weights into (None: none)."""
        return None

    def stepped(self, unit: str) -> None:
        """`unit`'s optimizer step ran (with `copies`)."""

    def invalidate(self, unit: str | None = None) -> None:
        """`unit`'s masters (None: every unit's) may have been written outside an optimizer step."""


class HostFeed(Feed):
    """Cast on the host into the pinned staging ring, chunk by chunk (Device.stage_copy)."""

    where = "host"

    def __init__(self, stage: list[torch.Tensor]):
        self.stage = stage

    def load(self, segments: Segments, dst: torch.Tensor, device) -> None:
        k, step = 0, self.stage[0].numel()
        for lo, hi, src in segments:
            for a in range(lo, hi, step):
                b = min(hi, a + step)
                device.stage_copy(dst[a:b], src[a - lo : b - lo], self.stage[k][: b - a])
                k ^= 1


class GpuFeed(Feed):
    """fp32 across the link into the device staging buffer, cast there into the slot."""

    where = "gpu"

    def __init__(self):
        self.stage: torch.Tensor | None = None  # bound by the engine (the program's `cast` buffer)

    def bind(self, stage: torch.Tensor) -> None:
        self.stage = stage

    def load(self, segments: Segments, dst: torch.Tensor, device) -> None:
        if self.stage is None:
            raise RuntimeError("the plan casts on the device, but no `cast` staging buffer was bound: run the "
                               "program through an Engine, which allocates it")
        step = self.stage.numel()
        for lo, hi, src in segments:
            for a in range(lo, hi, step):
                b = min(hi, a + step)
                landed = self.stage[: b - a]
                device.copy(landed, src[a - lo : b - lo])
                dst[a:b].copy_(landed)  # on the calling stream: after the copy above, before the next one


class CopyFeed(Feed):
    """A persistent bf16 copy of the masters, written by the optimizer; a load copies it as it is."""

    where = "copy"

    def __init__(self, store, copies: dict[str, torch.Tensor]):
        self.store, self.flat = store, copies  # unit name -> its bf16 copy, the master's host layout
        self.stale = set(copies)  # nothing has written the copies yet
        self.lock = threading.Lock()
        self.views = {name: [c[p.offset : p.offset + p.numel] for p in store.units[name].host]
                      for name, c in copies.items()}

    def _copy_of(self, src: torch.Tensor) -> tuple[str, torch.Tensor]:
        """(the unit owning the fp32 master view `src`, the same elements of its bf16 copy)."""
        for name, st in self.store.units.items():
            at = (src.data_ptr() - st.master.data_ptr()) // st.master.element_size()
            if 0 <= at < st.master.numel():
                return name, self.flat[name][at : at + src.numel()]
        raise ValueError("a load source outside every unit's master")

    def load(self, segments: Segments, dst: torch.Tensor, device) -> None:
        for lo, hi, src in segments:
            owner, copy = self._copy_of(src)
            with self.lock:
                stale = owner in self.stale
                self.stale.discard(owner)
            if stale:
                st = self.store.units[owner]
                for c, m in zip(self.views[owner], st.master_views()):
                    cast_kernel.cast(m, c)
            device.copy(dst[lo:hi], copy)

    def copies(self, unit: str) -> list[torch.Tensor] | None:
        return self.views[unit]

    def stepped(self, unit: str) -> None:
        with self.lock:
            self.stale.discard(unit)

    def invalidate(self, unit: str | None = None) -> None:
        with self.lock:
            self.stale.update(self.flat if unit is None else (unit,))


def host_buffers(ir, where: str, dtype: torch.dtype) -> tuple[bool, list[HostBuffer]]:
    """(masters pinned, the pinned buffers a load reads besides them) of the place `where`: the two staging
    buffers `stage{k}` (host) or each unit's bf16 copy `copy.{unit}` (copy), as host_policy.transfer_buffers
    counts them."""
    pinned, transfer = transfer_buffers(ir, where)
    kinds = {kind for kind, nbytes in transfer if nbytes}
    out = []
    if "transfer_staging" in kinds:
        out += [HostBuffer(f"stage{k}", "transfer_staging", (staging_elems(ir),), dtype, pinned=True) for k in range(2)]
    if "transfer_copy" in kinds:
        out += [HostBuffer(f"copy.{u.name}", "transfer_copy", (u.host_numel,), dtype, pinned=True)
                for u in ir.units if u.host_numel]
    return pinned, out


def feed(where: str, store, bufs: dict[str, torch.Tensor]) -> Feed:
    """The feed of `where` over the store's buffers (its staging ring `stage{k}`, its copies `copy.{unit}`)."""
    if where == "host":
        return HostFeed([bufs[f"stage{k}"] for k in range(2)])
    if where == "gpu":
        return GpuFeed()
    if where == "copy":
        return CopyFeed(store, {u.name: bufs.get(f"copy.{u.name}", torch.empty(0, dtype=torch.bfloat16))
                                for u in store.ir.units})
    return Feed()
