"""The unit probe: every op a plan runs, measured through the engine's own code on the device that runs it.

Where it sits: `megatrain probe --model M ...` (cli/plan.py) calls `probe_hardware`, which adds a measured
UnitProfile (planner/profile.py) to a Hardware profile and caches it; `Trainer(hardware="auto")` looks the
cached one up (`cached_hardware`). The cost model (planner/costs.py) then prices each op from it. Try it:
`megatrain probe --device cpu --model tiny --seq-len 64 --micro-batch 2 --dtype fp32`.

How: for each distinct unit template of the traced model (its first unit stands for the rest), a
`ProbeEngine` (the runtime's Engine with its instruction methods, over a host store of just that unit) runs
on a fresh device of the target kind, so the sim device's stream workers compute with the thread settings a
run gets. Each op runs alone (synchronized before and after) and is timed by the engine's own timeline (wall
time inside the worker on sim, CUDA events on GPU streams); every template's ops are repeated in interleaved
rounds and the median kept, so a burst of load on a shared machine moves one sample, not one template. What
a lone op cannot show is measured apart: the cost of one more instruction on a stream, the wake-up of a
stream that waited on another's event, and the gap from a step's compute end to the next step's start.
NOTE: the values in the weights and data are random: op times do not depend on them, except an MoE block's
(the expert loads follow the routing), which is measured as random tokens route.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import threading
import time

import torch

from megatrain.files import check_cache_writable
from megatrain.ir.model_ir import ModelIR, UnitIR
from megatrain.ir.program import Program
from megatrain.ir.trace import DTYPES
from megatrain.models import packing, routing, run_unit
from megatrain.planner.cast import device_stage_elems
from megatrain.planner.hardware import Hardware
from megatrain.planner.host_policy import resolve
from megatrain.planner.profile import UnitProfile, UnitTimes, config_sha, profile_key
from megatrain.planner.profile_cache import cache_dir, read_cached, write_cached
from megatrain.planner.train import TrainSpec

from .cpus import resolve as resolve_cpus
from .device import make_device
from .engine import Engine
from .store import HostStore
from .stream_device import Device

# NOTE: rounds dropped before the timed ones: a process's first rounds pay allocator growth, lazy inits and cold
# caches, and with one dropped round consecutive probes of a model disagreed per op (docs/RESULTS.md, issue 20)
WARMUP_ROUNDS = 3
NEXT = "probe-next"  # the name of the (absent) unit after the one probed: its carry-in is the forward's output
# NOTE: a run that keeps graphs makes them one after another, each in memory no recent op touched, and reads
# them back in reverse. Timed alone, with each graph freed before the next forward reuses its memory (warm in
# cache), a forward ran faster than it does in a run keeping many graphs on the 2-core test VM. So on the sim
# device the kept-graph forward and backward are timed as a pass: PASS_BYTES of the unit's graphs (at least
# one, at most PASS_MAX) made in a row, then their backwards in reverse. A GPU's memory is the plan's budget and
# its kernels are not slowed that way: one graph there.
PASS_BYTES = 64 << 20
PASS_MAX = 16
# NOTE: one op beside a busy stream varies widely between samples on a small machine; with few rounds,
# consecutive probes of one process disagreed on the compute stream's factor beside h2d, and the planner
# stretched whole steps by whichever it got.
CONTENTION_ROUNDS = 15
SPREAD_OPS = ("forward_s", "backward_s", "recompute_backward_s", "load_s", "store_s")  # and each optimizer step
SPREAD_WARN = 0.25  # rounds this far apart (interquartile range over median): the machine was busy


def worst_spread(samples: dict[str, dict[str, list[float]]]) -> dict[str, float]:
    """{'template op': spread} of the op whose rounds disagree most (interquartile range over median), among
    each template's main ops; empty with fewer than four rounds, where quartiles say nothing."""
    worst: tuple[float, str] | None = None
    for template, got in samples.items():
        for op, xs in got.items():
            if len(xs) < 4 or not (op in SPREAD_OPS or op.startswith("opt:")) or statistics.median(xs) <= 0:
                continue
            q1, _, q3 = statistics.quantiles(xs, n=4)
            spread = (q3 - q1) / statistics.median(xs)
            if worst is None or spread > worst[0]:
                worst = (spread, f"{template} {op}")
    return {worst[1]: round(worst[0], 4)} if worst else {}


def device_name(kind: str) -> str:
    """The processor a profile is measured on: the GPU's name, or the CPU model and core count."""
    if kind == "cuda":
        return torch.cuda.get_device_name()
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    import os

    return f"{model} x{os.cpu_count()}"


def probe_threads(kind: str, sim_threads: int | None = None) -> dict[str, int]:
    """The intra-op threads per stream worker a `kind` device of this process would get (cpus.py), which a
    sim profile is specific to; {} on cuda, whose workers only issue GPU work."""
    return dict(resolve_cpus("sim", sim_threads=sim_threads).threads) if kind == "sim" else {}


def device_threads(device: Device) -> dict[str, int]:
    """What a profile of `device` is keyed by (probe_threads of a device that exists)."""
    return dict(device.cpu.threads) if device.kind == "sim" else {}


def key_for(ir: ModelIR, kind: str, threads: dict[str, int], loss_chunk: int = 1024, compiled: bool = False) -> str:
    """The profile key of `ir` run on a `kind` device ("sim" or "cuda") of this machine."""
    return profile_key(device=kind, device_name=device_name(kind), torch=torch.__version__,
                       config_sha=config_sha(ir.config), micro_batch=ir.micro_batch, seq_len=ir.seq_len,
                       dtype=ir.dtype, packed=ir.packed, loss_chunk=loss_chunk,
                       threads=threads if kind == "sim" else {}, compiled=compiled)


def cached_hardware(ir: ModelIR, kind: str, threads: dict[str, int], loss_chunk: int = 1024,
                    compiled: bool = False) -> Hardware | None:
    """The cached probe of `ir` on this machine's `kind` device, or None (none cached, or a corrupt entry)."""
    return read_cached(key_for(ir, kind, threads, loss_chunk, compiled))


class ProbeEngine(Engine):
    """An Engine over one unit: a slot, a gradient slot, a micro-batch, the unit's carry-in and the gradient of
    its carry-out, and a host store holding that unit (and the owner of any parameter it ties)."""

    def __init__(self, ir: ModelIR, unit: UnitIR, device: Device, policy: str, train: TrainSpec, loss_chunk: int):
        owners = {ref.split(".")[0] for ref in unit.tied.values()}
        units = tuple(u for u in ir.units if u.name == unit.name or u.name in owners)
        small = ir.replace(units=units, edges=())
        program = Program(n_micro_batches=1, buffers=(), instrs=())  # the probe submits the ops itself
        store = HostStore(small, train, policy=policy, device=device.kind)  # each unit its own gradient buffer
        store.check_finite = True  # as the Trainer runs it
        store.program = program  # NOTE: only for Engine's check; unbound again below (no program assigns buffers)
        super().__init__(small, program, device, store, loss_chunk)  # its static buffers: the RoPE tables
        store.program = None
        self.next_unit = {unit.name: NEXT}
        self.lr, self.n_tokens = 1e-4, ir.micro_batch * ir.seq_len
        self.losses = [torch.zeros((), dtype=torch.float32)]
        self.unit = unit
        dev, gen = device.torch_device, torch.Generator().manual_seed(0)
        self.bufs["slot0"] = device.empty((-(-unit.slot_bytes(ir.dtype) // self.dtype.itemsize),), self.dtype)
        self.bufs["grad0"] = device.empty((unit.flat_numel + len(unit.params),), torch.float32)
        shape = (ir.micro_batch, ir.seq_len)
        tokens = torch.randint(0, self.config.vocab_size, shape, generator=gen)
        packed = packing(torch.arange(ir.seq_len).expand(shape).contiguous(), dev) if ir.packed else {}
        self.bufs["batch"] = [(tokens.to(dev), torch.randint(0, self.config.vocab_size, shape, generator=gen).to(dev),
                               packed)]
        self.carry = tuple(self._random(s.shape, s.dtype, gen) for s in unit.carry_in)
        self.bufs[f"dcarry.{NEXT}.0"] = tuple(self._random(s.shape, s.dtype, gen) * 1e-3 for s in unit.carry_out)
        self.host_carry = tuple(device.host_empty(s.shape, DTYPES[s.dtype]) for s in unit.carry_in)
        self.store.host_act = lambda name: self.host_carry  # NOTE: offload_act/load_act of the probe's checkpoint
        self.load_params(0, unit.name, 0)  # real weights in the slot (the store's random init)
        device.synchronize()
        self.graphs = 1 if device.kind != "sim" or not unit.saved_bytes else min(
            PASS_MAX, -(-PASS_BYTES // unit.saved_bytes))
        self.held: list[tuple[str, object]] = []  # graphs set aside: (pool name, value)
        self.cast_stores: dict[str, HostStore] = {}  # probe_units: the unit at the other places of the cast
        self.dev_states: dict = {}  # probe_units: the unit's state on the device per host policy

    def hold(self) -> None:
        """Set the unit's kept graph aside (alive, counted in the pool) for the next forward to make another."""
        def run():
            held = f"probe.held.{self.unit.name}.{len(self.held)}"
            self._rename(f"saved.{self.unit.name}.0", held)
            self.held.append((held, self.bufs.pop(f"saved.{self.unit.name}.0")))

        self.device.submit("compute", run, "probe hold")

    def unhold(self) -> None:
        """The graph held last is the unit's kept graph again, for the next backward."""
        def run():
            held, value = self.held.pop()
            self._rename(held, f"saved.{self.unit.name}.0")
            self.bufs[f"saved.{self.unit.name}.0"] = value

        self.device.submit("compute", run, "probe unhold")

    def _rename(self, old: str, new: str) -> None:
        """The pool's count of buffer `old` under the name `new`."""
        nbytes = self.device.pool.live()[old]
        self.device.pool.free(old)
        self.device.pool.alloc(new, nbytes)

    def _random(self, shape, dtype: str, gen) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(DTYPES[dtype]).to(self.device.torch_device)

    def put_carry(self) -> None:
        if self.carry:
            name = f"carry.{self.unit.name}.0"
            if name not in self.bufs:
                self.device.submit("compute", lambda: self._put(name, self.carry, sum(t.nbytes for t in self.carry)),
                                   "probe carry")


def _ops(e: ProbeEngine, policies: list[str], clip: bool) -> list[tuple[str, object]]:
    """(what, submit) of one round of a unit's ops, in an order that leaves the buffers as it found them;
    'free', 'hold' and 'unhold' ops are timed too but not reported."""
    u, name, carry = e.unit, e.unit.name, bool(e.unit.carry_in)
    cin, nxt, dc = f"carry.{name}.0", f"carry.{NEXT}.0", f"dcarry.{name}.0"
    out_carry = u.kind != "head"

    def free(*names):
        return [("free", lambda n=n: e.free(0, n)) for n in names]

    ops = [("forward_s", lambda: e.forward(0, name, 0, 0)), *free(*([nxt] if out_carry else [])),
           ("forward_warm_s", lambda: e.forward(0, name, 0, 0)), *free(*([nxt] if out_carry else [])),
           *[op for k in range(e.graphs) for op in (
               ("forward_graph_s", lambda: e.forward(0, name, 0, 0, mode="keep")),
               *free(*([nxt] if out_carry else [])), *([("hold", e.hold)] if k < e.graphs - 1 else []))],
           *[op for k in range(e.graphs) for op in (
               *([("unhold", e.unhold)] if k else []), ("backward_s", lambda: e.backward(0, name, 0, 0, 0, source="saved")),
               *free(f"saved.{name}.0", *([dc] if u.kind != "embed" else [])))],
           ("recompute_backward_s", lambda: e.backward(0, name, 0, 0, 0)),
           *free(*([dc] if u.kind != "embed" else [])),
           ("recompute_backward_warm_s", lambda: e.backward(0, name, 0, 0, 0)),
           *free(*([dc] if u.kind != "embed" else [])),
           ("norm_backward", lambda: e.backward(0, name, 0, 0, 0, norm=True)),
           *free(*([dc] if u.kind != "embed" else []))]
    if u.replay and carry:  # a forward keeping its attention record, and the backward replaying it
        ops += [("forward_replay_s", lambda: e.forward(0, name, 0, 0, mode="replay")), *free(nxt),
                ("replay_backward_s", lambda: e.backward(0, name, 0, 0, 0, source="replay")),
                *free(dc, f"attn.{name}.0")]
    if getattr(e.templates[u.template], "can_rebuild", False) and carry and out_carry:
        ops += [("forward_rebuild_s", lambda: e.forward(0, name, 0, 0, mode="rebuild")), *free(cin),
                ("rebuild_backward_s", lambda: e.backward(0, name, 0, 0, 0, source="rebuild")),
                *free(f"side.{name}.0", dc, nxt)]  # the rebuilt carry-in stays for the next round
    ops += [("load_s", lambda: e.load_params(0, name, 0)),
            ("store_s", lambda: e.store_grads(0, name, 0, e.store.units[name].grad_buffer))]
    slot = e.bufs["slot0"][: u.flat_numel]
    for where, st in e.cast_stores.items():  # the load from each other place of the compute-dtype cast
        ops.append((f"load:{where}", lambda st=st: st.load_params(name, slot, e.device)))
    if carry:
        ops += [("offload_s", lambda: e.offload_act(0, cin)), ("reload_s", lambda: e.load_act(0, cin))]
    for pol in policies:
        st = e.stores[pol].units[name]
        ops.append((f"opt:{pol}", lambda s=e.stores[pol], st=st: s.step_unit(name, e.lr, e.step_index, st.grad_buffer)))
        if clip:
            ops.append((f"optclip:{pol}", lambda s=e.stores[pol], st=st: _clipped_step(s, name, e, st)))
    for pol in e.dev_states:  # as a device-resident unit: its step on the compute stream, its norms to the host
        ops += [(f"dstep:{pol}", lambda pol=pol: _device_step(e, pol, False))] + \
            ([(f"dstepclip:{pol}", lambda pol=pol: _device_step(e, pol, True))] if clip else [])
    return ops + ([("store_norms_s", lambda: e.store_norms(0, name, 0))] if e.dev_states else [])


def _device_states(e: ProbeEngine, policies: list[str]) -> dict:
    """The probed unit's `dstate` as a device unit's (slot0 its slot) under exact, the one policy a device step
    runs (host_adamw.device_adamw); none for a unit that may not reside."""
    from megatrain.planner.residency import can_reside, device_state_bytes

    from .resident import DeviceState
    if "exact" not in policies or can_reside(e.ir, [u.name for u in e.ir.units].index(e.unit.name)) is not None:
        return {}
    own, e.store = e.store, e.stores["exact"]
    try:
        ds = DeviceState(e, e.unit.name, 0, device_state_bytes(e.unit, "exact", e.ir.dtype))
        pairs = ds.pairs(e.store)  # its state from the store's, as the engine's upload_resident
    finally:
        e.store = own
    e.device.submit("compute", lambda: [e.device.copy(d, h) for d, h in pairs], "probe upload")
    e.device.synchronize()
    return {"exact": ds}


def _device_step(e: ProbeEngine, pol: str, clip: bool) -> None:
    """device_step of the probed unit under `pol`, through the engine's own step (clip: a clip factor < 1)."""
    store, own = e.stores[pol], (e.store, e._clips, e.dstate)
    e.store, e._clips, e.dstate = store, clip, {e.unit.name: e.dev_states[pol]}
    store.clip_coef = torch.tensor(0.5) if clip else None
    try:
        e.device_step(0, e.unit.name, 0, 0)
        e.device.synchronize()
    finally:
        e.store, e._clips, e.dstate = own
        store.clip_coef = None


def _cast_stores(e: ProbeEngine, device: Device, train: TrainSpec, policy: str) -> dict[str, HostStore]:
    """bf16: a store of the probed unit for each place of the compute-dtype cast besides the host (planner/cast.py),
    its buffers as a run at that place holds them (pinned masters for gpu, the bf16 copy for copy), the gpu
    one's device staging buffer bound; {} for fp32, which casts nothing."""
    if e.ir.dtype == "float32":
        return {}
    out = {}
    for where in ("gpu", "copy"):
        program = Program(n_micro_batches=1, buffers=(), instrs=(), cast=where)
        out[where] = HostStore(e.ir, train, policy=policy, device=device.kind, program=program)
        if where == "gpu":
            out[where].feed.bind(device.empty((device_stage_elems(e.ir),), torch.float32))
    return out


def _clipped_step(store: HostStore, name: str, e: ProbeEngine, st) -> None:
    """A clipping step's optimizer_step: the barrier checked the step, a clip factor < 1 scales the gradient."""
    store.clip_coef, store._barrier_step = torch.tensor(0.5), e.step_index
    try:
        store.step_unit(name, e.lr, e.step_index, st.grad_buffer)
    finally:
        store.clip_coef, store._barrier_step = None, None


def _run_op(e: ProbeEngine, what: str, submit) -> None:
    if what.startswith("opt"):  # the host stream runs the store's step, as optimizer_step does
        e.device.submit("host", e._timed("host", what, submit), what)
    elif what.startswith("load:"):  # the h2d stream runs that place's store's load, as load_params does
        e.device.submit("h2d", e._timed("h2d", what, submit), what)
    else:
        submit()
    e.device.synchronize()


def _measure_device(device: Device, n: int = 200) -> tuple[float, float]:
    """(seconds one trivial instruction costs a stream, extra seconds a cross-stream wait that blocks costs)."""
    device.synchronize()
    best = []
    for _ in range(3):
        t = time.perf_counter()
        for i in range(n):
            device.record("compute", f"probe.d{i}", 10**6)
        device.synchronize()
        best.append((time.perf_counter() - t) / n)
    dispatch = statistics.median(best)
    rounds = []
    for r in range(3):
        t = time.perf_counter()
        for i in range(n // 4):
            step = 10**6 + r * n + i
            device.record("compute", "probe.ping", step)
            device.wait("h2d", "probe.ping", step)
            device.record("h2d", "probe.pong", step)
            device.wait("compute", "probe.pong", step)
        device.synchronize()
        rounds.append((time.perf_counter() - t) / (n // 4))
    # a round trip is 4 instructions and 2 blocking wake-ups
    latency = max(0.0, (statistics.median(rounds) - 4 * dispatch) / 2)
    return dispatch, latency


def _contention(e: ProbeEngine, policy: str, repeats: int) -> dict[str, dict[str, float]]:
    """f[s][t]: how much slower an op of stream s runs while stream t is busy than alone (at least 1): the
    median over CONTENTION_ROUNDS rounds (at least `repeats`) of the ratio of the op's time beside the busy
    stream to its time alone in the same round. The ops: the unit's forward (compute), its load (h2d), its
    gradient store (d2h) and its optimizer step (host); the busy stream loops the same kind of work on its own
    buffers."""
    u, name, dev = e.unit, e.unit.name, e.device
    store = e.stores[policy]
    st = store.units[name]
    spare_slot = dev.empty(e.bufs["slot0"].shape, e.dtype)
    spare_grad = dev.host_empty((u.flat_numel,), e.store.grad_buffers[0].dtype)
    nxt = f"carry.{NEXT}.0"

    def forward():
        e.forward(0, name, 0, 0)
        if u.kind != "head":
            e.free(0, nxt)

    measured = {"compute": forward, "h2d": lambda: e.load_params(0, name, 0),
                "d2h": lambda: e.store_grads(0, name, 0, e.store.units[name].grad_buffer),
                "host": lambda: dev.submit("host", e._timed("host", "opt", lambda: store.step_unit(
                    name, e.lr, e.step_index, st.grad_buffer)), "opt")}

    def run_forward():
        with torch.no_grad(), routing.step_context(None, 1.0):
            run_unit(e.templates[u.template], e._params(u, 0), e._carry(u, 0), e._inputs(u, 0), e._buffers(u, 0))

    busy = {"compute": run_forward, "h2d": lambda: e.store.load_params(name, spare_slot[: u.flat_numel], dev),
            "d2h": lambda: dev.copy(spare_grad, e.bufs["grad0"][: u.flat_numel]),
            "host": lambda: store.step_unit(name, e.lr, e.step_index, st.grad_buffer)}
    cuda = dev.kind == "cuda"
    times: dict[tuple[str, str | None], list[float]] = {}
    for _ in range(max(repeats, CONTENTION_ROUNDS) + 1):
        for s in measured:
            for t in (None, *[t for t in busy if t != s]):
                stop, started = threading.Event(), threading.Event()
                if t is not None:
                    def loop(work=busy[t], stop=stop, started=started):
                        started.set()
                        while not stop.is_set():
                            work()
                            if cuda:
                                torch.cuda.current_stream().synchronize()
                    dev.submit(t, loop, f"probe busy {t}")
                    started.wait()
                e.start_timeline()
                measured[s]()
                dev.synchronize(s)
                stop.set()
                spans = e.measured_spans()
                e.timeline = None
                times.setdefault((s, t), []).append(spans[0][4] - spans[0][3])
    for values in times.values():
        values.pop(0)  # the warm-up round
    return {s: {t: max(1.0, statistics.median(b / a for a, b in zip(times[(s, None)], times[(s, t)])))
                for t in busy if t != s} for s in measured}


def _measure_gap(e: ProbeEngine, n: int = 20) -> float:
    """From the end of a compute op to the start of the next one submitted after the caller synchronized the
    compute stream (as the training loop does between steps)."""
    gaps, marks = [], []
    for _ in range(n):
        e.device.submit("compute", lambda: marks.append(time.perf_counter()), "probe gap")
        e.device.synchronize("compute")
        e.device.submit("compute", lambda: marks.append(time.perf_counter()), "probe gap")
        e.device.synchronize("compute")
        gaps.append(marks[-1] - marks[-2])
    return statistics.median(gaps)


def probe_units(ir: ModelIR, kind: str = "sim", *, policies: list[str] | None = None, repeats: int = 5,
                sim_threads: int | None = None, loss_chunk: int = 1024, clip: bool = True,
                measure_contention: bool = True, progress=None) -> UnitProfile:
    """Measure every distinct unit template of `ir` on a fresh `kind` device ("sim" or "cuda"); `policies`:
    the host policies whose optimizer step to time (default: exact); `sim_threads`: the sim compute worker's
    intra-op threads (default: this thread's)."""
    policies = [resolve(p).name for p in (policies or ["exact"])]
    t0 = time.perf_counter()
    kw = {"cpu": resolve_cpus("sim", sim_threads=sim_threads)} if kind == "sim" else {}
    device = make_device(kind, None, **kw)
    used = device_threads(device)
    train = TrainSpec(micro_batch=ir.micro_batch, seq_len=ir.seq_len, dtype=ir.dtype, lr=1e-4, total_steps=10**6)
    reps: dict[tuple, UnitIR] = {}
    for u in ir.units:
        reps.setdefault((u.template, tuple(s.shape for s in u.carry_in)), u)
    try:
        engines = []
        for u in reps.values():
            e = ProbeEngine(ir, u, device, policies[0], train, loss_chunk)
            e.stores = {p: (e.store if p == policies[0] else HostStore(e.ir, train, policy=p, device=device.kind))
                        for p in policies}
            e.cast_stores = _cast_stores(e, device, train, policies[0])
            e.dev_states = _device_states(e, policies)
            e.put_carry()
            device.synchronize()
            engines.append(e)
        samples: list[dict[str, list[float]]] = [{} for _ in engines]
        for r in range(repeats + WARMUP_ROUNDS):  # the first ones warm up (allocator, kernels, lazy inits)
            for e, got in zip(engines, samples):
                e.start_timeline()
                kinds = []
                for what, submit in _ops(e, policies, clip):
                    before = len(e.timeline)
                    _run_op(e, what, submit)
                    kinds += [what] * (len(e.timeline) - before)
                if r >= WARMUP_ROUNDS:
                    for what, span in zip(kinds, e.measured_spans()):
                        got.setdefault(what, []).append(span[4] - span[3])
                e.timeline = None
                e.routing_logs = {}
            if progress:
                progress(r, repeats)
        dispatch, latency = _measure_device(device)
        gap = _measure_gap(engines[0])
        heaviest = max(zip(engines, samples), key=lambda es: statistics.median(es[1]["forward_s"]))[0]
        contention = _contention(heaviest, policies[0], repeats) if measure_contention else {}
    finally:
        device.close()
        for e in locals().get("engines", []):
            for s in (*getattr(e, "stores", {}).values(), *getattr(e, "cast_stores", {}).values()):
                s.close()
    units = {}
    for e, got in zip(engines, samples):
        med = {k: statistics.median(v) for k, v in got.items()}
        u = e.unit
        units[u.template] = UnitTimes(
            template=u.template, carry_in=tuple(s.shape for s in u.carry_in), n_params=u.n_params,
            forward_s=med["forward_s"], forward_graph_s=med["forward_graph_s"], backward_s=med["backward_s"],
            forward_warm_s=med["forward_warm_s"], recompute_backward_warm_s=med["recompute_backward_warm_s"],
            recompute_backward_s=med["recompute_backward_s"], forward_rebuild_s=med.get("forward_rebuild_s"),
            rebuild_backward_s=med.get("rebuild_backward_s"), forward_replay_s=med.get("forward_replay_s"),
            replay_backward_s=med.get("replay_backward_s"),
            norm_s=max(0.0, med["norm_backward"] - med["recompute_backward_s"]),
            load_s=med["load_s"], load_cast_s={w: med[f"load:{w}"] for w in e.cast_stores},
            store_s=med["store_s"], offload_s=med.get("offload_s", 0.0),
            reload_s=med.get("reload_s", 0.0),
            optimizer_s={p: med[f"opt:{p}"] for p in policies},
            optimizer_clip_s={p: med.get(f"optclip:{p}", med[f"opt:{p}"]) for p in policies},
            device_step_s={p: med[f"dstep:{p}"] for p in e.dev_states},
            device_step_clip_s={p: med.get(f"dstepclip:{p}", med[f"dstep:{p}"]) for p in e.dev_states},
            store_norms_s=med.get("store_norms_s"))
    fields = dict(device=kind, device_name=device_name(kind), torch=torch.__version__, config_sha=config_sha(ir.config),
                  micro_batch=ir.micro_batch, seq_len=ir.seq_len, dtype=ir.dtype, packed=ir.packed,
                  loss_chunk=loss_chunk, threads=used, compiled=False)
    return UnitProfile(key=profile_key(**fields), model=ir.model, dispatch_s=dispatch, event_latency_s=latency,
                       step_gap_s=gap, contention=contention, units=units, repeats=repeats, seconds=time.perf_counter() - t0,
                       spread=worst_spread({e.unit.template: got for e, got in zip(engines, samples)}),
                       measured_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), **fields)


def probe_hardware(ir: ModelIR, machine: Hardware, kind: str = "sim", *, cache: bool = True, **kw) -> Hardware:
    """`machine` with a UnitProfile of `ir` measured now on this machine's `kind` device, written to the
    profile cache when `cache` (checked writable first: a probe measures for minutes)."""
    if cache:
        check_cache_writable(cache_dir(), "a probed profile")
    units = probe_units(ir, kind, **kw)
    hw = machine.replace(units=units, name=f"{machine.name} + units of {ir.model}",
                         source=f"{machine.source}; unit profile {units.key} measured {units.measured_at}")
    if cache:
        write_cached(hw)
    return hw
