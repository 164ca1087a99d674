"""Devices that execute stream programs: the Device base and `sim` (CPU threads, for tests and CI); device.py
adds `cuda` (real CUDA streams) and `make_device`.

Where it sits: the bottom of the runtime. The engine (runtime/engine.py) walks a step program and calls
`submit` / `record` / `wait` on a Device; the device runs each stream's work in submission order and orders
the streams only through events, exactly the semantics of ir/README.md. The same program runs on both kinds.
Run its tests: `.venv/bin/pytest tests/runtime/test_device.py` (the CUDA ones: `make test-cuda`).

- Streams: `compute`, `h2d`, `d2h`, `host`, `comm` (collectives, idle on one rank), `disk` (a checkpointing
  step's writes, checkpoint_stream.py). Each has one worker thread with a FIFO queue. On `sim` the worker runs
  the work; on `cuda` the workers of the four GPU streams *issue* work on their torch.cuda.Stream (so a GPU
  stream that waits on a host event blocks only its own issuing; NCCL orders its collectives after the comm
  stream's work), and `host` and `disk` run Python on a thread.
- Events are keyed `(name, step)`. A stream records an event each step; `wait(name, s)` is satisfied once the
  record of step `s` (or a later one: a stream records in step order) has run. Cross-step waits (ir/README.md)
  wait on `step - 1`; a wait on a step before the device's first step is a no-op. The first step is the step
  of the first `record`, or one past the step of the first `wait` when a wait comes first: in a valid program
  a fresh device's first wait can only point at the previous step (a resumed run's step `k` waits on `k - 1`).
- Failures: an exception in a worker marks the device failed; every worker stops running ops (drains its
  queue), blocked waits abort, and `synchronize()` raises DeviceError naming the op (its `__cause__` is the
  original error). A wait that no stream can ever satisfy is reported by `synchronize()` as a deadlock.
- Worker threads have their own torch thread-local state (grad mode, inference mode, current CUDA stream):
  submitted functions set what they need. Each worker sets its intra-op threads from the device's CPU budget
  (cpus.py: on cuda the host optimizer gets the cores the issuing threads do not need, and the process is
  bound to the GPU's NUMA node when one is known) before its first op; `cpu` holds the budget.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable

import torch

from . import cast_kernel
from .cpus import CpuBudget
from .cpus import resolve as resolve_cpus

STREAMS = ("compute", "h2d", "d2h", "host", "comm", "disk")

# Queue items: (kind, payload...). MARK items are processed even after a failure, so synchronize() returns.
_OP, _RECORD, _WAIT, _MARK, _STOP = "op", "record", "wait", "mark", "stop"
_DEADLOCK_CHECK_AFTER_S = 1.0  # synchronize() looks for a deadlock only when it has waited this long


class DeviceOutOfMemory(RuntimeError):
    """A program buffer does not fit the device's byte budget."""

    def __init__(self, buffer: str, nbytes: int, current: int, budget: int):
        super().__init__(
            f"device out of memory: allocating {buffer} ({nbytes} bytes) with {current} of {budget} bytes in "
            "use; raise --gpu-mem or let the planner pick a smaller schedule"
        )
        self.buffer, self.nbytes, self.current, self.budget = buffer, nbytes, current, budget


class DeviceError(RuntimeError):
    """A failure inside a stream worker, re-raised on the caller's thread; `__cause__` is the original error."""

    def __init__(self, message: str, stream: str | None = None, label: str | None = None):
        super().__init__(message)
        self.stream, self.label = stream, label


class _Aborted(Exception):
    """Raised inside a worker to abandon a wait once the device has failed or is closing."""


class MemoryPool:
    """Accounting of program buffers by name against a byte budget (None: unlimited). Thread-safe."""

    def __init__(self, budget_bytes: int | None):
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"device memory budget must be >= 0 bytes, got {budget_bytes}")
        self.budget = budget_bytes
        self.current = 0
        self.peak = 0
        self._live: dict[str, int] = {}
        self._lock = threading.Lock()

    def alloc(self, name: str, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"buffer {name!r}: size must be >= 0 bytes, got {nbytes}")
        with self._lock:
            if name in self._live:
                raise ValueError(f"buffer {name!r} is already allocated ({self._live[name]} bytes); free it first")
            if self.budget is not None and self.current + nbytes > self.budget:
                raise DeviceOutOfMemory(name, nbytes, self.current, self.budget)
            self._live[name] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)

    def free(self, name: str) -> None:
        with self._lock:
            if name not in self._live:
                raise ValueError(f"buffer {name!r} is not allocated; it was never allocated or already freed")
            self.current -= self._live.pop(name)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current

    def live(self) -> dict[str, int]:
        """The live buffers and their sizes, a copy."""
        with self._lock:
            return dict(self._live)

    def __contains__(self, name: str) -> bool:
        return name in self._live


class _EventTable:
    """The latest recorded step of each event name; waiters block until it reaches theirs, or abort.

    Each waiter sleeps on its own threading.Event, woken only by a record of its event (or an abort): one
    shared condition would wake every blocked stream at every record, and their wake-ups compete with the
    compute stream's Python for the interpreter lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._latest: dict[str, int] = {}
        self._waiters: dict[str, list[tuple[int, threading.Event]]] = {}
        self._aborted = False

    def mark(self, name: str, step: int) -> None:
        with self._lock:
            if step > self._latest.get(name, step - 1):
                self._latest[name] = step
            waiters = self._waiters.get(name)
            if waiters:
                latest = self._latest[name]
                for s, ev in waiters:
                    if s <= latest:
                        ev.set()
                self._waiters[name] = [(s, ev) for s, ev in waiters if s > latest]

    def done(self, name: str, step: int) -> bool:
        with self._lock:
            return name in self._latest and self._latest[name] >= step

    def wait_for(self, name: str, step: int) -> None:
        with self._lock:
            if name in self._latest and self._latest[name] >= step:
                return
            if self._aborted:
                raise _Aborted
            ev = threading.Event()
            self._waiters.setdefault(name, []).append((step, ev))
        while not ev.wait(0.5):  # NOTE: mark() and abort() set it; the timeout is only a safety net
            if self.done(name, step):
                return
            if self._aborted:
                raise _Aborted
        if self._aborted and not self.done(name, step):
            raise _Aborted

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            for waiters in self._waiters.values():
                for _, ev in waiters:
                    ev.set()
            self._waiters.clear()


class Device:
    """Base of the sim and cuda devices: stream workers, events, failure handling, the memory pool."""

    kind: str = "base"
    STREAMS = STREAMS

    def __init__(self, budget_bytes: int | None, torch_device: torch.device, cpu: CpuBudget | None = None):
        self.torch_device = torch_device
        self.cpu = cpu if cpu is not None else resolve_cpus(self.kind)
        self.pool = MemoryPool(budget_bytes)
        self._events = _EventTable()
        self._lock = threading.Lock()
        self._failure: tuple[str, str, BaseException] | None = None
        self._closed = False
        self._stopping = threading.Event()  # set on failure or close: workers drain without running ops
        self._first_step: int | None = None
        self._queues: dict[str, queue.SimpleQueue] = {s: queue.SimpleQueue() for s in STREAMS}
        # Deadlock detection: items put (caller) vs finished (worker), and what each worker is blocked on.
        self._put = dict.fromkeys(STREAMS, 0)
        self._finished = dict.fromkeys(STREAMS, 0)
        self._waiting: dict[str, tuple[str, int] | None] = dict.fromkeys(STREAMS)
        self._threads: dict[str, threading.Thread] = {}

    # -- subclass hooks ------------------------------------------------------------------------------------
    def _worker_init(self, stream: str) -> None:
        # NOTE: torch initialises a thread's intra-op count lazily from the process-wide one at its first
        # parallel op, which would undo a set_num_threads made before it: initialise first, then set
        torch.get_num_threads()
        # the disk stream (checkpoint writes: hashing and file I/O) has no budget of its own: one thread
        torch.set_num_threads(self.cpu.threads.get(stream, 1))

    def _before(self, stream: str) -> None: ...

    def _run_op(self, stream: str, fn: Callable[[], None]) -> None:
        fn()

    def _run_record(self, stream: str, event: str, step: int) -> None:
        self._events.mark(event, step)

    def _run_wait(self, stream: str, event: str, step: int) -> None:
        self._events.wait_for(event, step)

    def _device_synchronize(self, stream: str | None) -> None: ...

    # -- the public interface --------------------------------------------------------------------------------
    @property
    def first_step(self) -> int | None:
        """The first step this device ran (inferred from the first record/wait), None before any."""
        return self._first_step

    @property
    def failed(self) -> bool:
        return self._failure is not None

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, stream: str, fn: Callable[[], None], label: str) -> None:
        """Enqueue `fn` on `stream`; returns immediately. `label` names the op in errors."""
        self._check_stream(stream)
        if not callable(fn):
            raise TypeError(f"submit({stream!r}, ..., {label!r}): fn must be callable, got {type(fn).__name__}")
        self._put_item(stream, (_OP, fn, None, label))

    def record(self, stream: str, event: str, step: int) -> None:
        """Enqueue: mark `(event, step)` done when `stream` reaches this point."""
        self._check_stream(stream)
        with self._lock:
            if self._first_step is None:
                self._first_step = step
        self._put_item(stream, (_RECORD, event, step, f"record({event}, step={step})"))

    def wait(self, stream: str, event: str, step: int) -> None:
        """Enqueue: `stream` blocks until `(event, step)` is recorded. No-op before the device's first step."""
        self._check_stream(stream)
        with self._lock:
            if self._first_step is None:
                self._first_step = step + 1  # the first wait of a fresh device is a cross-step wait
            if step < 0 or step < self._first_step:
                return
        self._put_item(stream, (_WAIT, event, step, f"wait({event}, step={step})"))

    def synchronize(self, stream: str | None = None) -> None:
        """Block until all work submitted so far (on `stream`, or on all) is done; raise the first failure."""
        if threading.current_thread() in self._threads.values():
            raise RuntimeError("synchronize() called from inside a stream worker; it would wait on itself")
        streams = STREAMS if stream is None else (self._check_stream(stream),)
        if self._closed:
            self._raise_if_failed()
            raise DeviceError(f"{self.kind} device is closed")
        # NOTE: even after a failure, wait for the marks: the drain finishes ops in flight, so the caller
        # sees DeviceError only once no worker touches its tensors any more.
        marks = []
        for s in streams:
            mark = threading.Event()
            self._put_item(s, (_MARK, mark, None, "synchronize"), check=False)
            marks.append((s, mark))
        start = time.monotonic()
        for s, mark in marks:
            while not mark.wait(0.05):
                if not self._threads[s].is_alive():
                    break  # closed concurrently
                if time.monotonic() - start > _DEADLOCK_CHECK_AFTER_S:
                    self._check_deadlock()
        if self._failure is not None:
            self._drain_device()  # NOTE: kernels already queued must finish before anyone frees their buffers
        self._raise_if_failed()
        try:
            self._device_synchronize(stream)
        except Exception as exc:
            self._fail(stream or "all", f"{self.kind} synchronize", exc)
            self._raise_if_failed()

    def _drain_device(self) -> None:
        """Wait for the work already issued to the hardware, whatever failed (best effort: a broken device may
        not answer, and the original failure is what is reported)."""
        try:
            self._device_synchronize(None)
        except Exception:  # noqa: BLE001  (the failure being reported is the first one)
            pass

    def empty(self, shape, dtype) -> torch.Tensor:
        """An uninitialised tensor on the device (not counted in the pool: the engine accounts by buffer)."""
        return torch.empty(shape, dtype=dtype, device=self.torch_device)

    def host_empty(self, shape, dtype) -> torch.Tensor:
        """An uninitialised host tensor (pinned on cuda, at its exact size). The host store allocates its own
        buffers in one arena (store.py, host_memory.py); this is for odd host tensors."""
        return torch.empty(shape, dtype=dtype)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst.copy_(src), asynchronous on cuda. Call it from inside a submitted fn."""
        dst.copy_(src)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of a small device tensor (routing statistics), from inside a submitted fn: the tensor
        itself on sim; on cuda a non-blocking copy into pinned memory on the current stream, readable once a
        later record of this stream has been waited for."""
        return t.to("cpu")

    def stage_copy(self, dst: torch.Tensor, src: torch.Tensor, stage: torch.Tensor) -> None:
        """dst.copy_(src) through `stage`, a pinned host buffer of dst's dtype: `src` (host, another dtype) is
        cast into it on this thread, then copied. On cuda the cast first waits for the previous copy out of
        `stage`, so with two staging buffers a cast overlaps the transfer before it. The cast is the C one
        (cast_kernel.py: torch's bits, on this worker's intra-op threads)."""
        cast_kernel.cast(src, stage)
        self.copy(dst, stage)

    def measured_peak_bytes(self) -> int:
        return self.pool.peak

    def memory_report(self) -> dict[str, int]:
        """Measured device memory since the last reset_peak(), each figure beside the plan figure it compares
        with (trainer.py `planned_memory`): `peak_device_bytes`, tensors allocated (sim: the pool's program
        buffers, exact); `peak_reserved_bytes`, what the allocator held (sim: the same); on cuda also
        `device_used_bytes`, the whole GPU's use now from cudaMemGetInfo (context, library workspaces and
        other processes included) and `device_total_bytes`."""
        return {"peak_device_bytes": self.pool.peak, "peak_reserved_bytes": self.pool.peak}

    def limit_allocator(self, nbytes: int) -> None:
        """Enforce `nbytes` on the process's device allocations (on sim the pool's budget does already)."""

    def reset_peak(self) -> None:
        """Start a new peak measurement (pool and, on cuda, torch's allocator statistics)."""
        self.pool.reset_peak()

    def close(self) -> None:
        """Stop the workers (idempotent). Work not yet run is discarded: synchronize() first to finish it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stopping.set()
        self._events.abort()
        for s in STREAMS:
            self._queues[s].put((_STOP, None, None, "close"))
        for thread in self._threads.values():
            if thread is not threading.current_thread():
                thread.join()
        self._drain_device()  # the workers issued their last ops: wait for the hardware to finish them too

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "failed" if self.failed else "closed" if self._closed else "running"
        return f"{type(self).__name__}({self.torch_device}, budget={self.pool.budget}, {state})"

    # -- internals ---------------------------------------------------------------------------------------------
    def _check_stream(self, stream: str) -> str:
        if stream not in STREAMS:
            raise ValueError(f"unknown stream {stream!r}; streams are {', '.join(STREAMS)}")
        return stream

    def _put_item(self, stream: str, item: tuple, check: bool = True) -> None:
        if check:
            self._raise_if_failed()
            if self._closed:
                raise DeviceError(f"{self.kind} device is closed; cannot run {item[3]!r} on {stream}")
        with self._lock:
            self._put[stream] += 1
            self._queues[stream].put(item)

    def _start_workers(self) -> None:
        # NOTE: a worker's set_num_threads also sets the process-wide count that threads initialise from
        # lazily; wait for every worker to set its own, then restore this thread's (and so the process's)
        own = torch.get_num_threads()
        self._started = {s: threading.Event() for s in STREAMS}
        for s in STREAMS:
            thread = threading.Thread(target=self._loop, args=(s,), name=f"megatrain-{self.kind}-{s}", daemon=True)
            self._threads[s] = thread
            thread.start()
        for s in STREAMS:
            self._started[s].wait()
        torch.set_num_threads(own)

    def _loop(self, stream: str) -> None:
        q = self._queues[stream]
        try:
            self._worker_init(stream)
        except BaseException as exc:
            self._fail(stream, f"start of the {stream} worker", exc)
        finally:
            self._started[stream].set()
        while True:
            kind, a, b, label = q.get()
            if kind == _STOP:
                return
            try:
                if kind == _MARK:
                    a.set()
                elif self._stopping.is_set():
                    pass  # drain after a failure or close
                elif kind == _OP:
                    self._before(stream)
                    self._run_op(stream, a)
                elif kind == _RECORD:
                    self._before(stream)
                    self._run_record(stream, a, b)
                else:
                    self._before(stream)
                    self._waiting[stream] = (a, b)
                    try:
                        self._run_wait(stream, a, b)
                    finally:
                        self._waiting[stream] = None
            except _Aborted:
                pass
            except BaseException as exc:
                self._fail(stream, label, exc)
            finally:
                self._finished[stream] += 1

    def _fail(self, stream: str, label: str, exc: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = (stream, label, exc)
        self._stopping.set()
        self._events.abort()

    def _raise_if_failed(self) -> None:
        failure = self._failure
        if failure is None:
            return
        stream, label, exc = failure
        raise DeviceError(
            f"{self.kind} device: {stream} stream failed at {label}: {type(exc).__name__}: {exc}", stream, label
        ) from exc

    def _check_deadlock(self) -> None:
        """Fail the device if every stream is idle or blocked on an event that no running stream can record.

        Exact when only the caller submits (it is inside synchronize): idle streams have nothing left to
        record, and blocked ones record nothing until released. Two snapshots rule out a worker in motion.
        """
        first = self._deadlock_snapshot()
        if first is None:
            return
        time.sleep(0.05)
        if self._deadlock_snapshot() != first:
            return
        blocked, _ = first
        stream, (event, step) = blocked[0]
        waits = ", ".join(f"{s} waits for ({e}, step {n})" for s, (e, n) in blocked)
        message = (f"deadlock: {waits}, and no stream will record it (the others are idle or waiting); "
                   "the program is missing a record or its waits are out of order")
        self._fail(stream, f"wait({event}, step={step})", RuntimeError(message))

    def _deadlock_snapshot(self):
        blocked = []
        for s in STREAMS:
            waiting = self._waiting[s]
            if waiting is not None and not self._events.done(*waiting):
                blocked.append((s, waiting))
            elif self._finished[s] != self._put[s] or not self._threads[s].is_alive():
                return None  # running, has queued work, or stopped: not a deadlock we can name
        if not blocked:
            return None
        return tuple(blocked), tuple(self._finished.values())


class SimDevice(Device):
    """CPU tensors, one worker thread per stream, a hard byte budget, optional random delays per op.

    `delays=(lo, hi)` sleeps a uniform random time in seconds before each queued op, record and wait, drawn
    from a generator per stream seeded from `seed`, so a missing wait shows up as a wrong result in tests.
    `cpu`: the intra-op threads of each stream worker (cpus.py; default `cpus.resolve("sim")`).
    """

    kind = "sim"

    def __init__(self, budget_bytes: int | None = None, delays: tuple[float, float] | None = None, seed: int = 0,
                 cpu: CpuBudget | None = None):
        if delays is not None:
            lo, hi = delays
            if not 0 <= lo <= hi:
                raise ValueError(f"delays must be (lo, hi) seconds with 0 <= lo <= hi, got {delays}")
        super().__init__(budget_bytes, torch.device("cpu"), cpu)
        self._delays = delays
        self._rngs = {s: random.Random(f"{seed}:{s}") for s in STREAMS}
        self._start_workers()

    def _before(self, stream: str) -> None:
        if self._delays is not None:
            time.sleep(self._rngs[stream].uniform(*self._delays))
