"""The placement search: slots, gradient slots and per-unit checkpoint placement under the GPU budget.

Where it sits: the `checkpoints` pass (passes.py) calls `search`; the `slots` pass calls `minimal` to
find the smallest budget that works. Try it: `pytest tests/planner/test_placement.py -q`.

Algorithm: greedy on a multiple-choice knapsack. Start from the minimal-memory schedule (one parameter slot,
one gradient slot, every checkpoint on host), then repeatedly take the move with the most predicted seconds
saved per device byte: a checkpoint host -> device (no offload/reload traffic), device or host -> keep (no
recompute), host -> rebuild and then rebuild -> device or keep (a unit that can rebuild its carry-in from its
carry-out, DepthSSD's, keeps only its sub-layer inputs: fewer bytes than its carry, no traffic, one more
forward in backward), one more parameter slot (one less backward reload, and prefetch), a second gradient slot (the
store of unit u overlaps the backward of u-1). A move is accepted when the bound `peak + its bytes` fits, or
else when the exact peak of the lowered program fits; the search stops after 6 rejected moves.
Why: the cost is nearly separable per unit and units are small against the budget, so greedy by ratio is
within one item of the LP optimum, runs in O(N^2) cheap steps (milliseconds at 120B), and every accepted
state is checked against the exact memory timeline. Once a move does not fit, no larger move is tried (so a
rejected checkpoint -> keep does not crowd out a cheaper rebuild elsewhere). A DP over bytes or a MILP (Checkmate) would cost
seconds for a gain the homogeneous blocks of a transformer do not leave room for.

The predicted seconds come from an analytic per-phase roofline over costs.py's op prices: forward =
max(compute, h2d, d2h) (their sum with one slot), backward likewise plus serialisation when one gradient
slot or one parameter slot forbids overlap, plus the host optimizer (overlapped, docs/DESIGN.md 4.5). Only moves
that save predicted time are taken: budget beyond that stays free (a host-bound 70B step at 8k context is
as fast in 23 GiB as in 80), which is what a user sizing a GPU wants to see. The exception is double
buffering: a slot or gradient-slot move also counts a hundredth of the GPU-side time it saves, because when
the host optimizer bounds the step this roofline cannot see the pipeline bubbles that serialisation causes
(dense-120b on an H200 with one gradient slot: 34 s a step, not 25). The plan's reported step time comes
from the exact DAG (estimate.py), not from this model.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.ir.model_ir import ModelIR

from .bytesize import format_bytes
from .costs import CostModel
from .schedule import Decisions, buffer_specs, can_rebuild, grad_slot_bytes, lower_ops, make_order, slot_bytes
from .timeline import Timeline, walk

MAX_REJECTIONS = 6


def minimal(ir: ModelIR, state: tuple[str, ...] = ()) -> Decisions:
    """The least-memory schedule: one slot, one gradient slot, every checkpoint on host (with the units' state
    places `state`, Decisions.state)."""
    return Decisions(1, 1, tuple("host" if u.carry_in else "device" for u in ir.units), state=tuple(state))


def exact_timeline(ir: ModelIR, n_micro: int, dec: Decisions, clip: bool) -> Timeline:
    """The device timeline of the lowered program (sync ops add no memory, so they are not needed)."""
    specs = buffer_specs(ir, n_micro, dec)
    ops = lower_ops(ir, make_order(len(ir.units), n_micro, dec), dec.placement, clip, compute_only=True,
                    replay=dec.replay)
    return walk(ops, {s[0]: s[2] for s in specs}, [s[0] for s in specs if s[3]])


@dataclass(frozen=True)
class _Move:
    kind: str  # "ckpt" | "slot" | "grad"
    unit: int
    to: str
    nbytes: int  # device bytes it holds across the step (what the ratio divides by)
    bound: int | None = None  # the most it can raise the peak, when not nbytes (a record in flight)


class _Model:
    """The analytic step-time model, on sums that moves change in O(1)."""

    def __init__(self, ir: ModelIR, costs: CostModel, n_micro: int, clip: bool, state: tuple[str, ...] = ()):
        K, c = n_micro, costs
        self.n, self.clip = len(ir.units), clip
        where = [state[i] if state else "host" for i in range(self.n)]
        host = [i for i in range(self.n) if where[i] == "host"]
        dev = [i for i in range(self.n) if where[i] == "device"]
        self.n_host = len(host)  # the units the shared slots rotate among
        self.cf = sum(K * f for f in c.fwd)
        # a device unit is stepped on the compute stream, its norms cross d2h; it is never loaded nor stored
        self.cb0 = sum(K * b for b in c.bwd) + sum(c.dstep[i] for i in dev)
        self.load_prefix = [0.0]  # over the streamed units, whose last S stay resident for the backward
        for i in host:
            self.load_prefix.append(self.load_prefix[-1] + c.load[i])
        self.load_f = sum(c.load[i] for i in range(self.n) if where[i] != "device")
        self.store = sum(c.store[i] for i in range(self.n) if where[i] != "device") + sum(c.norms_copy[i] for i in dev)
        self.tail = c.dstep[0] if where[0] == "device" else c.store[0] + c.opt[0] + c.load[0]
        self.opt = sum(c.opt[i] for i in range(self.n) if where[i] != "device")
        self.clip_s = c.clip if clip else 0.0
        self.rec = [K * f for f in c.recompute]
        self.off = [K * o for o in c.offload]
        self.on = [K * r for r in c.reload]
        # a replaying unit's recompute skips its attention; on host its record crosses the link with it
        self.rsave = [K * x for x in c.replay_saves]
        self.off_r = [K * o for o in c.offload_replay]
        self.on_r = [K * r for r in c.reload_replay]

    def time(self, S: int, G: int, rec: float, off: float, on: float) -> tuple[float, float]:
        """(predicted step, its GPU-side part)."""
        load_b = self.load_prefix[max(0, self.n_host - S)]
        F = max(self.cf + self.load_f, off) if S == 1 else max(self.cf, self.load_f, off)
        Bc = self.cb0 + rec + (self.store if G == 1 else 0.0) + (load_b if S == 1 else 0.0)
        B = max(Bc, load_b + on, self.store)
        gpu = F + B + self.tail + self.clip_s
        host = self.opt + (B if self.clip else 0.0)
        return max(gpu, host), gpu

    def rec_of(self, i: int, place: str, replay: bool) -> float:
        """Backward recompute seconds of unit i's checkpoint state: keep recomputes nothing, rebuild one
        forward more than device or host, a replaying one its forward less the attention."""
        if place == "keep":
            return 0.0
        if place == "rebuild":
            return 2 * self.rec[i]
        return self.rec[i] - (self.rsave[i] if replay else 0.0)

    def link_of(self, i: int, place: str, replay: bool) -> tuple[float, float]:
        """(offload, reload) seconds of unit i's checkpoint state."""
        if place != "host":
            return 0.0, 0.0
        return self.off[i] + (self.off_r[i] if replay else 0.0), self.on[i] + (self.on_r[i] if replay else 0.0)


# checkpoint states a move may go to, in the order ties are broken: (placement, replay)
_TARGETS = (("device", False), ("keep", False), ("rebuild", False), ("host", True), ("device", True))


def _label(place: str, replay: bool) -> str:
    return place + ("+replay" if replay else "")


def _state(label: str) -> tuple[str, bool]:
    return label.removesuffix("+replay"), label.endswith("+replay")


def search(ir: ModelIR, costs: CostModel, n_micro: int, clip: bool, device_budget: int,
           host_budget: int, state: tuple[str, ...] = ()) -> tuple[Decisions, list[str], Timeline]:
    """Decisions minimising predicted step time with exact peak <= device_budget and host checkpoints
    <= host_budget, the decision lines, and the decisions' exact timeline. Its peak exceeds device_budget
    only when host memory forced checkpoints onto a GPU that cannot hold them (the pass reports that).
    `state`: each unit's state place (Decisions.state), kept: the dedicated slots of units not on the host are
    in every candidate's exact peak, the shared slots rotate among the host units, and the caller leaves the
    device units' `dstate` bytes out of `device_budget`."""
    K, n = n_micro, len(ir.units)
    state = tuple(state) if any(p != "host" for p in state) else ()
    model = _Model(ir, costs, K, clip, state)
    S, G = 1, 1
    place = list(minimal(ir, state).placement)
    rep = [False] * n
    sb, gb = slot_bytes(ir, state), grad_slot_bytes(ir, state)
    cin = [K * u.carry_in_bytes for u in ir.units]
    sav = [K * u.saved_bytes for u in ir.units]
    side = [K * (u.rebuild_bytes or 0) for u in ir.units]
    rb = [K * u.replay_bytes for u in ir.units]
    rebuildable = [can_rebuild(ir, i) for i in range(n)]
    replayable = [bool(u.replay) and bool(u.carry_in) for u in ir.units]
    lines: list[str] = []

    def dev_bytes(i: int, p: str, r: bool) -> int:
        """Device bytes unit i's checkpoints hold across the step in state (p, r)."""
        return {"host": 0, "device": cin[i] + (rb[i] if r else 0), "keep": cin[i] + sav[i], "rebuild": side[i]}[p]

    def host_of(i: int, p: str, r: bool) -> int:
        return cin[i] + (rb[i] if r else 0) if p == "host" else 0

    rec = sum(model.rec_of(i, place[i], False) for i in range(n))
    off = sum(model.link_of(i, place[i], False)[0] for i in range(n))
    on = sum(model.link_of(i, place[i], False)[1] for i in range(n))
    host = sum(host_of(i, place[i], False) for i in range(n))

    def decisions() -> Decisions:
        return Decisions(S, G, tuple(place), replay=tuple(rep) if any(rep) else (), state=state)

    tl = exact_timeline(ir, K, decisions(), clip)
    peak = tl.peak
    for i in range(n - 1, 0, -1):  # host memory too small for every checkpoint: keep the latest on device
        if host <= host_budget:
            break
        if place[i] == "host":
            place[i] = "device"
            off, on, host = off - model.off[i], on - model.on[i], host - cin[i]
    if place != list(minimal(ir, state).placement):
        tl = exact_timeline(ir, K, decisions(), clip)
        peak = tl.peak
        lines.append(f"host memory holds {format_bytes(host_budget)} of checkpoints: "
                     f"{place.count('device') - 1} kept on device instead")
    t0, gpu0 = model.time(S, G, rec, off, on)
    lines.insert(0, "algorithm: greedy multiple-choice knapsack, most predicted seconds saved per device byte "
                 "first, each move checked against the exact memory timeline (near the LP optimum for many "
                 "small homogeneous units; milliseconds where a DP or MILP takes seconds)")
    lines.append(f"start: 1 slot, 1 gradient slot, checkpoints on host: exact peak {format_bytes(peak)} of "
                 f"{format_bytes(device_budget)} for the program; analytic step {t0:.4g} s")

    def candidates():
        if S < model.n_host:
            yield _Move("slot", -1, "", sb)
        if G < 2:
            yield _Move("grad", -1, "", gb)
        for i in range(n - 1, 0, -1):
            if not ir.units[i].carry_in:
                continue
            cur = (place[i], rep[i])
            for p, r in _TARGETS:
                if (p, r) == cur or (p == "rebuild" and not rebuildable[i]) or (r and not replayable[i]):
                    continue
                nb = dev_bytes(i, p, r) - dev_bytes(i, *cur)
                if nb < 0 or host - host_of(i, *cur) + host_of(i, p, r) > host_budget:
                    continue
                # a record offloaded with its checkpoint holds the device only while it crosses the link
                yield _Move("ckpt", i, _label(p, r), nb, rb[i] if (p, r) == ("host", True) else None)

    def sums_after(m: _Move) -> tuple[float, float, float, int]:
        i, (p, r) = m.unit, _state(m.to)
        o0, a0 = model.link_of(i, place[i], rep[i])
        o1, a1 = model.link_of(i, p, r)
        return (rec - model.rec_of(i, place[i], rep[i]) + model.rec_of(i, p, r), off - o0 + o1, on - a0 + a1,
                host - host_of(i, place[i], rep[i]) + host_of(i, p, r))

    def after(m: _Move) -> tuple[float, float]:
        if m.kind == "slot":
            return model.time(S + 1, G, rec, off, on)
        if m.kind == "grad":
            return model.time(S, G + 1, rec, off, on)
        r, o, a, _ = sums_after(m)
        return model.time(S, G, r, o, a)

    rejected: set[_Move] = set()
    too_big = device_budget + 1  # a move this large did not fit: larger ones are not tried
    taken: dict[str, list] = {}
    t, gpu = t0, gpu0
    while len(rejected) < MAX_REJECTIONS:
        best, best_ratio = None, 0.0
        for m in candidates():
            if m in rejected or m.nbytes >= too_big:
                continue
            t_m, gpu_m = after(m)
            gain = t - t_m + (0.01 * (gpu - gpu_m) if m.kind != "ckpt" else 0.0)
            if gain <= 1e-12 * t:
                continue
            ratio = gain / max(m.nbytes, 1)
            if best is None or ratio > best_ratio * (1 + 1e-9):
                best, best_ratio = m, ratio
        if best is None:
            break
        new_t, new_gpu = after(best)
        # a rebuild also holds the next carry-in longer in backward: its bytes are no bound, check exactly
        bound = best.nbytes if best.bound is None else best.bound
        if best.to == "rebuild" or peak + bound > device_budget:
            trial = _apply(best, S, G, place, rep, state)
            tl_try = exact_timeline(ir, K, trial, clip)
            if tl_try.peak > device_budget:
                rejected.add(best)
                if best.bound is None:  # a transient record's bytes say nothing of the others'
                    too_big = min(too_big, best.nbytes)
                if len(rejected) == 1 or len(rejected) == MAX_REJECTIONS:
                    lines.append(f"{_describe(best, ir)} does not fit: exact peak {format_bytes(tl_try.peak)}")
                continue
            tl, peak = tl_try, tl_try.peak
        else:
            peak += bound
            tl = None
        was = ""
        if best.kind == "ckpt":
            i = best.unit
            was = _label(place[i], rep[i])
            rec, off, on, host = sums_after(best)
            place[i], rep[i] = _state(best.to)
        S, G = (S + 1, G) if best.kind == "slot" else ((S, G + 1) if best.kind == "grad" else (S, G))
        key = f"{best.kind} {'' if best.kind != 'ckpt' else was + ' -> ' + best.to}"
        entry = taken.setdefault(key, [0, 0, 0.0, [], 0.0])
        entry[0] += 1
        entry[1] += best.nbytes
        entry[2] += t - new_t
        entry[4] += gpu - new_gpu
        entry[3].append(ir.units[best.unit].name if best.unit >= 0 else "")
        t, gpu = new_t, new_gpu
    for key, (count, nbytes, gain, names, gpu_gain) in taken.items():
        what = _group(key, count, names)
        side_note = f" (GPU side {gpu_gain * 1e3:.4g} ms)" if key.split()[0] != "ckpt" else ""
        lines.append(f"{what}: {gain * 1e3:.4g} ms saved (analytic){side_note} for {format_bytes(nbytes)}")
    dec = decisions()
    if tl is None:
        tl = exact_timeline(ir, K, dec, clip)
    lines.append(f"final: {S} parameter slots (prefetch distance {S - 1}), {G} gradient slot(s); checkpoints "
                 f"{place.count('device') - (0 if ir.units[0].carry_in else 1)} device, {place.count('host')} host, "
                 f"{place.count('keep')} keep{_rebuilds(place)}{_replays(rep)}; exact peak {format_bytes(tl.peak)}; "
                 f"analytic step {t:.4g} s")
    return dec, lines, tl


def analytic_time(ir: ModelIR, costs: CostModel, n_micro: int, clip: bool, dec: Decisions) -> float:
    """The search's analytic step time of decisions `dec` (for comparing the searches of other IRs)."""
    model = _Model(ir, costs, n_micro, clip, dec.state)
    states = [(p, dec.replays(i)) for i, p in enumerate(dec.placement)]
    rec = sum(model.rec_of(i, p, r) for i, (p, r) in enumerate(states))
    off = sum(model.link_of(i, p, r)[0] for i, (p, r) in enumerate(states))
    on = sum(model.link_of(i, p, r)[1] for i, (p, r) in enumerate(states))
    return model.time(dec.n_slots, dec.n_grad_slots, rec, off, on)[0]


def _rebuilds(place: list[str]) -> str:
    n = place.count("rebuild")
    return f", {n} rebuild" if n else ""


def _replays(rep: list[bool]) -> str:
    n = sum(rep)
    return f", {n} replaying attention" if n else ""


def _apply(m: _Move, S: int, G: int, place: list[str], rep: list[bool], state: tuple[str, ...] = ()) -> Decisions:
    if m.kind == "slot":
        S += 1
    elif m.kind == "grad":
        G += 1
    p, r = list(place), list(rep)
    if m.kind == "ckpt":
        p[m.unit], r[m.unit] = _state(m.to)
    return Decisions(S, G, tuple(p), replay=tuple(r) if any(r) else (), state=state)


def _describe(m: _Move, ir: ModelIR) -> str:
    if m.kind == "ckpt":
        return f"next move ({ir.units[m.unit].name} -> {m.to}, {format_bytes(m.nbytes)})"
    return f"next move (one more {'parameter' if m.kind == 'slot' else 'gradient'} slot, {format_bytes(m.nbytes)})"


def _group(key: str, count: int, names: list[str]) -> str:
    kind = key.split()[0]
    if kind == "slot":
        return f"+{count} parameter slot(s)"
    if kind == "grad":
        return f"+{count} gradient slot(s)"
    shown = names[0] if count == 1 else f"{count} units ({names[-1]} .. {names[0]})"
    return f"checkpoint {key.split(' ', 1)[1]}: {shown}"
