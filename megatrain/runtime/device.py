"""The `cuda` device: the Device of stream_device.py on real CUDA streams, the allocator's settings and cap,
and `make_device`, which picks a device by kind.

Where it sits: the engine (runtime/engine.py) runs a step program on a Device; the semantics (streams,
events, failures, worker threads) are stream_device.py's, the same on both kinds. Run its tests:
`.venv/bin/pytest tests/runtime/test_device.py tests/runtime/test_fake_cuda.py` (on a GPU: `make test-cuda`).
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable

import torch

from . import cast_kernel
from .cpus import resolve as resolve_cpus
from .stream_device import Device, SimDevice

GPU_STREAMS = ("compute", "h2d", "d2h", "comm")  # comm: a world program's collectives (runtime/distributed.py)
HOST_STREAMS = ("host", "disk")  # Python on a thread of their own, no CUDA stream (disk: checkpoint writes)
CONVERT_CHUNK = 1 << 24  # elements per converting device-to-host copy on cuda (64 MiB fp32 temporary at most)


class CudaDevice(Device):
    """Real CUDA streams for compute/h2d/d2h, a Python thread for host; one issuing thread per stream.

    Events: a GPU stream waiting on a GPU record blocks its issuing thread until the record is issued, then
    `stream.wait_event`s it; the host waiting on a GPU record waits for the issue, then synchronizes the CUDA
    event; a GPU stream waiting on a host record blocks its issuing thread until the host has run it.
    Buffers: allocate device tensors inside compute-stream fns and free them there after the program's wait
    on any copy stream that used them, so the caching allocator never hands out memory still in flight.
    """

    kind = "cuda"

    def __init__(self, budget_bytes: int | None = None, index: int = 0,
                 gpu_delays: tuple[int, int] | None = None, seed: int = 0):
        """`gpu_delays`: (lo, hi) GPU clock cycles of torch.cuda._sleep queued on a GPU stream before each of
        its ops (drawn per stream from `seed`), so the GPU, not only the issuing threads, runs the streams
        out of step; the CUDA twin of SimDevice's delays, for ordering tests."""
        if gpu_delays is not None and not 0 <= gpu_delays[0] <= gpu_delays[1]:
            raise ValueError(f"gpu_delays must be (lo, hi) cycles with 0 <= lo <= hi, got {gpu_delays}")
        if not torch.cuda.is_available():
            raise ValueError("CUDA is not available on this machine (torch.cuda.is_available() is False); "
                             "use --device sim to run on the CPU")
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(f"CUDA device index {index} out of range; this machine has "
                             f"{torch.cuda.device_count()} GPU(s)")
        settings = allocator_settings(os.environ)
        if settings and hasattr(torch.cuda.memory, "_set_allocator_settings"):
            torch.cuda.memory._set_allocator_settings(settings)
        super().__init__(budget_bytes, torch.device("cuda", index), resolve_cpus("cuda", index))
        self._streams = {s: torch.cuda.Stream(device=self.torch_device) for s in GPU_STREAMS}
        self._cuda_lock = threading.Lock()
        # Issued GPU records not yet known complete: name -> {step: event}. Completed ones are pruned;
        # a wait that finds none has nothing left to wait for.
        self._cuda_events: dict[str, dict[int, torch.cuda.Event]] = {}
        self._stage_events: dict[int, torch.cuda.Event] = {}  # staging buffer -> its last copy's event
        self._host_arena = None
        self._limited = False  # limit_allocator() capped the allocator
        self._gpu_delays = gpu_delays
        self._rngs = {s: random.Random(f"{seed}:{s}") for s in GPU_STREAMS}
        self._start_workers()

    def _worker_init(self, stream: str) -> None:
        super()._worker_init(stream)
        torch.cuda.set_device(self.torch_device)

    def _before(self, stream: str) -> None:
        if self._gpu_delays is not None and stream in self._streams:
            with torch.cuda.stream(self._streams[stream]):
                torch.cuda._sleep(self._rngs[stream].randint(*self._gpu_delays))

    def _run_op(self, stream: str, fn: Callable[[], None]) -> None:
        if stream in HOST_STREAMS:
            fn()
            return
        with torch.cuda.stream(self._streams[stream]):
            fn()

    def _run_record(self, stream: str, event: str, step: int) -> None:
        if stream not in HOST_STREAMS:
            cuda_event = torch.cuda.Event(blocking=True)  # blocking: a host synchronize() sleeps, not spins
            cuda_event.record(self._streams[stream])
            with self._cuda_lock:
                pending = self._cuda_events.setdefault(event, {})
                for old in [s for s, e in pending.items() if s < step and e.query()]:
                    del pending[old]
                pending[step] = cuda_event
        self._events.mark(event, step)  # issued (GPU) or done (host)

    def _run_wait(self, stream: str, event: str, step: int) -> None:
        self._events.wait_for(event, step)
        with self._cuda_lock:
            cuda_event = self._cuda_events.get(event, {}).get(step)
        if cuda_event is None:
            return  # a host record (done when issued) or a GPU record already complete
        if stream in HOST_STREAMS:
            cuda_event.synchronize()
        else:
            self._streams[stream].wait_event(cuda_event)

    def _device_synchronize(self, stream: str | None) -> None:
        if stream is None:
            torch.cuda.synchronize(self.torch_device)
        elif stream not in HOST_STREAMS:
            self._streams[stream].synchronize()

    def cuda_stream(self, name: str) -> torch.cuda.Stream:
        """The CUDA stream a GPU stream's worker issues on (a host thread orders its own copies after it)."""
        return self._streams[name]

    def host_empty(self, shape, dtype) -> torch.Tensor:
        """A page-locked host tensor at its exact size (host_memory.py), not torch's power-of-two pinned pool."""
        from .host_memory import HostArena, HostBuffer

        if self._host_arena is None:
            self._host_arena = HostArena("cuda")
        return self._host_arena.allocate([HostBuffer("t", "misc", tuple(shape), dtype, pinned=True)])["t"]

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.dtype != src.dtype and src.is_cuda and not dst.is_cuda:
            # NOTE: a converting device->host copy converts on the GPU into a temporary first: chunk it so the
            # temporary stays small (the d2h stream's, outside the program's buffers)
            for a in range(0, src.numel(), CONVERT_CHUNK):
                dst.view(-1)[a : a + CONVERT_CHUNK].copy_(src.view(-1)[a : a + CONVERT_CHUNK], non_blocking=True)
            return
        dst.copy_(src, non_blocking=True)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        # NOTE: small tensors, so torch's pinned pool (its power-of-two rounding costs bytes, not GiB); the
        # source was allocated on the compute stream: record this stream so the allocator keeps it until the
        # copy has run
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        t.record_stream(torch.cuda.current_stream(self.torch_device))
        return out

    def stage_copy(self, dst: torch.Tensor, src: torch.Tensor, stage: torch.Tensor) -> None:
        key = stage.data_ptr()
        with self._cuda_lock:
            done = self._stage_events.get(key)
        if done is not None:
            done.synchronize()  # the previous copy out of this staging buffer has finished
        cast_kernel.cast(src, stage)  # the C cast, torch's bits (cast_kernel.py)
        dst.copy_(stage, non_blocking=True)
        event = torch.cuda.Event(blocking=True)  # the next copy's synchronize() sleeps, not spins a core
        event.record()  # on the current stream: the h2d stream's inside load_params, the caller's in evaluate
        with self._cuda_lock:
            self._stage_events[key] = event

    def measured_peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.torch_device)

    def memory_report(self) -> dict[str, int]:
        free, total = torch.cuda.mem_get_info(self.torch_device)
        return {"peak_device_bytes": torch.cuda.max_memory_allocated(self.torch_device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(self.torch_device),
                "device_used_bytes": total - free, "device_total_bytes": total}

    def limit_allocator(self, nbytes: int) -> None:
        """Cap torch's caching allocator on this GPU at `nbytes` (an allocation past it raises out of memory,
        as the plan's budget promises) until close()."""
        _, total = torch.cuda.mem_get_info(self.torch_device)
        torch.cuda.set_per_process_memory_fraction(allocator_fraction(nbytes, total), self.torch_device)
        self._limited = True

    def close(self) -> None:
        super().close()
        if self._limited:  # the cap is the process's: lift it with the device that set it
            self._limited = False
            torch.cuda.set_per_process_memory_fraction(1.0, self.torch_device)

    def reset_peak(self) -> None:
        super().reset_peak()
        torch.cuda.reset_peak_memory_stats(self.torch_device)


def allocator_fraction(nbytes: int, total_bytes: int) -> float:
    """The fraction of a GPU's `total_bytes` that caps its allocator at `nbytes`, for
    torch.cuda.set_per_process_memory_fraction; a cap the GPU cannot hold is refused."""
    if nbytes <= 0:
        raise ValueError(f"the device allocator's limit must be > 0 bytes, got {nbytes:,}: raise the GPU budget "
                         "above the hardware profile's reserved bytes")
    if nbytes > total_bytes:
        raise ValueError(f"the GPU budget leaves the allocator {nbytes:,} bytes but the GPU has {total_bytes:,}; "
                         "lower the GPU budget (--gpu-budget) to what the GPU holds")
    return nbytes / total_bytes


def allocator_settings(environ) -> str | None:
    """torch's CUDA caching allocator settings for a run: expandable segments, unless the user configured the
    allocator (PYTORCH_CUDA_ALLOC_CONF). The four streams each cache their own blocks under a cap at the budget
    (limit_allocator); with fixed-size segments fragmentation past the allocator margin makes it free its cache
    and retry, a device-wide synchronize in the step, or fail; growable segments map pages instead."""
    return None if environ.get("PYTORCH_CUDA_ALLOC_CONF") else "expandable_segments:True"


def make_device(kind: str, budget_bytes: int | None = None, **kw) -> Device:
    """A device by kind: "sim", "cuda", or "auto" (cuda when available, else sim)."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "sim"
    if kind == "sim":
        return SimDevice(budget_bytes, **kw)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: CUDA is not available on this machine "
                             "(torch.cuda.is_available() is False); use --device sim to run on the CPU")
        return CudaDevice(budget_bytes, **kw)
    raise ValueError(f"unknown device kind {kind!r}; valid kinds: sim, cuda, auto")
