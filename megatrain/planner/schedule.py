"""Layer-major order, lowering and buffer assignment: decisions in, an unsynchronised op list out.

Where it sits: the `order`, `lower` and `buffers` passes (planner/passes.py) call these; the placement
search calls them too, to measure exact peaks of candidates. `sync.py` then inserts record/wait.

The lowered list is a *sequential* program: run one op at a time in list order, it is correct. Copy ops
sit right after the ops they must follow (a prefetch right after the last read of the slot it reuses), so
sync insertion only has to order, across streams, what the list already orders.

Order (ir/README.md rules): forward runs every micro-batch through unit u before u+1; backward every
micro-batch through u before u-1. Unit i owns parameter slot i % S in both passes, so the last S units of
the forward stay resident for the backward and every reload lands in the slot the forward used (which a
`keep` unit's saved autograd graph relies on: it references the slot's storage).
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass

from megatrain.ir.model_ir import ModelIR
from megatrain.ir.program import SOURCE_OF, Instr

Placement = str  # "device" | "host" | "keep" | "rebuild"


@dataclass(frozen=True)
class Decisions:
    """What the placement search decided: slots and, per unit (depth order), its checkpoint placement."""

    n_slots: int
    n_grad_slots: int
    placement: tuple[Placement, ...]
    optimizer_split: int | None = None  # units stepped in backward order as grads land; None = all
    host_grad_ring: int = 2  # host gradient buffers those units take turns in (HOST_GRAD_RING at least)
    # per unit: its checkpoint also keeps the fused attention's outputs, which its recompute replays
    # (models/replay.py; only with placement device or host); empty: none does
    replay: tuple[bool, ...] = ()
    # per unit: where its state lives (issue 40): "host" (streamed), "weights" (a dedicated slot, loaded once a
    # step) or "device" (dedicated slots, its optimizer state on the device, stepped by device_step); empty: all host
    state: tuple[str, ...] = ()

    def replays(self, i: int) -> bool:
        return bool(self.replay) and self.replay[i]

    def place_of(self, i: int) -> str:
        return self.state[i] if self.state else "host"

    @property
    def prefetch_distance(self) -> int:
        """A load starts as soon as a slot frees: with S slots that is S-1 units ahead of compute."""
        return self.n_slots - 1


def _fields(self) -> dict:
    return {f: getattr(self, f) for f in self.__slots__}


# A lightweight instruction with the fields of `ir.program.Instr`, taken from it (converted once, at the end: the
# validator is too slow for the placement search's many candidate lowerings). op and stream are positional.
Op = make_dataclass("Op", [("op", str), ("stream", str)] + [
    (name, object, field(default=f.default, kw_only=True)) for name, f in Instr.model_fields.items()
    if name not in ("op", "stream")], slots=True, eq=False, namespace={"fields": _fields})


def carry(unit: str, mb: int) -> str:
    return f"carry.{unit}.{mb}"


def saved(unit: str, mb: int) -> str:
    return f"saved.{unit}.{mb}"


def dcarry(unit: str, mb: int) -> str:
    return f"dcarry.{unit}.{mb}"


def side(unit: str, mb: int) -> str:
    return f"side.{unit}.{mb}"


def attn(unit: str, mb: int) -> str:
    return f"attn.{unit}.{mb}"


def can_replay(ir: ModelIR, i: int, place: Placement) -> bool:
    """Unit i's recompute may replay its fused attention: the trace recorded what it needs, and its checkpoint
    is one the backward recomputes from (on device or host; a kept graph recomputes nothing)."""
    return bool(ir.units[i].replay) and ir.units[i].carry_in != () and place in ("device", "host")


def can_rebuild(ir: ModelIR, i: int) -> bool:
    """Unit i may rebuild its carry-in in backward: it records fewer bytes than its carry-in, and a later
    unit's carry-in (what it rebuilds from) exists."""
    u = ir.units[i]
    return u.rebuild_bytes is not None and u.carry_in and u.rebuild_bytes < u.carry_in_bytes and i + 1 < len(ir.units)


def slot_bytes(ir: ModelIR, state: tuple[str, ...] = ()) -> int:
    """One shared parameter slot: the largest streamed ("host") unit's flat buffer in the compute dtype (and
    its fp32 buffers, if any); with no state given, the largest unit's."""
    return max((u.slot_bytes(ir.dtype) for u in ir.units if not state or state[u.index] == "host"), default=0)


def unit_grad_bytes(u) -> int:
    """A gradient slot holding unit `u`: its flat buffer in fp32, then its per-parameter gradient norms (fp32,
    one per parameter: what `backward(norm=True)` writes after the gradients)."""
    return (u.flat_numel + len(u.params)) * 4


def grad_slot_bytes(ir: ModelIR, state: tuple[str, ...] = ()) -> int:
    """One shared gradient slot: the largest unit's that uses one (every unit but a "device" one)."""
    return max((unit_grad_bytes(u) for u in ir.units if not state or state[u.index] != "device"), default=0)


# elements per in-cache chunk of the AdamW step (runtime/host_adamw.py STEP_CHUNK is this value): bounds the
# scratch a device-resident unit's step allocates
STEP_CHUNK = 1 << 20
# the most scratch bytes per chunk element a device step allocates: the fp32 chunks of runtime/host_adamw.py
# _Scratch (gradient, first and second moment; a clipped step scales the gradient into the first)
SCRATCH_BYTES_PER_ELEMENT = 4 * 3


def device_step_workspace(unit) -> int:
    """Transient device bytes of a device step of `unit` (planner/residency.py), an upper bound: its chunk
    scratch (nothing without a clip factor, where the step updates the tensors in place)."""
    largest = max((p.numel for p in unit.params if p.name not in unit.tied), default=0)
    return SCRATCH_BYTES_PER_ELEMENT * min(STEP_CHUNK, largest)


HOST_GRAD_RING = 2  # the fewest host gradient buffers the units stepped as their gradients land take turns in


def host_grad_assignment(ir: ModelIR, order_backward: tuple[int, ...], clip: bool,
                         optimizer_split: int | None = None, ring: int = HOST_GRAD_RING,
                         state: tuple[str, ...] = ()) -> tuple[int | None, ...]:
    """Per unit (depth index): the host gradient buffer `hgrad{k}` its store_grads lands in.

    A unit stepped as its gradients land (the first `optimizer_split` units of the backward, without clipping)
    holds its gradient only from its store to its optimizer step, right after: those units take turns in a
    ring of `ring` buffers (at least two, so one store overlaps the previous unit's step; more let the
    backward run further ahead of the host optimizer). Every other unit's gradient waits (for clip_grads, or
    for the backward to end) and gets a buffer of its own; so does a unit holding tied parameters, whose
    gradient its owner's step reads. Ring buffers come first. A unit whose state lives on the device (`state`
    "device") has none: None."""
    n = len(ir.units)
    split = n if optimizer_split is None else optimizer_split
    landing = set() if clip else set(order_backward[:split])
    on_device = {i for i in range(n) if state and state[i] == "device"}
    turns = [i for i in order_backward if i in landing and not ir.units[i].tied and i not in on_device]
    size = max(HOST_GRAD_RING, ring)
    out: list[int | None] = [None] * n
    for j, i in enumerate(turns):
        out[i] = j % size
    k = min(len(turns), size)
    for i in order_backward:
        if i not in turns and i not in on_device:
            out[i] = k
            k += 1
    return tuple(out)


def resident_units(n_units: int, n_slots: int) -> range:
    """Units (depth indices) whose forward slot still holds them when the backward reaches them."""
    return range(max(0, n_units - n_slots), n_units)


@dataclass(frozen=True)
class Order:
    """The layer-major visiting order: units per pass, the slot of each unit (the same in both passes),
    the units resident across the turn, and each unit's gradient slot."""

    forward: tuple[int, ...]
    backward: tuple[int, ...]
    micro_batches: int
    slot: tuple[int, ...]
    resident: frozenset[int]
    grad_slot: tuple[int, ...]
    state: tuple[str, ...] = ()  # Decisions.state: where each unit's state lives (empty: all host)

    def place_of(self, i: int) -> str:
        return self.state[i] if self.state else "host"

    @property
    def reloads(self) -> tuple[int, ...]:
        """Units loaded again for the backward, in backward order."""
        return tuple(i for i in self.backward if i not in self.resident)


def make_order(n_units: int, n_micro: int, dec: Decisions) -> Order:
    """Shared slots rotate among the streamed ("host") units only: the j-th in forward order uses slot j % S;
    every other unit has a dedicated slot S, S+1, ... in forward order (docs/DESIGN.md 5, residency). Shared
    gradient slots round-robin over the units without device state in backward order; a "device" unit has a
    dedicated one, G, G+1, ... in backward order."""
    S, G = dec.n_slots, dec.n_grad_slots
    backward = tuple(range(n_units - 1, -1, -1))
    state = tuple(dec.state)
    if state and len(state) != n_units:
        raise ValueError(f"Decisions.state names {len(state)} units, the model has {n_units}")
    if not state or all(p == "host" for p in state):
        grad = [0] * n_units
        for j, i in enumerate(backward):
            grad[i] = j % G
        return Order(forward=tuple(range(n_units)), backward=backward, micro_batches=n_micro,
                     slot=tuple(i % S for i in range(n_units)), resident=frozenset(resident_units(n_units, S)),
                     grad_slot=tuple(grad))
    host = [i for i in range(n_units) if state[i] == "host"]
    slot = [0] * n_units
    for j, i in enumerate(host):
        slot[i] = j % S
    for j, i in enumerate(i for i in range(n_units) if state[i] != "host"):
        slot[i] = S + j
    grad = [0] * n_units
    for j, i in enumerate(i for i in backward if state[i] != "device"):
        grad[i] = j % G
    for j, i in enumerate(i for i in backward if state[i] == "device"):
        grad[i] = G + j
    resident = set(host[max(0, len(host) - S):]) | {i for i in range(n_units) if state[i] != "host"}
    return Order(forward=tuple(range(n_units)), backward=backward, micro_batches=n_micro, slot=tuple(slot),
                 resident=frozenset(resident), grad_slot=tuple(grad), state=state)


def check_model(ir: ModelIR) -> None:
    """The unit sequence the lowering understands: only the first unit may lack a carry-in."""
    if len(ir.units) < 2:
        raise ValueError(f"model {ir.model!r} has {len(ir.units)} unit(s); a plan needs an embed and a head")
    for u in ir.units[1:]:
        if not u.carry_in:
            raise ValueError(f"unit {u.name} has no carry-in; only the first unit may read the batch directly")
    if [u.index for u in ir.units] != list(range(len(ir.units))):
        raise ValueError("ModelIR units must be in depth order with index 0..N-1")


def buffer_specs(ir: ModelIR, n_micro: int, dec: Decisions, dstate_bytes: dict[str, int] | None = None) -> list[tuple]:
    """(name, kind, nbytes, static, unit, mb) for every device buffer the lowered program names; with
    `dstate_bytes` (unit -> bytes, residency.device_state_bytes) the device units' `dstate.{unit}`."""
    state = tuple(dec.state)
    specs: list[tuple] = [(f"slot{k}", "param_slot", slot_bytes(ir, state), True, None, None)
                          for k in range(dec.n_slots)]
    specs += [(f"slot{dec.n_slots + j}", "param_slot", u.slot_bytes(ir.dtype), True, u.name, None)
              for j, u in enumerate(u for u in ir.units if dec.place_of(u.index) != "host")]
    specs += [(f"grad{k}", "grad_slot", grad_slot_bytes(ir, state), True, None, None)
              for k in range(dec.n_grad_slots)]
    specs += [(f"grad{dec.n_grad_slots + j}", "grad_slot", unit_grad_bytes(u), True, u.name, None)
              for j, u in enumerate(u for u in reversed(ir.units) if dec.place_of(u.index) == "device")]
    specs += [(f"dstate.{u.name}", "device_state", (dstate_bytes or {}).get(u.name, 0), True, u.name, None)
              for u in ir.units if dec.place_of(u.index) == "device"]
    specs += [("rope", "resident", ir.resident_bytes, True, None, None),
              ("batch", "batch", n_micro * ir.micro_batch * ir.seq_len * 8 * 2, True, None, None),
              ("loss", "loss", n_micro * max(4, ir.units[-1].carry_out_bytes), True, None, None)]
    for u, place in zip(ir.units, dec.placement):
        if not u.carry_in:
            continue
        for mb in range(n_micro):
            specs.append((carry(u.name, mb), "carry", u.carry_in_bytes, False, u.name, mb))
            specs.append((dcarry(u.name, mb), "grad_carry", u.carry_in_bytes, False, u.name, mb))
            if place == "keep":
                specs.append((saved(u.name, mb), "saved", u.saved_bytes, False, u.name, mb))
            if place == "rebuild":
                specs.append((side(u.name, mb), "saved", u.rebuild_bytes, False, u.name, mb))
            if dec.replays(u.index):
                specs.append((attn(u.name, mb), "attention", u.replay_bytes, False, u.name, mb))
    return specs


def lower_ops(ir: ModelIR, order: Order, placement: tuple[Placement, ...], clip: bool,
              optimizer_split: int | None = None, compute_only: bool = False,
              host_grad_ring: int = HOST_GRAD_RING, replay: tuple[bool, ...] = ()) -> list[Op]:
    """The sequential program of one step (no record/wait yet). A load is placed right after the last
    read of the slot it reuses, so it runs as early as the slot allows. Without clipping the first
    `optimizer_split` units of the backward are stepped as their gradients land, the rest after the
    backward in forward order (the next step's forward needs them in that order); with clipping every
    unit is stepped after clip_grads, in forward order.

    Per-unit state (order.state, docs/DESIGN.md 5): a "weights" unit is loaded once a step, one unit ahead
    of its forward, and never reloaded; a "device" unit is never loaded nor stored: `store_norms` lands its
    norms after its last backward and `device_step` steps it on the compute stream, right after that without
    clipping, after clip_grads with it."""
    split = len(order.backward) if optimizer_split is None else optimizer_split
    units, place, slot = ir.units, placement, order.slot
    state_of = order.place_of
    hgrad = host_grad_assignment(ir, order.backward, clip, optimizer_split, host_grad_ring, order.state)
    for i, where in enumerate(place):
        if where == "rebuild" and not can_rebuild(ir, i):
            raise ValueError(f"unit {units[i].name} cannot rebuild its carry-in (only DepthSSD blocks can, when "
                             "what they record is smaller than their carry); place its checkpoint elsewhere")
    rep = tuple(replay) if replay else (False,) * len(units)
    if len(rep) != len(units):
        raise ValueError(f"replay names {len(rep)} units, the model has {len(units)}")
    for i, on in enumerate(rep):
        if on and not can_replay(ir, i, place[i]):
            raise ValueError(f"unit {units[i].name} cannot replay its attention with its checkpoint {place[i]!r} "
                             "(only blocks of unpacked sequences whose checkpoint is on device or host can)")
    last = order.forward[-1]
    mbs = range(order.micro_batches)
    ops: list[Op] = []
    fwd_queue: dict[int, list[int]] = {}
    for i in order.forward:
        if state_of(i) == "host":
            fwd_queue.setdefault(slot[i], []).append(i)
    # a unit keeping its weights on the device loads once a step, before the forward of the unit ahead of it
    ahead: dict[int, int] = {i - 1: i for i in order.forward if state_of(i) == "weights" and i >= 2}
    bwd_queue: dict[int, list[int]] = {}
    for i in order.reloads:
        bwd_queue.setdefault(slot[i], []).append(i)

    def mode(i: int) -> str:
        """The forward mode of unit i: what its checkpoint placement keeps (ir/program.py ForwardMode)."""
        return "keep" if place[i] == "keep" else "rebuild" if place[i] == "rebuild" else "replay" if rep[i] else "plain"

    def load(i: int) -> None:
        if compute_only:
            return
        k = slot[i]
        ops.append(Op("load_params", "h2d", unit=units[i].name, slot=k, writes=(f"slot{k}",)))

    def device_step(i: int) -> Op:
        u, g = units[i], order.grad_slot[i]
        return Op("device_step", "compute", unit=u.name, slot=slot[i], grad_slot=g, reads=(f"grad{g}",),
                  writes=(f"slot{slot[i]}", f"dstate.{u.name}"), workspace_bytes=device_step_workspace(u))

    def reads(i: int, mb: int, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
        u = units[i]
        r = [f"slot{slot[i]}", carry(u.name, mb) if u.carry_in else "batch", *extra]
        if u.kind == "block":
            r.append("rope")
        if i == last and u.carry_in:
            r.append("batch")
        return tuple(r)

    for i in sorted([q.pop(0) for q in fwd_queue.values()] + [i for i in order.forward[:2] if state_of(i) == "weights"]):
        load(i)
    # NOTE: an offloaded attention record is freed after the next forward, not right after its own: freeing
    # it waits for its copy, which leaves just after the forward that made it, and the compute stream would
    # idle through that wait (on the 2-core sim device, at each unit's last micro-batch, while the next unit's
    # load took the other core). One more record is alive during that forward; the timeline counts it.
    deferred: list[Op] = []
    for p, i in enumerate(order.forward):
        u = units[i]
        keep, rebuild = place[i] == "keep", place[i] == "rebuild"
        nxt = order.forward[p + 1] if i != last else None
        if i in ahead:
            load(ahead[i])
        for mb in mbs:
            writes = ["loss" if nxt is None else carry(units[nxt].name, mb)]
            if keep:
                writes.append(saved(u.name, mb))
            if rebuild:
                writes.append(side(u.name, mb))
            if rep[i]:
                writes.append(attn(u.name, mb))
            # NOTE: a replaying forward's workspace is its plain one, an upper bound: the record it keeps is
            # allocated inside the forward and counted again as the attention buffer
            ops.append(Op("forward", "compute", unit=u.name, mb=mb, slot=slot[i], mode=mode(i),
                          reads=reads(i, mb), writes=tuple(writes), workspace_bytes=u.peak_fwd_bytes))
            ops += deferred
            deferred = []
            if nxt is not None and place[nxt] == "host" and not compute_only:
                buf = carry(units[nxt].name, mb)
                ops.append(Op("offload_act", "d2h", buffer=buf, reads=(buf,), writes=(f"host:{buf}",)))
            if rep[i] and place[i] == "host":  # the record leaves with the checkpoint
                buf = attn(u.name, mb)
                if not compute_only:
                    ops.append(Op("offload_act", "d2h", buffer=buf, reads=(buf,), writes=(f"host:{buf}",)))
                # NOTE: deferred in the compute-only lowering too: the placement search's exact timeline must
                # hold the record through the next forward as the program does, or it accepts plans over budget
                deferred.append(Op("free", "compute", buffer=buf))
            if u.carry_in and place[i] in ("host", "rebuild"):
                ops.append(Op("free", "compute", buffer=carry(u.name, mb)))
        if i not in order.resident and fwd_queue.get(slot[i]):
            load(fwd_queue[slot[i]].pop(0))
    ops += deferred

    def reload(i: int) -> None:
        u = units[i]
        if not u.carry_in or place[i] != "host":
            return
        bufs = [carry(u.name, mb) for mb in mbs] + ([attn(u.name, mb) for mb in mbs] if rep[i] else [])
        for buf in bufs:
            ops.append(Op("alloc", "compute", buffer=buf))
        for buf in bufs if not compute_only else ():
            ops.append(Op("load_act", "h2d", buffer=buf, reads=(f"host:{buf}",), writes=(buf,)))

    bwd = order.backward
    after = dict(zip(order.forward, order.forward[1:]))
    reload(bwd[0])
    for j, i in enumerate(bwd):
        u = units[i]
        if j + 1 < len(bwd):
            reload(bwd[j + 1])
        g = order.grad_slot[i]
        keep, rebuild = place[i] == "keep", place[i] == "rebuild"
        up = after.get(i)
        # a unit that rebuilds its carry-in reads the next unit's, which then lives until this backward
        held = i > 0 and place[i - 1] == "rebuild"
        for mb in mbs:
            extra = ((saved(u.name, mb),) if keep else ()) + ((dcarry(units[up].name, mb),) if up is not None else ())
            if rebuild:
                extra += (carry(units[up].name, mb), side(u.name, mb))
            if rep[i]:
                extra += (attn(u.name, mb),)
            writes = (f"grad{g}",) + ((dcarry(u.name, mb),) if u.carry_in else ())
            ws = max(0, u.peak_bwd_bytes - u.saved_bytes) if keep else u.peak_bwd_bytes
            if rep[i]:
                ws = u.peak_bwd_replay_bytes
            if rebuild:
                writes = (carry(u.name, mb), *writes)
                ws = max(ws, u.peak_fwd_bytes)
            r = reads(i, mb, extra)
            if rebuild:  # it writes its carry-in rather than reading it
                r = tuple(x for x in r if x != carry(u.name, mb))
            ops.append(Op("backward", "compute", unit=u.name, mb=mb, slot=slot[i], grad_slot=g,
                          source=SOURCE_OF[mode(i)], accumulate=mb > 0, norm=mb == order.micro_batches - 1,
                          reads=r, writes=writes, workspace_bytes=ws))
            if up is not None:
                ops.append(Op("free", "compute", buffer=dcarry(units[up].name, mb)))
            if rebuild:
                ops.append(Op("free", "compute", buffer=carry(units[up].name, mb)))
                ops.append(Op("free", "compute", buffer=side(u.name, mb)))
            if u.carry_in and not held:
                ops.append(Op("free", "compute", buffer=carry(u.name, mb)))
            if keep:
                ops.append(Op("free", "compute", buffer=saved(u.name, mb)))
            if rep[i]:
                ops.append(Op("free", "compute", buffer=attn(u.name, mb)))
        if state_of(i) == "device":
            if not compute_only:
                ops.append(Op("store_norms", "d2h", unit=u.name, grad_slot=g, reads=(f"grad{g}",)))
            if not clip:
                ops.append(device_step(i))
            continue
        if compute_only:
            continue
        ops.append(Op("store_grads", "d2h", unit=u.name, grad_slot=g, host_grad=hgrad[i], reads=(f"grad{g}",)))
        if not clip and j < split:
            ops.append(Op("optimizer_step", "host", unit=u.name, host_grad=hgrad[i]))
        if bwd_queue.get(slot[i]):
            load(bwd_queue[slot[i]].pop(0))
    if compute_only:
        return ops + ([device_step(i) for i in order.forward if state_of(i) == "device"] if clip else [])
    if clip:
        ops.append(Op("clip_grads", "host"))
        ops += [device_step(i) for i in order.forward if state_of(i) == "device"]
    stepped = (set() if clip else set(bwd[:split])) | {i for i in order.forward if state_of(i) == "device"}
    for i in order.forward:
        if i not in stepped:
            ops.append(Op("optimizer_step", "host", unit=units[i].name, host_grad=hgrad[i]))
    return ops
