"""The verifier: the schedule IR's lint(). Checks a Program against ir/README.md's rules, independently of
how the planner built it.

Where it sits: the `verify` pass runs it on every plan; tests run it on hand-broken programs. Try it:
`python -c "from megatrain.planner import verify; help(verify)"`.

Ordering is checked with happens-before over two consecutive steps (stream order, record -> wait, and a
wait whose record comes later in the program waiting for the previous step's record), so hazards across the
step boundary are checked too. What it checks:
- every read of a parameter slot happens after the load of that unit into it completes and before the slot
  is loaded again; gradient slots likewise between backward and store_grads; accumulate flags;
- every read of a checkpoint (carry, saved graph, carry gradient) finds it on device: allocated, written
  (by forward or load_act) before, not yet freed; offloads finish before the free; reloads after the alloc;
- optimizer_step(u) after store_grads(u); clip_grads after every store and before every step; the next
  step's load_params(u) after optimizer_step(u) (and after the steps of units it holds tied copies of);
- host gradient buffers: store_grads(u) and optimizer_step(u) name the same `host_grad`; the next store into
  that buffer (this step or the next) waits until every reader of u's gradient is done (its step, its tied
  owner's step, clip_grads); each unit's last micro-batch's backward, and only it, writes the norms (`norm`);
- layer-major order and at most one load per unit per pass; the peak against the budget;
- each backward's `source` is its forward's `mode` (SOURCE_OF), and the buffer that mode keeps (saved graph,
  rebuild record, attention record) is written by the forward and read by the backward;
- the compute-dtype cast (cast.py `check`): a place the compute dtype has, and the `cast` staging buffer
  exactly where the place is "gpu";
- units whose state lives on the device (issue 40): one store_norms and one device_step read the unit's final
  gradients (after its last backward, before the gradient slot's next writer), no load_params, store_grads or
  optimizer_step of it, its device_step after clip_grads; a slot's writers are its loads and device steps;
- a world program's collectives (collectives.py `check_collectives`): every read of a sharded unit's slot
  after its all_gather, which follows the unit's shard load (or its device step); one gradient collective per
  unit, after its last backward and before its store (a device unit's store_norms and device_step), of the
  kind (reduce_scatter, all_reduce) its shard flags say;
- a checkpointing step's writes (checkpoint_writes.py `check_writes`): one save_state per stepped unit, after
  the previous step's optimizer_step of the unit and before this step's, and one seal_checkpoint after them.
- a resumed run's first step's reads (checkpoint_reads.py `check_reads`): one load_state per unit whose state lives
  on the host, before every instruction that reads or writes that state.
"""

from __future__ import annotations

from collections import defaultdict

from megatrain.ir.model_ir import ModelIR
from megatrain.ir.program import SOURCE_OF, Instr, Program

from .cast import check as check_cast
from .checkpoint_reads import check_reads
from .checkpoint_writes import check_writes
from .collectives import check_collectives
from .errors import ScheduleError
from .hardware import Hardware
from .sync import STREAMS, tied_owners
from .timeline import program_timeline


class HappensBefore:
    """Vector clocks over two unrolled copies of a step; copy 0 is the previous step."""

    def __init__(self, program: Program):
        instrs = program.instrs
        self.problems: list[str] = []
        self.sid = [STREAMS.index(ins.stream) for ins in instrs]
        self.counts = [self.sid.count(s) for s in range(len(STREAMS))]
        self.local: list[int] = []
        seen = [0] * len(STREAMS)
        for s in self.sid:
            self.local.append(seen[s])
            seen[s] += 1
        records: dict[str, int] = {}
        for i, ins in enumerate(instrs):
            if ins.op == "record":
                if ins.event in records:
                    self.problems.append(f"event {ins.event!r} is recorded twice (instructions {records[ins.event]} "
                                         f"and {i}); each event marks one point per step")
                records[ins.event] = i
        self.clock: list[list[list[int]]] = [[], []]
        last = [[-1] * len(STREAMS) for _ in range(len(STREAMS))]
        for copy in (0, 1):
            for i, ins in enumerate(instrs):
                s = self.sid[i]
                c = list(last[s])
                if ins.op == "wait":
                    r = records.get(ins.event)
                    if r is None:
                        if copy == 0:
                            self.problems.append(f"instruction {i} ({ins}) waits on {ins.event!r}, never recorded")
                    elif r < i:
                        c = [max(a, b) for a, b in zip(c, self.clock[copy][r])]
                    elif copy == 1:
                        c = [max(a, b) for a, b in zip(c, self.clock[0][r])]
                c[s] = copy * self.counts[s] + self.local[i]
                self.clock[copy].append(c)
                last[s] = c

    def before(self, a: tuple[int, int], b: tuple[int, int]) -> bool:
        """Does instruction a = (copy, index) complete before instruction b starts (or is it b itself)?
        Copies 0 and 1 are two consecutive steps; copy 2 means b's index in the step after copy 1."""
        (ca, ia), (cb, ib) = a, b
        if cb == 2:  # shift: compare a one step earlier
            if ca == 0:
                return True
            ca, cb = ca - 1, 1
        seq = ca * self.counts[self.sid[ia]] + self.local[ia]
        return seq <= self.clock[cb][ib][self.sid[ia]]


def check(program: Program, *, ir: ModelIR | None = None, budget_bytes: int | None = None,
          hardware: Hardware | None = None) -> list[str]:
    """Every violation found, as one line each (empty: the program is valid)."""
    hb = HappensBefore(program)
    problems = list(hb.problems)
    instrs = program.instrs
    problems += _check_slots(instrs, hb, program)
    problems += _check_grads(instrs, hb)
    problems += _check_buffers(program, hb)
    problems += _check_host(instrs, hb, ir)
    problems += _check_host_grads(instrs, hb, ir, program.world_size)
    problems += check_collectives(program, hb, _at)
    problems += check_writes(program, hb, _at)
    problems += check_reads(program, hb, _at, ir)
    problems += _check_order(instrs, program.n_micro_batches, ir)
    problems += _check_modes(instrs)
    if ir is not None:
        problems += check_cast(program, ir)
    if budget_bytes is not None:
        peak = program_timeline(program).peak
        need = hardware.gpu_bytes(peak) if hardware else peak
        if need > budget_bytes:
            problems.append(f"peak device bytes {need} exceed the budget {budget_bytes}")
    return problems


def verify(program: Program, *, ir: ModelIR | None = None, budget_bytes: int | None = None,
           hardware: Hardware | None = None) -> None:
    """Raise ScheduleError naming every violation; return None when the program is valid.
    With `hardware`, the peak is compared as the GPU needs it (reserved bytes + allocator margin)."""
    problems = check(program, ir=ir, budget_bytes=budget_bytes, hardware=hardware)
    if problems:
        raise ScheduleError(problems)


def _at(i: int, ins: Instr) -> str:
    return f"instruction {i} ({ins.stream}: {str(ins).split('] ', 1)[1]})"


def _cyclic(positions: list[int], i: int) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """The latest position before i and the first after i, as (copy, index); copy 1 = this step."""
    prev = [p for p in positions if p < i]
    nxt = [p for p in positions if p > i]
    before = (1, prev[-1]) if prev else ((0, positions[-1]) if positions else None)
    after = (1, nxt[0]) if nxt else ((2, positions[0]) if positions else None)
    return before, after


def _check_slots(instrs: tuple[Instr, ...], hb: HappensBefore, program: Program) -> list[str]:
    problems = []
    loads: dict[int, list[int]] = defaultdict(list)  # a slot's writers: loads, and a device unit's steps
    for i, ins in enumerate(instrs):
        if ins.op in ("load_params", "device_step"):
            loads[ins.slot].append(i)
    n_slots = sum(1 for b in program.buffers if b.kind == "param_slot")
    for i, ins in enumerate(instrs):
        if ins.op not in ("forward", "backward", "load_params", "device_step"):
            continue
        if ins.slot is None or not 0 <= ins.slot < n_slots:
            problems.append(f"{_at(i, ins)} names slot {ins.slot}; the program has {n_slots} slots")
            continue
        if ins.op in ("load_params", "device_step"):
            continue
        if f"slot{ins.slot}" not in ins.reads:
            problems.append(f"{_at(i, ins)} does not list slot{ins.slot} among its reads")
        load, nxt = _cyclic(loads[ins.slot], i)
        if load is None:
            problems.append(f"{_at(i, ins)} reads slot{ins.slot}, which is never loaded")
            continue
        held = instrs[load[1]].unit
        if held != ins.unit:
            problems.append(f"{_at(i, ins)} reads slot{ins.slot} while it holds {held}")
        elif not hb.before(load, (1, i)):
            problems.append(f"{_at(i, ins)} may run before load_params({held}) into slot{ins.slot} completes "
                            "(missing wait)")
        if nxt is not None and not hb.before((1, i), nxt):
            problems.append(f"slot{ins.slot} is overwritten by {_at(nxt[1], instrs[nxt[1]])} before "
                            f"{_at(i, ins)} has read it")
    return problems


def _check_grads(instrs: tuple[Instr, ...], hb: HappensBefore) -> list[str]:
    problems = []
    bwd: dict[str, list[int]] = defaultdict(list)
    stores: dict[str, list[int]] = defaultdict(list)
    device: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))  # a device unit's readers
    by_slot: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for i, ins in enumerate(instrs):
        if ins.op == "backward":
            bwd[ins.unit].append(i)
            by_slot[ins.grad_slot].append((i, ins.unit))
        elif ins.op == "store_grads":
            stores[ins.unit].append(i)
        elif ins.op in ("store_norms", "device_step"):
            device[ins.unit][ins.op].append(i)
    for unit, idx in bwd.items():
        slots = {instrs[i].grad_slot for i in idx}
        if len(slots) != 1:
            problems.append(f"backward({unit}) writes several gradient slots {sorted(slots)}")
            continue
        g = slots.pop()
        for k, i in enumerate(idx):
            if instrs[i].accumulate != (k > 0):
                want = "accumulate=True" if k else "accumulate=False (it is the first micro-batch)"
                problems.append(f"{_at(i, instrs[i])} should have {want}")
        if unit in device:  # its gradients are read by its store_norms and its device_step, never stored
            ops = device[unit]
            if stores[unit] or len(ops["store_norms"]) != 1 or len(ops["device_step"]) != 1:
                problems.append(f"unit {unit} is stepped on the device: it needs exactly one store_norms and one "
                                f"device_step per step and no store_grads")
                continue
            readers = [ops["store_norms"][0], ops["device_step"][0]]
        elif len(stores[unit]) != 1:
            problems.append(f"unit {unit} has {len(stores[unit])} store_grads; it needs exactly one per step")
            continue
        else:
            readers = stores[unit]
        for s in readers:
            problems += _grad_reader(instrs, hb, unit, g, idx, s, by_slot[g])
    for unit in [*stores, *device]:
        if unit not in bwd:
            problems.append(f"gradients of {unit} are read without a backward of {unit}")
    return problems


def _grad_reader(instrs, hb: HappensBefore, unit: str, g: int, idx: list[int], s: int, writers) -> list[str]:
    """Reader `s` of unit's final gradients in grad{g}: after every backward of the unit, before the slot's next
    writer."""
    problems = []
    if instrs[s].grad_slot != g:
        problems.append(f"{_at(s, instrs[s])} reads grad{instrs[s].grad_slot}, but backward({unit}) wrote grad{g}")
    for i in idx:
        if not hb.before((1, i), (1, s)):
            problems.append(f"{_at(s, instrs[s])} may run before {_at(i, instrs[i])} completes (missing wait)")
    between = [i for i, u in writers if u != unit and idx[0] < i < s]
    if between:
        problems.append(f"grad{g} is overwritten by {_at(between[0], instrs[between[0]])} before "
                        f"{_at(s, instrs[s])}")
    after = [i for i, _ in writers if i > s]
    nxt = (1, after[0]) if after else (2, writers[0][0])
    if not hb.before((1, s), nxt):
        problems.append(f"grad{g} is overwritten by {_at(nxt[1], instrs[nxt[1]])} before {_at(s, instrs[s])} "
                        "has read it (missing wait)")
    return problems


def _check_buffers(program: Program, hb: HappensBefore) -> list[str]:
    """Liveness in compute order; writers before readers; offloads before frees; reloads after allocs."""
    problems = []
    instrs = program.instrs
    static = {b.name for b in program.buffers if b.static}
    live: set[str] = set()
    writer: dict[str, int] = {}
    offloaded: dict[str, int] = {}
    for i, ins in enumerate(instrs):
        if ins.op == "alloc":
            if ins.buffer in live:
                problems.append(f"{_at(i, ins)} allocates {ins.buffer}, which is already live")
            live.add(ins.buffer)
            writer[ins.buffer] = i
        elif ins.op == "free":
            if ins.buffer not in live:
                problems.append(f"{_at(i, ins)} frees {ins.buffer}, which is not live")
            live.discard(ins.buffer)
            off = offloaded.pop(ins.buffer, None)
            if off is not None and not hb.before((1, off), (1, i)):
                problems.append(f"{_at(i, ins)} may free {ins.buffer} before {_at(off, instrs[off])} has copied it")
        elif ins.op == "offload_act":
            w = writer.get(ins.buffer)
            if ins.buffer not in live or w is None:
                problems.append(f"{_at(i, ins)} offloads {ins.buffer}, which is not on device")
            elif not hb.before((1, w), (1, i)):
                problems.append(f"{_at(i, ins)} may copy {ins.buffer} before {_at(w, instrs[w])} wrote it")
            offloaded[ins.buffer] = i
        elif ins.op == "load_act":
            a = writer.get(ins.buffer)
            if ins.buffer not in live or a is None or instrs[a].op != "alloc":
                problems.append(f"{_at(i, ins)} loads {ins.buffer}, which is not allocated (alloc it first)")
            elif not hb.before((1, a), (1, i)):
                problems.append(f"{_at(i, ins)} may write {ins.buffer} before {_at(a, instrs[a])} (missing wait)")
            writer[ins.buffer] = i
        elif ins.op in ("forward", "backward"):
            for name in ins.reads:
                if name in static or name.startswith("slot"):
                    continue
                if name not in live:
                    where = " (its copy is on host: it was offloaded and freed, and never loaded back)" \
                        if name in _offloaded_names(instrs) else ""
                    problems.append(f"{_at(i, ins)} reads {name}, which is not on device{where}")
                elif name in writer and not hb.before((1, writer[name]), (1, i)):
                    w = writer[name]
                    problems.append(f"{_at(i, ins)} may read {name} before {_at(w, instrs[w])} completes "
                                    "(missing wait)")
            for name in ins.writes:
                if name not in static:
                    live.add(name)
                    writer[name] = i
    if live:
        problems.append(f"dynamic buffers still live at the end of the step: {sorted(live)[:4]}")
    return problems


def _offloaded_names(instrs: tuple[Instr, ...]) -> set[str]:
    return {ins.buffer for ins in instrs if ins.op == "offload_act"}


def _check_host(instrs: tuple[Instr, ...], hb: HappensBefore, ir: ModelIR | None) -> list[str]:
    problems = []
    opt = {ins.unit: i for i, ins in enumerate(instrs) if ins.op == "optimizer_step"}
    store = {ins.unit: i for i, ins in enumerate(instrs) if ins.op == "store_grads"}
    clips = [i for i, ins in enumerate(instrs) if ins.op == "clip_grads"]
    n_opt = sum(1 for ins in instrs if ins.op == "optimizer_step")
    if n_opt != len(opt):
        problems.append("some unit has more than one optimizer_step per step")
    for unit, i in opt.items():
        s = store.get(unit)
        if s is None:
            problems.append(f"{_at(i, instrs[i])} has no store_grads({unit}) to wait for")
        elif not hb.before((1, s), (1, i)):
            problems.append(f"{_at(i, instrs[i])} may run before {_at(s, instrs[s])} completes (missing wait)")
    if len(clips) > 1:
        problems.append(f"{len(clips)} clip_grads; a step has at most one")
    dsteps = {ins.unit: i for i, ins in enumerate(instrs) if ins.op == "device_step"}
    norms = {ins.unit: i for i, ins in enumerate(instrs) if ins.op == "store_norms"}
    for unit, i in dsteps.items():
        if unit in opt:
            problems.append(f"unit {unit} has both optimizer_step and device_step; it is stepped on one side")
        loaded = [j for j, ins in enumerate(instrs) if ins.op == "load_params" and ins.unit == unit]
        if loaded:
            problems.append(f"{_at(loaded[0], instrs[loaded[0]])} loads {unit}, whose weights the device steps "
                            "(the host master is only its mirror)")
        for c in clips:
            if not hb.before((1, c), (1, i)):
                problems.append(f"{_at(i, instrs[i])} may run before clip_grads (missing wait)")
    for c in clips:
        for s in (*store.values(), *norms.values()):
            if not hb.before((1, s), (1, c)):
                problems.append(f"clip_grads may run before {_at(s, instrs[s])} completes (missing wait)")
        for i in opt.values():
            if not hb.before((1, c), (1, i)):
                problems.append(f"{_at(i, instrs[i])} may run before clip_grads")
    owners = tied_owners(ir) if ir is not None else {}
    first_load: dict[str, int] = {}
    for i, ins in enumerate(instrs):
        if ins.op == "load_params":
            first_load.setdefault(ins.unit, i)
    for unit, i in first_load.items():
        for src in (unit, *owners.get(unit, ())):
            o = opt.get(src)
            if o is None:
                problems.append(f"unit {src} is loaded but never stepped by the optimizer")
            elif not hb.before((0, o), (1, i)):
                problems.append(f"{_at(i, instrs[i])} may load {unit} before the previous step's "
                                f"optimizer_step({src}) (missing cross-step wait)")
    return problems


def _check_host_grads(instrs: tuple[Instr, ...], hb: HappensBefore, ir: ModelIR | None,
                      world_size: int = 1) -> list[str]:
    problems = []
    store = {ins.unit: i for i, ins in enumerate(instrs) if ins.op == "store_grads"}
    opt = {ins.unit: i for i, ins in enumerate(instrs) if ins.op == "optimizer_step"}
    clips = [i for i, ins in enumerate(instrs) if ins.op == "clip_grads"]
    owners = tied_owners(ir) if ir is not None else {}
    into: dict[int | None, list[int]] = defaultdict(list)
    for s in sorted(store.values()):
        into[instrs[s].host_grad].append(s)
    for unit, s in store.items():
        k = instrs[s].host_grad
        o = opt.get(unit)
        if o is not None and instrs[o].host_grad != k:
            problems.append(f"{_at(o, instrs[o])} steps from host_grad {instrs[o].host_grad}, but "
                            f"{_at(s, instrs[s])} stored into {k}")
        if k is None:
            continue
        # the readers of u's gradients: its step, the step of the owner it holds tied copies of, clip_grads
        readers = [i for i in (o, *(opt.get(w) for w in owners.get(unit, ())), *clips) if i is not None and i > s]
        _, nxt = _cyclic(into[k], s)
        for r in readers:
            if not hb.before((1, r), nxt):
                problems.append(f"hgrad{k} is overwritten by {_at(nxt[1], instrs[nxt[1]])} before {_at(r, instrs[r])} "
                                f"has read {unit}'s gradients (missing wait)")
    last: dict[str, int] = {}
    for i, ins in enumerate(instrs):
        if ins.op == "backward":
            last[ins.unit] = i
    for i, ins in enumerate(instrs):  # (in a world program the gradient collective writes the norms)
        if ins.op == "backward" and world_size == 1 and ins.norm != (last[ins.unit] == i):
            want = "norm=True (its gradients are final here)" if ins.norm is False else "no norm (later micro-batches add to its gradients)"
            problems.append(f"{_at(i, ins)} should have {want}")
    return problems


# The buffer each forward mode keeps for its backward, which that backward's source reads.
_KEPT = {"keep": "saved", "rebuild": "side", "replay": "attn"}


def _check_modes(instrs: tuple[Instr, ...]) -> list[str]:
    """Each backward takes its graph from what its forward kept: its source is the forward mode's (SOURCE_OF), and
    the buffer that mode keeps is written by the forward and read by the backward."""
    problems = []
    forward = {(ins.unit, ins.mb): (i, ins) for i, ins in enumerate(instrs) if ins.op == "forward"}
    for i, ins in enumerate(instrs):
        if ins.op == "forward" and ins.mode == "eval":
            problems.append(f"{_at(i, ins)}: a step's forward is followed by a backward; eval is an evaluation's mode")
        if ins.op != "backward" or (ins.unit, ins.mb) not in forward:
            continue
        j, fwd = forward[(ins.unit, ins.mb)]
        if SOURCE_OF.get(fwd.mode) != ins.source:
            problems.append(f"{_at(i, ins)} takes its graph from {ins.source}, but {_at(j, fwd)} keeps what "
                            f"source={SOURCE_OF.get(fwd.mode)} needs")
        kept = _KEPT.get(fwd.mode)
        name = f"{kept}.{ins.unit}.{ins.mb}"
        if kept is not None and (name not in fwd.writes or name not in ins.reads):
            problems.append(f"{_at(j, fwd)} and {_at(i, ins)} must write and read {name}")
    return problems


def _check_order(instrs: tuple[Instr, ...], n_micro: int, ir: ModelIR | None) -> list[str]:
    problems = []
    for phase in ("forward", "backward"):
        seq = [(ins.unit, ins.mb) for ins in instrs if ins.op == phase]
        runs = [u for k, (u, _) in enumerate(seq) if k == 0 or seq[k - 1][0] != u]
        if len(runs) != len(set(runs)):
            problems.append(f"{phase}: micro-batches of a unit are interleaved with other units "
                            "(layer-major order: all micro-batches through a unit before the next)")
        for u in set(runs):
            mbs = sorted(mb for v, mb in seq if v == u)
            if mbs != list(range(n_micro)):
                problems.append(f"{phase}({u}) runs micro-batches {mbs}, expected 0..{n_micro - 1} once each")
        if ir is not None:
            names = [u.name for u in ir.units]
            want = names if phase == "forward" else names[::-1]
            if runs != want:
                problems.append(f"{phase} visits units {runs[:3]}..., expected depth order {want[:3]}...")
    loads: dict[str, int] = defaultdict(int)
    for ins in instrs:
        if ins.op == "load_params":
            loads[ins.unit] += 1
    for unit, n in loads.items():
        if n > 2:
            problems.append(f"unit {unit} crosses h2d {n} times per step; at most once per pass")
    return problems
