"""Creating the host store's memory: every page touched first on several threads, and nothing zero-filled that
is written next.

Where it sits: HostStore.__init__ (store.py) calls `prepare` on the buffers HostArena.allocate returned, before
the units' views are made and the initial weights drawn; HostArena.allocate (host_memory.py) calls `touch_all`
on a pinned region before cudaHostRegister; load_state and the sharded store's initialisation `copy` large
tensors with it. The planner predicts what this costs (planner/creation.py) and the Trainer reports it
measured beside the prediction as the time to the first step.

Why: the memory of a fresh allocation is not there until it is first written; the first write of each page
faults, and the kernel (on a VM also the hypervisor) finds and zeroes a page for it. That, not the write, is
the cost of creating a store, and on one thread it is slow (docs/RESULTS.md "Store creation (time to first
step)"). So:
- a buffer whose zero is its real initial value (AdamW's moments and step counts, fp8 scales, routing buffers,
  gradient norms; the gradient buffers of a store without a program) is zero-filled in chunks on a pool of
  threads;
- a buffer that something writes before anything reads it (the fp32 masters, which the initial weights, a
  checkpoint or a model folder overwrite; the gradient ring, staging and checkpoint buffers, which the step
  overwrites) is only touched: one byte per page, on the same pool, so the writes that follow find their pages
  present. A master's padding between parameters, which nothing writes, is zeroed so it never holds garbage.
- the pool is at most MAX_THREADS threads of the cores this process may run on (on cuda, after the device
  bound it to the GPU's NUMA node: the node's cores, so the first touch places the pages beside the GPU),
  each with one intra-op thread: a chunk per thread, not a thread team per chunk. First touch is bound by the
  DRAM's write bandwidth and the kernel's page-fault path, which a few threads saturate.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from megatrain.ir.model_ir import UnitIR

PAGE = 4096
CHUNK_BYTES = 64 << 20  # a unit of work: large enough that the pool's overhead vanishes, small enough to balance
MAX_THREADS = 16
ZERO_INITIAL = ("exp_avg.", "exp_avg_sq.", "scales.", "steps.", "buffers.", "norms")  # store.py's buffer names


def creation_threads() -> int:
    """The threads creation uses: the cores this process may run on (its CPU budget), at most MAX_THREADS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


def zero_chunk(chunk: torch.Tensor) -> None:
    chunk.zero_()


def touch_chunk(chunk: torch.Tensor) -> None:
    """Fault in every page `chunk` spans, writing one byte of each (its own bytes: a neighbour sharing a page
    is left as it is)."""
    raw = chunk.view(torch.uint8)
    raw[::PAGE].fill_(0)
    raw[-1:].fill_(0)


def _chunks(t: torch.Tensor) -> list[torch.Tensor]:
    step = max(1, CHUNK_BYTES // t.element_size())
    return [t[a : a + step] for a in range(0, t.numel(), step)]


def _one_thread() -> None:
    # NOTE: torch initialises a thread's intra-op count lazily at its first parallel op: initialise, then set
    torch.get_num_threads()
    torch.set_num_threads(1)


def run(jobs: Iterable[tuple[Callable[[torch.Tensor], object], torch.Tensor]], threads: int | None = None) -> None:
    """Apply each (fn, flat tensor) job chunk by chunk on `threads` threads (default: creation_threads()); inline
    when there is one thread or less than two chunks of work."""
    work = [(fn, c) for fn, t in jobs if t.numel() for c in _chunks(t)]
    threads = creation_threads() if threads is None else threads
    if threads <= 1 or sum(c.numel() * c.element_size() for _, c in work) < 2 * CHUNK_BYTES:
        for fn, c in work:
            fn(c)
        return
    work.sort(key=lambda job: -job[1].numel() * job[1].element_size())  # the largest first: threads end together
    # NOTE: a worker's set_num_threads also sets the process-wide count threads initialise from; restore ours
    own = torch.get_num_threads()
    try:
        with ThreadPoolExecutor(min(threads, len(work)), thread_name_prefix="host-init",
                                initializer=_one_thread) as pool:
            for f in [pool.submit(fn, c) for fn, c in work]:
                f.result()
    finally:
        torch.set_num_threads(own)


def padding(flat_numel: int, params) -> list[tuple[int, int]]:
    """The [start, end) element ranges of a master of `flat_numel` elements that no parameter covers."""
    out, at = [], 0
    for p in sorted(params, key=lambda p: p.offset):
        if p.offset > at:
            out.append((at, p.offset))
        at = max(at, p.offset + p.numel)
    if at < flat_numel:
        out.append((at, flat_numel))
    return out


def prepare(bufs: dict[str, torch.Tensor], units: Iterable[UnitIR], zero_grads: bool,
            threads: int | None = None) -> None:
    """Make every page of a new store's buffers present, with the store's initial values where they are zero
    (the module docstring): `zero_grads` for a store whose gradient buffers are its units' own gradients."""
    by_name = {u.name: u for u in units}
    jobs = []
    for name, t in bufs.items():
        flat = t.reshape(-1)
        if name.startswith("master."):
            jobs.append((touch_chunk, flat))
            u = by_name[name.removeprefix("master.")]
            jobs += [(zero_chunk, flat[a:b]) for a, b in padding(flat.numel(), u.host_params())]
        elif name.startswith(ZERO_INITIAL) or (zero_grads and name.startswith("hgrad")):
            jobs.append((zero_chunk, flat))
        else:
            jobs.append((touch_chunk, flat))
    run(jobs, threads)


def touch_all(t: torch.Tensor, threads: int | None = None) -> None:
    """Fault in every page of `t` (contiguous) on the creation pool, values left as they are."""
    run([(touch_chunk, t.reshape(-1))], threads)


def copy(dst: torch.Tensor, src: torch.Tensor, threads: int | None = None) -> None:
    """dst.copy_(src) for contiguous tensors of one numel, chunk by chunk on the creation pool: the same values
    (a copy or a cast is elementwise)."""
    if not (dst.is_contiguous() and src.is_contiguous()) or dst.numel() != src.numel():
        dst.copy_(src)  # broadcasting or strided: torch's own copy
        return
    d, s = dst.view(-1), src.view(-1)
    step = max(1, CHUNK_BYTES // d.element_size())
    run([(lambda c, a=a: c.copy_(s[a : a + c.numel()]), d[a : a + step]) for a in range(0, d.numel(), step)],
        threads)
