"""The CPU budget of a run: which cores the process runs on, and how many intra-op threads each stream worker
gets (docs/DESIGN.md 4.5).

Where it sits: a Device (device.py) resolves its budget when it starts and each stream worker sets its own
intra-op thread count (`torch.set_num_threads` is per thread once a thread has used it) before its first op.
Left to torch, every thread that runs a CPU op (the host optimizer's fused AdamW, the h2d worker's bf16 cast
into the staging ring) takes every core, and they compete with the threads that issue GPU work and with
autograd. Run its tests: `.venv/bin/pytest tests/runtime/test_gpu_readiness.py -k cpu`.

- cuda: the compute, d2h and comm workers only issue GPU work (1 thread each), the h2d worker casts chunks (2
  threads on 8 cores or more, else 1), the main thread keeps a core, and the host optimizer takes the rest;
  the disk worker (streamed checkpoint writes: hashing and file I/O, no parallel torch op) has one, beside them.
  When the GPU's NUMA node is known (sysfs: its PCI address's `numa_node`), the process is bound to that node's
  cores first, so the optimizer's threads and the pinned memory they touch first sit beside the GPU's link.
  `MEGATRAIN_NUMA_BIND=0` turns the binding off; `MEGATRAIN_HOST_THREADS=N` sets the optimizer's threads.
- sim: the compute worker is the "GPU" and computes with the intra-op threads the constructing thread has (so
  the streamed run reduces as the eager reference on that thread does, bit for bit); the host optimizer takes
  half of them; the copy workers, the disk worker and a world's comm worker (gloo) one each.

`torch.set_num_threads` also sets the process-wide count that threads initialise from lazily, so the device
waits for its workers to set theirs and then restores the constructing thread's (device.py `_start_workers`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

HOST_THREADS_ENV = "MEGATRAIN_HOST_THREADS"
NUMA_BIND_ENV = "MEGATRAIN_NUMA_BIND"


@dataclass(frozen=True)
class CpuBudget:
    """The cores the process runs on, the GPU's NUMA node (None: unknown or not bound) and the intra-op
    threads of each stream worker."""

    cores: tuple[int, ...]
    threads: dict[str, int] = field(default_factory=dict)
    numa_node: int | None = None

    def describe(self) -> dict:
        return {"cores": len(self.cores), "numa_node": self.numa_node, "threads": dict(self.threads)}


def parse_cpulist(text: str) -> list[int]:
    """A sysfs CPU list ("0-3,8,10-11") as CPU numbers."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def numa_cores(pci_address: str, sysfs: str | Path = "/sys") -> tuple[int | None, list[int]]:
    """(node, its CPUs) of the PCI device at `pci_address` ("0000:1b:00.0"); (None, []) where sysfs does not
    say (no NUMA, a virtual machine reporting -1, another OS)."""
    root = Path(sysfs)
    try:
        node = int((root / "bus/pci/devices" / pci_address.lower() / "numa_node").read_text().strip())
        if node < 0:
            return None, []
        return node, parse_cpulist((root / f"devices/system/node/node{node}/cpulist").read_text())
    except (OSError, ValueError):
        return None, []


def gpu_pci_address(index: int) -> str | None:
    """The PCI address of CUDA device `index` from torch's device properties, None where torch does not give it."""
    import torch

    props = torch.cuda.get_device_properties(index)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    return f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"


def largest_cache_bytes(sysfs: str | Path = "/sys") -> int | None:
    """The largest cache the first CPU reports (sysfs cpu0/cache/index*/size, e.g. "491520K": its last level),
    None where sysfs does not say: what a timing streams through to leave none of its data in cache."""
    sizes = []
    for f in Path(sysfs, "devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1))
        except (OSError, ValueError):
            continue
    return max(sizes, default=None)


def thread_budget(kind: str, n_cores: int, host_threads: int | None = None) -> dict[str, int]:
    """Intra-op threads per stream worker on `n_cores` cores (on sim: the constructing thread's threads; module
    docstring)."""
    n = max(1, n_cores)
    if kind == "cuda":
        h2d = 2 if n >= 8 else 1
        threads = {"compute": 1, "h2d": h2d, "d2h": 1, "comm": 1, "disk": 1, "host": max(1, n - 3 - h2d)}
    else:
        threads = {"compute": n, "h2d": 1, "d2h": 1, "comm": 1, "disk": 1, "host": max(1, n // 2)}
    if host_threads is not None:
        threads["host"] = host_threads
    return threads


def resolve(kind: str, gpu_index: int | None = None, sysfs: str | Path = "/sys", bind: bool | None = None,
            host_threads: int | None = None, sim_threads: int | None = None) -> CpuBudget:
    """The budget of a device of `kind`; on cuda with `bind` (default: unless MEGATRAIN_NUMA_BIND=0) every
    thread of the process is moved to the GPU's NUMA node's cores (those of them it may use). On sim,
    `sim_threads` replaces the constructing thread's count as the compute worker's (`train --sim-threads`; the
    streamed run then reduces as eager code on that many threads would)."""
    if sim_threads is not None and (not isinstance(sim_threads, int) or sim_threads < 1):
        raise ValueError(f"sim threads must be a positive integer, got {sim_threads!r}")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    node = None
    if bind is None:
        bind = os.environ.get(NUMA_BIND_ENV, "1") != "0"
    if kind == "cuda" and bind and gpu_index is not None:
        address = gpu_pci_address(gpu_index)
        node, local = numa_cores(address, sysfs) if address else (None, [])
        local = [c for c in local if c in cores]
        if local and len(local) < len(cores):
            _bind_process(local)
            cores = local
        elif not local:
            node = None
    if host_threads is None and os.environ.get(HOST_THREADS_ENV):
        text = os.environ[HOST_THREADS_ENV]
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{HOST_THREADS_ENV}={text!r}: expected a positive number of threads")
        host_threads = int(text)
    if kind == "cuda":
        n_threads = len(cores)
    else:
        import torch

        n_threads = sim_threads or torch.get_num_threads()
    return CpuBudget(tuple(cores), thread_budget(kind, n_threads, host_threads), node)


def _bind_process(cores: list[int]) -> None:
    """Move every thread of this process to `cores` (threads started later inherit it from their creator)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that ended meanwhile
            pass
