"""A fake CUDA backend: megatrain's CUDA-only code runs, with real values, on a CPU-only machine.

Why: the CUDA path (runtime/device.py CudaDevice, pinned host memory, the staging ring, the allocator cap,
the eager CUDA reference, the device script's cases) shares no code with the sim device, and a GPU is lent
only now and then, for minutes. Installed, this backend lets that code run unchanged in CI:

- tensors on device "cuda" are CPU tensors that say cuda:0 (tensors.py); mixing them with host tensors in
  one op raises as on a GPU; values are real, so streamed == eager tests run through the CUDA code path;
- torch.cuda's streams, events, synchronize, memory queries and statistics, the allocator cap, cudaHostRegister
  and pinned memory are stand-ins (streams.py) that enforce the stream protocol: a buffer read on another
  stream only after an event wait, host memory reused only after the copies reading it are known done,
  device memory freed only once its allocating stream knows every use; every host synchronisation is
  recorded with the line that made it; pinned bytes are counted.

The seam is torch.cuda and torch's function dispatch, not megatrain's code: CudaDevice runs the same lines
here as on a GPU. What it cannot check: kernels' own numerics (CPU kernels compute), real concurrency of the
GPU (work runs when issued; reorderings are checked, not performed), and GPU-only kernels, for which it
runs a CPU equivalent (varlen flash attention: per-document causal SDPA).

Use: `MEGATRAIN_FAKE_CUDA=1` in the environment installs it when megatrain is imported (`make
test-cuda-fake`, `benchmarks/gpu/run.sh --rehearse`); or `install()` / `uninstall()`; `state()` is what it
recorded.
"""

from __future__ import annotations

import os
import threading
import types

from . import streams as _streams
from .streams import FakeEvent, FakeStream, ProtocolError, State, state, stream_context

ENV = "MEGATRAIN_FAKE_CUDA"
DEVICE_NAME = "NVIDIA H100 80GB HBM3 (fake CUDA on the CPU: megatrain.fake_cuda)"  # plans as an H100
_saved: dict = {}

__all__ = ["ENV", "DEVICE_NAME", "ProtocolError", "install", "uninstall", "installed", "state",
           "install_from_env"]


def installed() -> bool:
    return _streams.current is not None


def install_from_env() -> None:
    """Install when MEGATRAIN_FAKE_CUDA=1 (megatrain/__init__.py calls this)."""
    if os.environ.get(ENV, "") == "1" and not installed():
        install()


def install(total_memory: int = 80 * 2**30, devices: int | None = None) -> State:
    """Install the backend in this process (idempotent); `total_memory` is each fake GPU's size, `devices`
    how many there are (default MEGATRAIN_FAKE_CUDA_DEVICES, else 2: enough for two torchrun ranks, whose
    NCCL process groups run over gloo)."""
    import torch

    if _streams.current is not None:
        return _streams.current
    if torch.cuda.is_available() and not _saved:
        raise RuntimeError("a real GPU is visible: the fake CUDA backend is for CPU-only machines")
    st = _streams.current = State(total_memory)
    st.devices = devices or int(os.environ.get("MEGATRAIN_FAKE_CUDA_DEVICES", "2"))
    from .tensors import FakeCudaMode

    mode = FakeCudaMode()
    _patch(torch, mode)
    mode.__enter__()
    _saved["main_mode"] = mode
    return st


def uninstall() -> None:
    """Undo install() (the mode in other live threads goes with their end)."""
    if _streams.current is None:
        return
    _saved.pop("main_mode").__exit__(None, None, None)
    for (obj, name), value in _saved.pop("attrs").items():
        setattr(obj, name, value)
    _saved.clear()
    _streams.current = None


def _set(obj, name, value) -> None:
    _saved.setdefault("attrs", {}).setdefault((obj, name), getattr(obj, name, None))
    setattr(obj, name, value)


class _Cudart:
    """torch.cuda.cudart()'s stand-in: host registration, counted (pinned bytes equal the plan's)."""

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802  (CUDA's name)
        st = state()
        with st.lock:
            if ptr in st.pinned:
                return 712  # cudaErrorHostMemoryAlreadyRegistered
            st.pinned[ptr] = nbytes
            st.registered_bytes += nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        st = state()
        with st.lock:
            n = st.pinned.pop(ptr, None)
            if n is None:
                return 713  # cudaErrorHostMemoryNotRegistered
            st.registered_bytes -= n
        return 0

    def cudaProfilerStart(self) -> int:  # noqa: N802
        return 0

    cudaProfilerStop = cudaProfilerStart  # noqa: N815


def _props(total: int):
    # NOTE: a PCI address no machine has (domain ffff), so the NUMA binding finds no node unless a test's sysfs
    # names one
    return types.SimpleNamespace(name=DEVICE_NAME, total_memory=total, multi_processor_count=132, major=9,
                                 minor=0, L2_cache_size=50 * 2**20, is_integrated=False, uuid="fake",
                                 pci_domain_id=0xFFFF, pci_bus_id=0x1B, pci_device_id=0)


def _patch(torch, mode) -> None:
    import torch.nn.attention.varlen as varlen

    from .kernels import varlen_attn

    cuda, st = torch.cuda, _streams.current
    default = FakeStream(_agent=st.default)

    streams: list = []  # every stream made, so synchronize() and current_stream() know them

    class Stream(FakeStream):
        def __init__(self, device=None, priority=0, **kw):
            super().__init__(device, priority, **kw)
            streams.append(self)
            _patch_host_kernels()

    def synchronize(device=None):
        with st.lock:
            snap = {}
            for agent in (st.default, *(s.agent for s in streams)):
                snap.update({k: max(v, snap.get(k, 0)) for k, v in agent.snapshot().items()})
        st.synchronized(snap, "torch.cuda.synchronize")

    def current_stream(device=None):
        agent = st.current()
        return next((s for s in streams if s.agent is agent), default)

    def set_fraction(fraction, device=None):
        st.cap = None if fraction >= 1.0 else int(fraction * st.total_memory)

    def reset_peak(device=None):
        st.peak = st.allocated

    def generator_cls(base):
        class Generator(base):
            def __new__(cls, device="cpu"):
                return base.__new__(cls, "cpu" if _is_cuda(device) else device)
        return Generator

    def _is_cuda(device):
        return device is not None and (isinstance(device, int) or torch.device(device).type == "cuda")

    cuda_gen = torch.Generator().manual_seed(0)
    from . import tensors

    def set_device(device):
        index = device if isinstance(device, int) else torch.device(device).index or 0
        if not 0 <= index < st.devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} (the fake has {st.devices})")
        tensors._current[0] = index
    for name, value in {
        "is_available": lambda: True, "device_count": lambda: st.devices, "current_device": lambda: tensors._current[0],
        "set_device": set_device, "is_initialized": lambda: True, "init": lambda: None,
        "_lazy_init": lambda: None, "get_device_name": lambda device=None: DEVICE_NAME,
        "get_device_properties": lambda device=None: _props(st.total_memory),
        "get_device_capability": lambda device=None: (9, 0), "is_bf16_supported": lambda *a, **k: True,
        "synchronize": synchronize, "Stream": Stream, "Event": FakeEvent, "stream": stream_context,
        "current_stream": current_stream, "default_stream": lambda device=None: default,
        "mem_get_info": lambda device=None: (st.total_memory - st.allocated, st.total_memory),
        "memory_allocated": lambda device=None: st.allocated, "max_memory_allocated": lambda device=None: st.peak,
        "memory_reserved": lambda device=None: st.allocated, "max_memory_reserved": lambda device=None: st.peak,
        "reset_peak_memory_stats": reset_peak, "empty_cache": lambda: None,
        "set_per_process_memory_fraction": set_fraction, "cudart": lambda: _Cudart(),
        "host_memory_stats": lambda: {"allocated_bytes.current": st.pool_pinned_bytes},
        "memory_stats": lambda device=None: {"allocated_bytes.all.current": st.allocated,
                                             "allocated_bytes.all.peak": st.peak},
        "_sleep": lambda cycles: st.access(st.current(), [], [], "_sleep"),
        "get_rng_state": lambda device=None: cuda_gen.get_state(),
        "set_rng_state": lambda state, device=None: cuda_gen.set_state(state),
        "manual_seed": lambda seed: cuda_gen.manual_seed(seed),
        "manual_seed_all": lambda seed: cuda_gen.manual_seed(seed),
        "device": lambda device=None: _NullContext(),
    }.items():
        _set(cuda, name, value)
    _set(cuda.memory, "_set_allocator_settings", st.allocator_settings.append)
    _set(torch, "Generator", generator_cls(torch._C.Generator))
    _set(varlen, "varlen_attn", varlen_attn)
    _set(threading.Thread, "_bootstrap_inner", _with_mode(threading.Thread._bootstrap_inner))
    import torch.autograd as autograd

    from .tensors import bypassing

    has_torch_function = autograd.has_torch_function
    _set(autograd, "has_torch_function", lambda args: not bypassing() and has_torch_function(args))
    _patch_distributed(torch)
    _set(torch.__future__, "_overwrite_module_params_on_conversion", True)


def _patch_distributed(torch) -> None:
    """NCCL process groups run over gloo (the tensors are CPU memory underneath): the Communicator's CUDA
    wiring (set_device, device_id, its "comm" group) runs unchanged."""
    import torch.distributed as dist

    if not dist.is_available():
        return

    def gloo(backend):
        return "gloo" if isinstance(backend, str) and backend.lower() == "nccl" else backend

    init, new_group = dist.init_process_group, dist.new_group

    def init_process_group(backend=None, *args, device_id=None, **kwargs):
        return init(gloo(backend), *args, **kwargs)

    def new_group_(*args, backend=None, **kwargs):
        return new_group(*args, backend=gloo(backend), **kwargs)
    _set(dist, "init_process_group", init_process_group)
    _set(dist, "new_group", new_group_)


def _host_call(fn, reads, writes, label):
    """`fn` with its host memory accesses checked: megatrain's C kernels read and write through pointers,
    which the mode does not see (the cast into a staging buffer, the optimizer on d2h-written gradients)."""
    from .tensors import _record

    def call(*args, **kwargs):
        _record(reads(args, kwargs), writes(args, kwargs), label, False)
        return fn(*args, **kwargs)
    call.__wrapped__ = fn
    return call


def _patch_host_kernels() -> None:
    """Once a CUDA stream exists (megatrain's runtime is imported by then; importing it at install would
    import megatrain from inside its own __init__)."""
    if _saved.get("host_kernels"):
        return
    _saved["host_kernels"] = True
    from megatrain.runtime import cast_kernel, store

    _set(cast_kernel, "cast", _host_call(cast_kernel.cast, lambda a, k: [a[0]], lambda a, k: [a[1]],
                                         "cast_kernel.cast"))
    # AdamW reads the gradients (the d2h stream wrote them) and writes the masters (the h2d stream reads them)
    _set(store, "adamw_step", _host_call(store.adamw_step, lambda a, k: list(a[2]),
                                         lambda a, k: [*a[1], *(k.get("copies") or [])], "adamw_step"))


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _with_mode(bootstrap):
    """Every new thread runs inside the mode (torch function modes are per thread)."""

    def run(self):
        if _streams.current is None:
            return bootstrap(self)
        from .tensors import FakeCudaMode

        with FakeCudaMode():
            return bootstrap(self)
    return run
