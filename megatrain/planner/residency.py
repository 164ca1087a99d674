"""Per-unit state placement (issue 40): which units' state may live on the device, and what it holds there.

Where it sits: the schedule (schedule.py) lowers a unit's place ("host", "weights", "device", Decisions.state);
the buffers pass sizes each device unit's `dstate.{unit}` with `device_state_bytes`, which the runtime
(runtime/resident.py) allocates to the byte; `plan(resident=...)` (passes.py) checks a requested place with
`can_reside`. Try it: `python -c "from megatrain.planner.residency import device_state_layout; help(device_state_layout)"`.

A "device" unit's state on the device, in `device_state_layout` order: its fp32 master (only when the compute
dtype is not fp32: an fp32 unit's parameter slot is its master), both AdamW moments in the host policy's
moment dtype (fp8: then the per-block scales), and the AdamW step counts of its owned parameters. The host
store keeps the same state as the unit's checkpoint mirror (runtime/store.py), so host bytes do not change.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from megatrain.ir.model_ir import ModelIR, UnitIR

from .bytesize import format_bytes
from .host_policy import FP8_BLOCK, HostPolicy, resolve
from .schedule import STEP_CHUNK, device_step_workspace

__all__ = ["PLACES", "STEP_CHUNK", "DEVICE_POLICIES", "device_state_layout", "device_state_bytes",
           "device_step_workspace", "can_reside", "check_places", "choose_auto"]

PLACES = ("host", "weights", "device")
# the host policies a device-resident unit may step under: the compressed ones' moment rounding reads the step
# count on the host (a device sync inside the step), so they stay host-only for now
DEVICE_POLICIES = ("exact",)


def device_state_layout(unit: UnitIR, policy: HostPolicy | str, dtype: str) -> list[tuple[str, str, int]]:
    """(name, dtype, elements) of each tensor of a device unit's `dstate.{unit}`, in order."""
    pol = resolve(policy)
    n = unit.host_numel
    owned = [p for p in unit.params if p.name not in unit.tied]
    out = [("master", "float32", n)] if dtype != "float32" else []
    out += [("exp_avg", pol.moments, n), ("exp_avg_sq", pol.moments, n)]
    if pol.moments == "fp8":
        out.append(("scales", "float32", 2 * sum(math.ceil(p.numel / FP8_BLOCK) for p in owned)))
    out.append(("steps", "float32", len(owned)))
    return out


_BYTES = {"float32": 4, "bfloat16": 2, "fp8": 1}


def device_state_bytes(unit: UnitIR, policy: HostPolicy | str, dtype: str) -> int:
    """Bytes of a device unit's `dstate.{unit}` (the runtime allocates exactly these)."""
    return sum(_BYTES[dt] * n for _, dt, n in device_state_layout(unit, policy, dtype))


def can_reside(ir: ModelIR, i: int) -> str | None:
    """None when unit i's state may live on the device ("weights" or "device"); else why not, one line."""
    u = ir.units[i]
    if u.tied:
        return f"unit {u.name} holds tied parameters ({', '.join(sorted(u.tied))}) whose master lives in another unit"
    if any(dst == u.name or src == u.name for src, dst, kind in ir.edges if kind == "tied"):
        return f"unit {u.name} owns parameters another unit holds a tied copy of (their gradients meet on the host)"
    if u.buffers:
        return (f"unit {u.name} has buffers (MoE routing state) updated on the host after its step; "
                "a device step does not update them")
    return None


def check_places(ir: ModelIR, places: dict[str, str], policy: HostPolicy | str | None = None,
                 world_size: int = 1) -> tuple[str, ...]:
    """Per unit (depth order) the place a `plan(resident=mapping)` asks for, units not named "host"; raises
    ValueError in one line naming the unit or place at fault. Any `world_size` runs them: in a world a device
    unit holds its rank's shard (collectives.py), and the units can_reside admits are never replicated."""
    names = [u.name for u in ir.units]
    for name, place in places.items():
        if name not in names:
            raise ValueError(f"resident names unit {name!r}, which {ir.model} does not have; its units: "
                             f"{names[0]} .. {names[-1]}")
        if place not in PLACES:
            raise ValueError(f"resident[{name!r}] = {place!r}; a unit's state place is one of {', '.join(PLACES)}")
    state = tuple(places.get(n, "host") for n in names)
    for i, place in enumerate(state):
        if place != "host" and (why := can_reside(ir, i)) is not None:
            raise ValueError(f"{why}: it cannot be {place!r}; leave it on the host (resident={{{names[i]!r}: 'host'}})")
    if "device" in state and policy is not None and resolve(policy).name not in DEVICE_POLICIES:
        raise ValueError(f"a unit stepped on the device runs the {', '.join(DEVICE_POLICIES)} host policy only, "
                         f"not {resolve(policy).name}: plan with host_policy='exact' (--host-policy exact) or "
                         "without device-resident units")
    return state


# -- the auto choice (the `residency` pass, passes.py) ----------------------------------------------------------
# A candidate is a count of units taken in a benefit order and given "device"; the most that fit beside a
# double-buffered least-memory schedule are priced by the estimator on the program the schedule passes make
# of them (so the checkpoint search spends what is left: the choice is joint with it), against every unit
# streamed. The orders come from where the host's steps sit on the critical path: the host steps units as
# their gradients land (the head first) and then, after the backward, in forward order while the next forward
# waits for each (embed first). "head first": the head (whose step opens the host's sequence), then embed,
# blocks.0, ...; "forward": embed, blocks.0, ... (the steps the next forward waits for, first to last), the
# head last. Where the link binds the best of those, the units left streaming are given "weights" (loaded once
# a step, not reloaded for the backward: 2 B/param in bf16) as far as they fit, and priced once more; where the
# link binds every unit streamed, "weights" alone for as many units as fit is a candidate too (a unit's device
# state costs some 9 times its weights' bytes for twice the loads saved). In a data-parallel world a rank holds
# its shard of each device unit's state (1/R of it) beside its whole slots, so more units fit, and the
# candidates are priced with its shard-sized host steps, loads and stores and the collectives.
MIN_GAIN = 0.005  # a placement must shorten the predicted step by more than this to be kept
# The two orders' sets differ by one unit (the head for the last block the other takes). Where the units that
# fit are at most one in FEW of the model's, that swap moves the step little against the cost of pricing a
# second program (docs/RESULTS.md, resident units): only the first order is priced.
FEW = 8
# Where the GPU binds with the most that fit, a bisection on the count (between all streamed, which the host or
# the link binds, and that) for where the GPU starts to bind: at most this many more pricings
REFINE = 4
# the bottlenecks a unit's weights kept on the device relieve: its backward reload, and in a world the all_gather
# that completes it
LINK = ("h2d", "collectives")
# below this fraction of the compute a step's host AdamW and link work stay hidden however they pipeline (the
# estimator is not asked); above it the pipeline's bubbles can bind before the sums do
SCREEN = 0.5


@dataclass(frozen=True)
class Trial:
    """A candidate placement as the estimator priced it; step_s None: it does not fit the budget."""

    state: tuple[str, ...]
    step_s: float | None
    bottleneck: str = ""
    share: float = 0.0
    scheduled: object = None  # what the pass that priced it keeps for the pipeline (passes.py State.scheduled)


def benefit_orders(ir: ModelIR) -> dict[str, tuple[int, ...]]:
    """Units that may reside, in each order a count of them is taken in."""
    n = len(ir.units)
    ok = [i for i in range(n) if can_reside(ir, i) is None]
    body = [i for i in ok if i != n - 1]
    head = [n - 1] if n - 1 in ok else []
    orders = {"head first": tuple(head + body), "forward": tuple(body + head)}
    return {k: v for k, v in orders.items() if v}


def resident_bytes(u: UnitIR, place: str, policy: HostPolicy | str, dtype: str, ranks: tuple[ModelIR, ...] = ()) -> int:
    """Device bytes a unit's place holds for the whole run: its dedicated parameter slot, and for "device" its
    gradient slot (as schedule.unit_grad_bytes) and `dstate.{unit}`. In a data-parallel world (`ranks`: each
    rank's view, world.rank_ir) the slots stay whole (the all_gather completes the weights in one, the
    reduce_scatter reads the whole gradient from the other) but `dstate` is the rank's shard's: the most any
    rank holds (their slices' step counts differ), as passes._dstate_bytes sizes it."""
    if place == "host":
        return 0
    out = u.slot_bytes(dtype)
    if place == "device":
        shards = [r.units[u.index] for r in ranks] or [u]
        out += (u.flat_numel + len(u.params)) * 4 + max(device_state_bytes(v, policy, dtype) for v in shards)
    return out


def _largest(count: int, fits: Callable[[int], bool]) -> int:
    """The largest r in [0, count] with fits(r), fits being monotone (true up to some r); fits(0) is assumed."""
    lo, hi = 0, count
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def choose_auto(ir: ModelIR, costs, policy: HostPolicy | str, n_micro: int, why_not: str | None,
                fits: Callable[[tuple[str, ...]], bool],
                evaluate: Callable[[tuple[str, ...]], Trial], ranks: tuple[ModelIR, ...] = ()) -> tuple[Trial | None, list[str]]:
    """The priced placement auto chooses (its state per unit in depth order, () for every unit streamed; None
    when nothing was priced: every unit streamed), and the decision lines.
    `fits(state)`: the double-buffered least-memory schedule with `state` fits the budget; `evaluate(state)`:
    the estimator's step of the program the schedule passes make with `state` (step_s None when it fits not).
    In a data-parallel world `costs` are one rank's (shard-sized loads, stores and host steps, the collectives)
    and `ranks` each rank's view of the IR (world.rank_ir): only the bytes the lines print read them, `fits`
    and `evaluate` size a device unit's state per rank themselves."""
    if why_not is not None:
        return None, [f"auto: every unit streamed: {why_not}"]
    n, K, c = len(ir.units), n_micro, costs
    host_s, link_s = sum(c.opt), sum(c.load) + sum(c.store)
    # a world's rank gathers each streamed unit for both passes and reduces its gradient once
    comm_s = 2 * sum(getattr(c, "gather", ())) + sum(getattr(c, "reduce", ()))
    gpu_s = sum(K * (c.fwd[i] + c.backward(i, False)) for i in range(n))
    if max(host_s, link_s, comm_s) <= SCREEN * gpu_s:
        comm = f", {comm_s:.4g} s of collectives" if comm_s else ""
        return None, [f"auto: every unit streamed: compute binds ({gpu_s:.4g} s a step against {host_s:.4g} s of host "
                      f"AdamW and {link_s:.4g} s of loads and stores{comm}): a unit's state on the device would save "
                      "nothing on the critical path"]
    orders = benefit_orders(ir)
    if not orders:
        return None, ["auto: every unit streamed: no unit may hold its state on the device (tied parameters or "
                      "host-updated buffers)"]
    base = evaluate(())
    lines = [f"all streamed: step {base.step_s:.4g} s, bottleneck {base.bottleneck} {base.share:.0%}"]

    def placed(order: tuple[int, ...], r: int, place: str = "device", under: tuple[str, ...] = ()) -> tuple[str, ...]:
        state = list(under or ("host",) * n)
        for i in order[:r]:
            state[i] = place
        return tuple(state)

    def weights_on(under: tuple[str, ...]) -> tuple[int, Trial | None]:
        """The units streaming under `under` given "weights", depth order (the first are those the backward
        reloads: the last stay resident across the turn), as many as fit, priced."""
        rest = tuple(i for i in range(n) if under[i] == "host" and can_reside(ir, i) is None)
        w = _largest(len(rest), lambda r: fits(placed(rest, r, "weights", under)))
        return w, (evaluate(placed(rest, w, "weights", under)) if w else None)

    trials: dict[tuple[str, ...], tuple[str, Trial]] = {}
    counts: dict[str, int] = {}
    for name, order in orders.items():
        r = counts[name] = _largest(len(order), lambda r, order=order: fits(placed(order, r)))
        if r == 0:
            continue
        state = placed(order, r)
        if state not in trials:
            trials[state] = (name, evaluate(state))
        if r * FEW <= n:  # the other order swaps one unit of these few: not worth a pricing (see FEW)
            break
    for state, (name, t) in trials.items():
        lines.append(f"{name} order, the most that fit ({state.count('device')} device): " + _priced(t))
    chosen: list[tuple[str, tuple[str, ...], Trial]] = []  # (what, state, trial) of each priced candidate kept
    if trials:
        best_state, (best_name, best) = min(trials.items(), key=lambda kv: kv[1][1].step_s or float("inf"))
        if best.bottleneck == "compute":  # the GPU binds with all that fit: fewer may do, leaving it their steps
            lo, hi, order = 0, counts[best_name], orders[best_name]
            for _ in range(REFINE):
                mid = (lo + hi) // 2
                if mid in (lo, hi):
                    break
                t = evaluate(placed(order, mid))
                lines.append(f"{best_name} order, {mid} device: " + _priced(t))
                if t.step_s is not None and t.step_s < best.step_s:
                    best_state, best = t.state, t
                lo, hi = (lo, mid) if t.bottleneck == "compute" else (mid, hi)
        if best.step_s is not None and best.bottleneck in LINK:
            w, t = weights_on(best_state)
            if t is not None:
                lines.append(f"the link binds: + {w} unit(s) weights only: " + _priced(t))
                if t.step_s is not None and t.step_s < best.step_s:
                    best_state, best = t.state, t
        chosen.append((f"the {best_name} order", best_state, best))
    if base.bottleneck in LINK:
        # a unit's weights kept take its backward reload (and in a world its second all_gather) off the link at 2
        # B/param of the device, where its state there takes both loads at some 18: where the link binds every
        # unit streamed, the units that fit as weights may save more than the fewer that fit as device
        w, t = weights_on(("host",) * n)
        if t is not None:
            lines.append(f"all streamed, {base.bottleneck} binds: {w} unit(s) weights only: " + _priced(t))
            chosen.append(("weights only", t.state, t))
    priced = [(what, st, t) for what, st, t in chosen if t.step_s is not None]
    if not chosen:
        first = ir.units[next(iter(orders.values()))[0]]
        return base, lines + [f"auto: every unit streamed: not even {first.name}'s state "
                              f"({format_bytes(resident_bytes(first, 'device', policy, ir.dtype, ranks))}) fits "
                              "beside a double-buffered least-memory schedule"]
    what, best_state, best = min(priced, key=lambda x: x[2].step_s) if priced else chosen[0]
    if best.step_s is None or best.step_s >= base.step_s * (1 - MIN_GAIN):
        return base, lines + [f"auto: every unit streamed: no placement that fits shortens the step by more than "
                              f"{MIN_GAIN:.1%}"]
    return best, lines + [f"chose {what}: step {best.step_s:.4g} s against {base.step_s:.4g} s "
                          f"all streamed ({base.step_s / best.step_s - 1:+.0%} tokens/s)"] + \
        why_lines(ir, costs, policy, best_state, ranks)


def _priced(t: Trial) -> str:
    return "does not fit once scheduled" if t.step_s is None else \
        f"step {t.step_s:.4g} s, bottleneck {t.bottleneck} {t.share:.0%}"


def why_lines(ir: ModelIR, costs, policy: HostPolicy | str, state: tuple[str, ...],
              ranks: tuple[ModelIR, ...] = ()) -> list[str]:
    """Per run of units with the same place: what each takes off the streams a step, and its device bytes (in a
    world, `ranks`, one rank's: its shard of a device unit's state)."""
    out, i, n = [], 0, len(ir.units)
    while i < n:
        j = i
        while j + 1 < n and state[j + 1] == state[i] and ir.units[j + 1].template == ir.units[i].template:
            j += 1
        place = state[i]
        if place != "host":
            u = ir.units[i]
            names = u.name if i == j else f"{u.name} .. {ir.units[j].name} ({j - i + 1})"
            nbytes = resident_bytes(u, place, policy, ir.dtype, ranks)
            if place == "device":
                what = (f"its host AdamW step ({costs.opt[i] * 1e3:.3g} ms), loads ({costs.load[i] * 1e3:.3g} ms each) "
                        f"and gradient store ({costs.store[i] * 1e3:.3g} ms) leave the host and the link; its step "
                        f"runs on the GPU ({costs.dstep[i] * 1e3:.3g} ms)")
            else:
                what = f"its backward reload ({costs.load[i] * 1e3:.3g} ms) leaves the link"
                if getattr(costs, "gather", None):  # a world's: the reload's all_gather goes with it
                    what += f", its second all_gather ({costs.gather[i] * 1e3:.3g} ms) the collectives"
            out.append(f"{names} {place}: {what}; {format_bytes(nbytes)} of the device each")
        i = j + 1
    return out
