"""Checkpoint copies through bounded pinned staging: long carries cross the link in chunks, overlapped.

Where it sits: the engine's `offload_act` / `load_act` (engine.py) copy a checkpoint longer than
`STAGING_BYTES` (ir/program.py) through this; shorter ones copy straight from or to their own pinned host
buffer, as before. The planner prices the same chunking (planner/transfers.py). Try it:
`pytest tests/runtime/test_staging.py -q`.

Why: the carry of a 1M-token sequence is 8 GiB in bf16 at d=4096, and a long-context step offloads one per
unit. Pinning every host copy at its exact size would pin hundreds of GiB; instead the host copies are
pageable and each copy stream has two pinned buffers of STAGING_BYTES (256 MiB), which the host store allocates
with the plan's other pinned buffers (the plan counts them as `checkpoint_staging`). Device -> host: the DMA of chunk
i+1 into one buffer overlaps the CPU's copy of chunk i out of the other into the pageable checkpoint; host
-> device: the CPU's copy of chunk i+1 into one buffer overlaps the DMA of chunk i from the other. A buffer
is reused only once the copy out of it (or its DMA) has finished: the CPU waits on the DMA's event.
On the sim device the same chunks run through the same buffers as plain synchronous copies.
"""

from __future__ import annotations

import torch

from megatrain.ir.program import STAGING_BYTES

from .stream_device import Device


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("a staged checkpoint copy needs contiguous tensors (carries are contiguous)")
    return t.view(-1).view(torch.uint8)


class Staging:
    """Two pinned buffers of `chunk` bytes per copy stream, allocated on first use, and the copies through them.
    Each method runs inside an op of its stream (a device worker), so CUDA copies land on that stream."""

    def __init__(self, device: Device, chunk: int = STAGING_BYTES,
                 buffers: dict[str, list[torch.Tensor]] | None = None):
        self.device, self.chunk = device, chunk
        self.cuda = device.kind == "cuda"
        # the host store's (allocated with the plan's other host buffers), else allocated on first use
        self._buffers: dict[str, list[torch.Tensor]] = dict(buffers or {})
        self._events: dict[str, list] = {stream: [None, None] for stream in self._buffers}

    def pinned_bytes(self) -> int:
        return sum(b.nbytes for bufs in self._buffers.values() for b in bufs)

    def _pair(self, stream: str) -> list[torch.Tensor]:
        if stream not in self._buffers:  # NOTE: outside a store (tests): torch's pinned pool, not counted
            self._buffers[stream] = [self.device.host_empty((self.chunk,), torch.uint8) for _ in range(2)]
            self._events[stream] = [None, None]
        return self._buffers[stream]

    def _record(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event(blocking=True)  # the CPU's synchronize() on it sleeps, not spins a core
        event.record()  # on the current stream: the op's copy stream
        return event

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Device `src` -> (pageable) host `dst`, chunk by chunk; returns when `dst` holds all of it."""
        a, b, bufs = _bytes(src), _bytes(dst), self._pair("d2h")
        pending: list[tuple] = []  # (event, staging slice, destination slice), oldest first

        def drain():
            event, buf, out = pending.pop(0)
            if event is not None:
                event.synchronize()
            out.copy_(buf)

        for i, s in enumerate(range(0, a.numel(), self.chunk)):
            e = min(s + self.chunk, a.numel())
            if len(pending) == 2:  # chunk i - 2 used this buffer: copy it out first
                drain()
            buf = bufs[i % 2][: e - s]
            buf.copy_(a[s:e], non_blocking=self.cuda)
            pending.append((self._record(), buf, b[s:e]))
        while pending:
            drain()

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """(Pageable) host `src` -> device `dst`, chunk by chunk; the last DMAs may still run on the stream
        when it returns (the program's record after the op orders what reads `dst`)."""
        a, b, bufs = _bytes(src), _bytes(dst), self._pair("h2d")
        events = self._events["h2d"]
        for i, s in enumerate(range(0, a.numel(), self.chunk)):
            e = min(s + self.chunk, a.numel())
            k = i % 2
            if events[k] is not None:  # the DMA that last read this buffer must be done before refilling it
                events[k].synchronize()
            buf = bufs[k][: e - s]
            buf.copy_(a[s:e])
            b[s:e].copy_(buf, non_blocking=self.cuda)
            events[k] = self._record()
