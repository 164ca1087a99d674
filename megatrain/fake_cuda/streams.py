"""The fake CUDA backend's streams, events and the protocol they enforce (see __init__.py for the whole).

Every op on device memory, and every copy that touches host memory from a stream, is an access by an agent
(a stream, or the host). Work runs when it is issued, so values are the ones the program would see if each
stream ran its ops in issue order; what a real GPU would reorder is checked instead, with vector clocks:

- a stream knows another stream's op once it waited on an event recorded after it (wait_event / wait_stream,
  merged transitively: an event carries its stream's whole clock);
- the host knows a stream's op once it synchronized on an event, stream or device after it; a host op is
  complete when issued, so streams always know the host's past ops (they were issued after them);
- two accesses to overlapping bytes of which one writes must be ordered: the later agent must know the
  earlier access, else `ProtocolError` names both (a read on another stream with no event wait, a host write
  into a pinned buffer a copy may still be reading, a host read of a copy's destination before its event);
- device memory freed (its last Python reference gone) must be known to its allocating stream through every
  other stream that used it, or be handed over with `record_stream`: the caching allocator reuses it on the
  allocating stream at once. A violation there is recorded in `state.violations` (a finalizer cannot raise).

Synchronisations of the host (explicit, and implicit ones such as `.item()` of a device tensor) are recorded
with the program line that made them, so a test can hold a step to the sync points its program names.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field


class ProtocolError(RuntimeError):
    """An access the GPU could reorder: a missing event wait or a buffer reused too early."""


class Agent:
    """A stream or the host: its issue counter and what it knows of the others (name -> last known seq)."""

    def __init__(self, name: str):
        self.name, self.seq, self.clock = name, 0, {}

    def snapshot(self) -> dict[str, int]:
        return {**self.clock, self.name: self.seq}


@dataclass
class _Access:
    lo: int
    hi: int
    agent: Agent
    seq: int
    write: bool


@dataclass
class _Storage:
    device: bool  # fake device memory (counted, checked at free) or tracked host memory
    nbytes: int
    alloc: Agent | None
    accesses: list[_Access] = field(default_factory=list)
    handed: set = field(default_factory=set)  # streams given by record_stream


def caller() -> str:
    """The first frame outside torch and this package: where the program asked for it."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if "/torch/" not in name and "/megatrain/fake_cuda/" not in name and "/contextlib" not in name:
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "?"


class State:
    """Everything the fake backend records; one per install()."""

    def __init__(self, total_memory: int):
        self.lock = threading.RLock()
        self.total_memory = total_memory
        self.host = Agent("host")
        self.done: dict[str, int] = {}  # what the host has synchronized with: complete everywhere
        self.default = Agent("default")
        self._names = itertools.count(1)
        self.tls = threading.local()
        self.storages: dict[int, _Storage] = {}
        self.allocated = self.peak = 0
        self.cap: int | None = None
        self.pinned: dict[int, int] = {}  # page-locked ranges: start -> bytes (cudaHostRegister, pin_memory)
        self.registered_bytes = 0  # through cudaHostRegister, live
        self.pool_pinned_bytes = 0  # through torch's pinned pool (pin_memory=True), live
        self.syncs: list[tuple[str, str]] = []
        self.violations: list[str] = []
        self.allocator_settings: list[str] = []
        self.ops = 0

    # -- agents ----------------------------------------------------------------------------------------------
    def new_stream_agent(self) -> Agent:
        return Agent(f"stream{next(self._names)}")

    def current(self) -> Agent:
        return getattr(self.tls, "stream", None) or self.default

    def knows(self, a: Agent, b: Agent, seq: int) -> bool:
        if a is b or b is self.host:
            return True
        return max(a.clock.get(b.name, 0), self.done.get(b.name, 0)) >= seq

    def merge(self, a: Agent, snapshot: dict[str, int]) -> None:
        with self.lock:
            for k, v in snapshot.items():
                if a.clock.get(k, 0) < v:
                    a.clock[k] = v

    def synchronized(self, snapshot: dict[str, int], kind: str, log: bool = True) -> None:
        """The host waited for everything in `snapshot` (recorded as a synchronisation unless `log` is off)."""
        with self.lock:
            for k, v in snapshot.items():
                if self.done.get(k, 0) < v:
                    self.done[k] = v
            if log:
                self.syncs.append((kind, caller()))

    def implicit_sync(self, what: str) -> None:
        with self.lock:
            self.syncs.append((f"implicit {what}", caller()))

    # -- accesses ----------------------------------------------------------------------------------------------
    def access(self, agent: Agent, reads, writes, label: str) -> None:
        """Check and record an op of `agent`: `reads` and `writes` are (storage, lo, hi) byte ranges."""
        with self.lock:
            agent.seq += 1
            self.ops += 1
            for (ptr, lo, hi), write in [*((r, False) for r in reads), *((w, True) for w in writes)]:
                st = self.storages.get(ptr)
                if st is None:
                    continue
                for a in st.accesses:
                    if a.hi > lo and a.lo < hi and (write or a.write) and not self.knows(agent, a.agent, a.seq):
                        raise ProtocolError(
                            f"{'write' if write else 'read'} of {self._what(st)} bytes [{lo - ptr}, {hi - ptr}) "
                            f"on {agent.name} ({label}, at {caller()}) after a {'write' if a.write else 'read'} "
                            f"of [{a.lo - ptr}, {a.hi - ptr}) on {a.agent.name} (op {a.seq}) that "
                            f"{agent.name} does not know of: wait on an event recorded after it first")
                if write:  # a write that covers older accesses it knows of replaces them
                    st.accesses = [a for a in st.accesses if not (lo <= a.lo and a.hi <= hi)]
                else:
                    st.accesses = [a for a in st.accesses if not (a.agent is agent and not a.write
                                                                  and a.lo == lo and a.hi == hi)]
                st.accesses.append(_Access(lo, hi, agent, agent.seq, write))

    @staticmethod
    def _what(st: _Storage) -> str:
        return "device memory" if st.device else "host memory"

    def track(self, storage, ptr: int, nbytes: int, device: bool) -> None:
        """Start tracking a storage (device memory when it first appears, host memory when a stream first
        touches it); forgotten, and device memory freed, when torch frees it."""
        with self.lock:
            if ptr in self.storages or ptr == 0:
                return
            alloc = self.current() if device else None
            if device:
                if self.cap is not None and self.allocated + nbytes > self.cap:
                    import torch

                    raise torch.cuda.OutOfMemoryError(
                        f"CUDA out of memory (fake): {nbytes:,} bytes with {self.allocated:,} allocated of a "
                        f"{self.cap:,}-byte cap (set_per_process_memory_fraction)")
                self.allocated += nbytes
                self.peak = max(self.peak, self.allocated)
            self.storages[ptr] = _Storage(device, nbytes, alloc)
        weakref.finalize(storage, self._freed, ptr)

    def _freed(self, ptr: int) -> None:
        with self.lock:
            st = self.storages.pop(ptr, None)
            if st is None or not st.device:
                return
            self.allocated -= st.nbytes
            for a in st.accesses:
                if a.agent is not st.alloc and a.agent.name not in st.handed and not self.knows(st.alloc, a.agent,
                                                                                                    a.seq):
                    self.violations.append(
                        f"device memory ({st.nbytes:,} bytes) allocated on {st.alloc.name} was freed while "
                        f"{a.agent.name}'s op {a.seq} on it may still run: {st.alloc.name} never waited for "
                        "it and no record_stream handed it over")
                    break

    def record_stream(self, ptr: int, agent: Agent) -> None:
        with self.lock:
            st = self.storages.get(ptr)
            if st is not None:
                st.handed.add(agent.name)


def _stream_base():
    import torch

    return torch.Stream


class FakeStream(_stream_base()):
    """torch.cuda.Stream's stand-in: an agent of the protocol (a torch.Stream, so torch's argument parsing
    takes it where a stream is due, as in record_stream)."""

    _ids = itertools.count(1)

    def __new__(cls, device=None, priority: int = 0, _agent: Agent | None = None, **_):
        return super().__new__(cls, stream_id=next(cls._ids), device_index=0, device_type=1)  # 1: CUDA

    def __init__(self, device=None, priority: int = 0, _agent: Agent | None = None, **_):

        self._state = state()
        self.agent = _agent or self._state.new_stream_agent()
        self.priority = priority

    def wait_event(self, event: FakeEvent) -> None:
        if event.snapshot is not None:
            self._state.merge(self.agent, event.snapshot)

    def wait_stream(self, stream: FakeStream) -> None:
        self._state.merge(self.agent, stream.agent.snapshot())

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        self._state.synchronized(self.agent.snapshot(), f"stream.synchronize({self.agent.name})")

    def query(self) -> bool:
        return all(self._state.done.get(k, 0) >= v for k, v in self.agent.snapshot().items())

    def __enter__(self):
        self._ctx = stream_context(self)
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)

    def __repr__(self) -> str:
        return f"FakeStream({self.agent.name})"


class FakeEvent:
    """torch.cuda.Event's stand-in: a snapshot of its stream's clock, and a wall time for elapsed_time."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):

        self._state = state()
        self.snapshot: dict[str, int] | None = None
        self.time = None

    def record(self, stream: FakeStream | None = None) -> None:
        agent = stream.agent if stream is not None else self._state.current()
        with self._state.lock:
            self.snapshot = agent.snapshot()
        self.time = time.perf_counter()

    def wait(self, stream: FakeStream | None = None) -> None:
        if self.snapshot is not None:
            self._state.merge(stream.agent if stream is not None else self._state.current(), self.snapshot)

    def synchronize(self) -> None:
        if self.snapshot is not None:
            self._state.synchronized(self.snapshot, "event.synchronize")

    def query(self) -> bool:
        """Whether the host already knows it complete: the fake never says so before a synchronize, so a
        program cannot skip a wait on a query that a real GPU may answer either way."""
        return self.snapshot is None or all(self._state.done.get(k, 0) >= v for k, v in self.snapshot.items())

    def elapsed_time(self, end: FakeEvent) -> float:
        if self.time is None or end.time is None:
            raise RuntimeError("elapsed_time: both events must be recorded first")
        return (end.time - self.time) * 1e3


class stream_context:  # noqa: N801  (torch.cuda.stream's spelling)
    """torch.cuda.stream(s): `s` is the thread's current stream inside."""

    def __init__(self, stream: FakeStream | None):

        self._state, self.stream = state(), stream

    def __enter__(self):
        self._prev = getattr(self._state.tls, "stream", None)
        if self.stream is not None:
            self._state.tls.stream = self.stream.agent
        return self.stream

    def __exit__(self, *exc):
        self._state.tls.stream = self._prev
        return False


current: State | None = None  # the installed backend's state (megatrain.fake_cuda.install sets it)


def state() -> State:
    if current is None:
        raise RuntimeError("the fake CUDA backend is not installed (megatrain.fake_cuda.install())")
    return current
