"""Seconds of a checkpoint copy, as the runtime moves it: direct, or chunked through pinned staging.

Where it sits: costs.py prices `offload_act` / `load_act` here; runtime/staging.py does what this prices.
Try it: `python -c "from megatrain.planner.transfers import copy_seconds; help(copy_seconds)"`.

A copy of at most STAGING_BYTES goes straight between the device and its own pinned host buffer: bytes / link
bandwidth + one copy latency. A longer one runs as a two-stage pipeline over n chunks of STAGING_BYTES, the
DMA (chunk / link) and the CPU's copy between the pinned buffer and the pageable checkpoint (chunk / memcpy
rate, half the host memory bandwidth: it reads and writes): n x the slower stage + one of the faster (the
pipeline's fill) + n copy latencies.
"""

from __future__ import annotations

from megatrain.ir.program import STAGING_BYTES

from .hardware import Hardware


def copy_seconds(nbytes: int, link_bytes_per_s: float, hw: Hardware, chunk: int = STAGING_BYTES) -> float:
    """Seconds to copy a checkpoint of `nbytes` over a link of `link_bytes_per_s`."""
    if nbytes <= chunk:
        return nbytes / link_bytes_per_s + hw.copy_latency_s
    n = -(-nbytes // chunk)
    dma, cpu = chunk / link_bytes_per_s, chunk / (hw.host_memory_bytes_per_s / 2)
    return (nbytes / chunk) * max(dma, cpu) + min(dma, cpu) + n * hw.copy_latency_s


STAGING_BUFFERS = 4  # two per copy stream (d2h, h2d)


def staging_bytes(largest_offload: int, chunk: int = STAGING_BYTES) -> int:
    """Pinned host bytes of the staging buffers: two per copy stream when any checkpoint is staged."""
    return STAGING_BUFFERS * chunk if largest_offload > chunk else 0
