"""The planner: one ordered pipeline of named passes, each a pure function that records its decisions.

Where it sits: `plan(ir, hardware, train, budget)` is the planner's entry point (docs/DESIGN.md 4.3); it runs
host_policy -> chunks -> slots -> cast_prices -> residency -> checkpoints -> order -> optimizer -> lower ->
collectives -> buffers -> sync -> cast -> verify -> estimate and assembles a Plan. The residency pass's "auto"
prices its candidates by running checkpoints .. sync itself (`_trial`); the pipeline goes on from its choice.
Try it: `megatrain plan --model tiny --hardware cpu --seq-len 128 --micro-batch 2 --explain`.

Each pass takes the pipeline state and returns a new one plus its decision lines; nothing is mutated.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Mapping

from megatrain.ir.model_ir import ModelIR
from megatrain.ir.program import Buffer, Instr, Program

from . import cast as cast_place
from .bytesize import format_bytes, parse_bytes
from .chunking import choose_chunk
from .collectives import cost_model, decision_lines, lower_collectives
from .costs import CostModel
from .errors import InfeasiblePlanError
from .estimate import estimate_time
from .hardware import Hardware, resolve_hardware
from .host_policy import PAGE, PIN_ALIGN, _suggest, checkpoint_buffers, checkpoint_host_bytes, choose
from .optimizer_order import choose_split
from .placement import exact_timeline, minimal, search
from .plan import PassRecord, Plan
from .report import plan_fields
from .residency import Trial, check_places, choose_auto, device_state_bytes
from .schedule import (
    Decisions,
    buffer_specs,
    check_model,
    grad_slot_bytes,
    lower_ops,
    make_order,
    slot_bytes,
)
from .state import State
from .sync import insert_sync
from .timeline import Timeline, live_at, program_timeline
from .train import TrainSpec
from .transfers import staging_bytes
from .verify import verify
from .world import World, rank_ir, world_ir

Pass = Callable[[State], tuple[State, list[str]]]


def host_policy_pass(s: State) -> tuple[State, list[str]]:
    """How the host holds the model state (host_policy.py): the named policy, or auto's choice; the host
    feasibility floor."""
    clip = s.barrier
    node = None
    if s.rank_irs:  # a node holds its ranks' shares: the floor of the node holding the most
        from .host_policy import floor_bytes

        L = s.world.ranks_per_node

        def node(p):
            per_rank = [floor_bytes(r, p, clip) for r in s.rank_irs]
            return max(sum(per_rank[n * L:(n + 1) * L]) for n in range(s.world.nnodes))
    choice = choose(s.ir, s.hw.host_memory_bytes, clip, s.host_request, node)
    return dataclasses.replace(s, policy=choice.policy, host_floor=choice.floor_bytes, host_reason=choice.reason,
                               costs=cost_model(s.ir, s.hw, choice.policy, clip, s.world)), list(choice.lines)


def residency_pass(s: State) -> tuple[State, list[str] | None]:
    """Where each unit's state lives (residency.py, docs/DESIGN.md 5): "none" keeps every unit streamed (and
    records nothing); a mapping forces the named units' places; "auto" is residency.choose_auto's choice."""
    req = s.resident_request
    if isinstance(req, str) and req == "none":
        return s, None
    if isinstance(req, str):
        if req != "auto":
            raise ValueError(f"resident={req!r}: pass 'none', 'auto' or a mapping of unit names to 'host', "
                             "'weights' or 'device'")
        chosen, lines = choose_auto(s.ir, s.costs, s.policy, s.train.grad_accum, _auto_refused(s),
                                    lambda st: _fits(s, st), lambda st: _trial(s, st), s.rank_irs)
        if chosen is not None:
            s = dataclasses.replace(s, scheduled=chosen.scheduled)
        state = () if chosen is None else chosen.state
    else:
        state = check_places(s.ir, dict(req), s.policy, s.world.nproc)
        lines = [f"requested: {', '.join(f'{u.name} {p}' for u, p in zip(s.ir.units, state) if p != 'host')}"]
    if not any(p != "host" for p in state):
        return s, lines
    dev = _dstate_bytes(s.ir, s.policy, state, s.rank_irs)
    if dev:
        lines.append(f"device state (master, moments, step counts): {format_bytes(sum(dev.values()))} for "
                     f"{len(dev)} unit(s), out of the device budget")
    return dataclasses.replace(s, state_place=state), lines


def _auto_refused(s: State) -> str | None:
    """Why auto keeps every unit streamed whatever the budget, or None. A data-parallel world is no reason: its
    ranks each hold their shard of a device unit's state (`_fits`, `_dstate_bytes`) and `_trial` prices the
    world's program (shard loads, the collectives) as it does a forced placement's."""
    if s.policy.name != "exact":
        return f"a device step runs the exact host policy's update only, not {s.policy.name}'s"
    return None


def _fits(s: State, state: tuple[str, ...]) -> bool:
    """The least-memory schedule with `state`, but double-buffered (two shared parameter slots and two shared
    gradient slots, what the step's overlap needs most), fits the device budget with the units' device state
    (in a world one rank's: its whole slots, its shard of the state)."""
    n_host = sum(p == "host" for p in state)
    dec = Decisions(2 if n_host > 1 else 1, 2, minimal(s.ir).placement, state=state)
    dstate = sum(_dstate_bytes(s.ir, s.policy, state, s.rank_irs).values())
    room = s.hw.device_bytes_for(s.budget) - s.device_reserve
    return exact_timeline(s.ir, s.train.grad_accum, dec, s.barrier).peak + dstate <= room


def _trial(s: State, state: tuple[str, ...]) -> Trial:
    """The estimator's step of the program the schedule passes (checkpoints .. sync) make with `state`, at the
    searched cast's prices; the run and its records ride along, so that plan() goes on from the chosen one."""
    t = dataclasses.replace(s, state_place=state)
    records: list[PassRecord] = []
    try:
        t = _run(t, records, PASSES[SCHEDULE:SYNCED])
    except InfeasiblePlanError:
        if "device" not in state and "weights" not in state:
            raise  # every unit streamed does not plan: the error plan() gives without the pass
        return Trial(state, None)
    est = estimate_time(t.program, t.costs)
    return Trial(state, est.step_time_s, est.bottleneck, est.bottleneck_share, scheduled=(t, records))


def _dstate_bytes(ir: ModelIR, policy, state: tuple[str, ...], rank_irs: tuple = ()) -> dict[str, int]:
    """unit -> bytes of its `dstate.{unit}`, for the units whose state lives on the device. In a world each
    rank holds its shard's (rank_irs): the most any rank holds (their slices' step counts differ)."""
    views = rank_irs or (ir,)
    return {u.name: max(device_state_bytes(r.units[u.index], policy, ir.dtype) for r in views)
            for u, p in zip(ir.units, state) if p == "device"}


def chunks_pass(s: State) -> tuple[State, list[str]]:
    """Tokens per tile of the units' token-wise work (chunking.py): the fastest size that fits."""
    clip = s.barrier
    ir, lines = choose_chunk(s.ir, s.hw, s.train.grad_accum, clip, s.budget, s.policy, s.host_floor)
    if ir is s.ir:
        return s, lines
    return dataclasses.replace(s, ir=ir, costs=cost_model(ir, s.hw, s.policy, clip, s.world)), lines


def _host_room(s: State) -> int:
    """Host bytes one rank may use beyond the model state: its node's memory left after every local rank's
    state, shared evenly."""
    return (s.hw.host_memory_bytes - s.host_floor - s.host_reserve) // s.world.ranks_per_node


def slots_pass(s: State) -> tuple[State, list[str]]:
    """Slot sizes and the feasibility floor: the least-memory schedule must fit the GPU."""
    ir, hw, K = s.ir, s.hw, s.train.grad_accum
    low = minimal(ir)
    tl = exact_timeline(ir, K, low, s.barrier)
    need = hw.gpu_bytes(tl.peak)
    big = max(ir.units, key=lambda u: u.flat_numel)
    lines = [f"parameter slot = largest unit ({big.name}) in {ir.dtype}: {format_bytes(slot_bytes(ir))}; "
             f"gradient slot (fp32): {format_bytes(grad_slot_bytes(ir))}",
             f"least-memory schedule (1 slot, 1 gradient slot, checkpoints on host) needs "
             f"{format_bytes(need)} of {format_bytes(s.budget)}; host model state {format_bytes(s.host_floor)}",
             "slot and gradient-slot counts are chosen with the checkpoints: they compete for the same bytes"]
    if ir.target != hw.device:
        lines.append(f"NOTE: the IR was traced for {ir.target} kernels but {hw.name} runs {hw.device} ones: "
                     "workspace figures may differ; trace with the matching target for exact peaks")
    if need > s.budget:
        what, _ = _dominant(ir, K, low, s.barrier, tl, hw)
        tiles = "" if ir.chunk_tokens is None else f" with units tiled in chunks of {ir.chunk_tokens:,} tokens"
        raise InfeasiblePlanError(
            f"GPU budget {format_bytes(s.budget)} is too small for {ir.model} (micro-batch {ir.micro_batch} x "
            f"seq {ir.seq_len}, {K} micro-batch(es)/step): the smallest workable budget{tiles} is {format_bytes(need)}, "
            f"dominated by {what}; use --gpu-mem {_suggest(need)} or more, or a "
            "shorter --seq-len / smaller --micro-batch", kind="gpu", needed_bytes=need, budget_bytes=s.budget,
            dominant=what)
    return s, lines


def checkpoints_pass(s: State) -> tuple[State, list[str]]:
    """Per-unit checkpoint placement plus slot counts, minimising predicted step time under the budget."""
    state_bytes = s.host_floor
    dstate = sum(_dstate_bytes(s.ir, s.policy, s.state_place, s.rank_irs).values())
    device_budget = s.hw.device_bytes_for(s.budget) - s.device_reserve - dstate
    if s.state_place:
        floor = exact_timeline(s.ir, s.train.grad_accum, minimal(s.ir, s.state_place), s.barrier).peak + dstate
        if floor > s.hw.device_bytes_for(s.budget) - s.device_reserve:
            names = [u.name for u, p in zip(s.ir.units, s.state_place) if p != "host"]
            raise InfeasiblePlanError(
                f"the units asked to keep state on the device ({', '.join(names)}) need at least "
                f"{format_bytes(s.hw.gpu_bytes(floor))} of the {format_bytes(s.budget)} GPU budget; keep fewer of "
                "them on the device (resident=...) or use a larger --gpu-mem", kind="gpu", needed_bytes=s.hw.gpu_bytes(floor),
                budget_bytes=s.budget, dominant="device-resident state")
    # NOTE: each pinned checkpoint tensor starts on a PIN_ALIGN boundary: leave room for that, and for the
    # checkpoint staging buffers should a checkpoint too long for its own pinned copy go to the host
    slack = PAGE + PIN_ALIGN * s.train.grad_accum * sum(len(u.carry_in) + len(u.replay) for u in s.ir.units) + \
        staging_bytes(max((u.carry_in_bytes for u in s.ir.units), default=0))
    dec, lines, tl = search(s.ir, s.costs, s.train.grad_accum, s.barrier, device_budget,
                            _host_room(s) - slack, s.state_place)
    if tl.peak > device_budget:  # host too small for the checkpoints the GPU cannot take either
        K = s.train.grad_accum
        need = state_bytes + s.world.ranks_per_node * (slack + sum(K * u.carry_in_bytes for u in s.ir.units))
        raise InfeasiblePlanError(
            f"host memory {format_bytes(s.hw.host_memory_bytes)} is too small for {s.ir.model}: the model state "
            f"takes {format_bytes(state_bytes)} and the checkpoints that do not fit in the "
            f"{format_bytes(s.budget)} GPU budget need the rest of {format_bytes(need)}; use at least "
            f"{_suggest(need)} of host memory (--host-mem) or a larger --gpu-mem", kind="host",
            needed_bytes=need, budget_bytes=s.hw.host_memory_bytes, dominant="checkpoints")
    return dataclasses.replace(s, decisions=dec), lines


def order_pass(s: State) -> tuple[State, list[str]]:
    """Layer-major micro-batch order: weights cross the link once per pass, not once per micro-batch."""
    n, K = len(s.ir.units), s.train.grad_accum
    order = make_order(n, K, s.decisions)
    names = [u.name for u in s.ir.units]
    res = sorted(order.resident)
    loaded = sum(order.place_of(i) != "device" for i in range(n))  # a device unit is never loaded
    lines = [f"forward {names[0]} .. {names[-1]}, backward {names[-1]} .. {names[0]}; all {K} micro-batch(es) "
             "through a unit before the next",
             f"{len(res)} unit(s) stay resident across the turn ({names[res[0]]} .. {names[res[-1]]}); "
             f"{len(order.reloads)} reloaded once for the backward: {loaded + len(order.reloads)} loads per step "
             f"instead of {2 * n * K} micro-batch by micro-batch",
             f"unit i uses slot i % {s.decisions.n_slots} in both passes; gradient slots round-robin "
             f"over {s.decisions.n_grad_slots}"]
    if order.state:  # per-unit state (residency.py): the shared slots rotate among the streamed units only
        lines[-1] = (f"the j-th streamed unit uses slot j % {s.decisions.n_slots} in both passes, each unit not "
                     f"streamed a slot of its own; gradient slots round-robin over {s.decisions.n_grad_slots}, "
                     "each device unit a gradient slot of its own")
    return dataclasses.replace(s, order=order), lines


def optimizer_pass(s: State) -> tuple[State, list[str]]:
    """Host AdamW order: as gradients land, or behind the next forward (optimizer_order.py)."""
    if s.barrier:
        why = f"clip_norm {s.train.clip_norm:g}" if s.train.clip_norm is not None else "a step applied whole"
        return s, [f"{why}: clip_grads after every store, then every unit steps in "
                   "forward order while the next forward streams right behind (docs/DESIGN.md 4.5)"]
    held = checkpoint_host_bytes(checkpoint_buffers(s.ir, s.decisions.placement, s.train.grad_accum,
                                                    s.decisions.replay))
    room = _host_room(s) - held - PAGE
    split, ring, lines = choose_split(s.ir, s.costs, s.order, s.decisions, s.policy, room)
    return dataclasses.replace(s, decisions=dataclasses.replace(s.decisions, optimizer_split=split,
                                                                host_grad_ring=ring)), lines


def lower_pass(s: State) -> tuple[State, list[str]]:
    ops = lower_ops(s.ir, s.order, s.decisions.placement, s.barrier,
                    s.decisions.optimizer_split, host_grad_ring=s.decisions.host_grad_ring, replay=s.decisions.replay)
    counts: dict[str, int] = {}
    for op in ops:
        counts[op.op] = counts.get(op.op, 0) + 1
    return dataclasses.replace(s, ops=tuple(ops)), [
        f"{len(ops)} ops before sync: " + ", ".join(f"{v} {k}" for k, v in counts.items())]


def collectives_pass(s: State) -> tuple[State, list[str] | None]:
    """The world's collectives (collectives.py): shard loads and all_gather, reduce_scatter or all_reduce before
    each store. One rank: nothing to do (and nothing recorded)."""
    if s.world.nproc == 1:
        return s, None
    ops = lower_collectives(list(s.ops), s.ir, s.world)
    return dataclasses.replace(s, ops=tuple(ops)), decision_lines(s.ir, s.world, ops)


def buffers_pass(s: State) -> tuple[State, list[str]]:
    specs = buffer_specs(s.ir, s.train.grad_accum, s.decisions, _dstate_bytes(s.ir, s.policy, s.state_place, s.rank_irs))
    bufs = tuple(Buffer(name=n, kind=k, nbytes=b, static=st, unit=u, mb=m) for n, k, b, st, u, m in specs)
    static = sum(b.nbytes for b in bufs if b.static)
    kinds: dict[str, int] = {}
    for b in bufs:
        if not b.static:
            kinds[b.kind] = kinds.get(b.kind, 0) + 1
    return dataclasses.replace(s, buffers=bufs), [
        f"static {format_bytes(static)}: {s.decisions.n_slots} x slot {format_bytes(slot_bytes(s.ir, s.state_place))}, "
        f"{s.decisions.n_grad_slots} x gradient slot {format_bytes(grad_slot_bytes(s.ir, s.state_place))}, rope, batch, loss"
        + (f", the dedicated slots and device state of {sum(p != 'host' for p in s.state_place)} unit(s)"
           if s.state_place else ""),
        "dynamic: " + ", ".join(f"{v} {k}" for k, v in kinds.items())]


def sync_pass(s: State) -> tuple[State, list[str]]:
    ops, lines = insert_sync(list(s.ops), s.ir)
    program = Program(n_micro_batches=s.train.grad_accum, world_size=s.world.nproc, buffers=s.buffers,
                      instrs=tuple(Instr(**op.fields()) for op in ops))
    return dataclasses.replace(s, program=program), lines


def cast_prices_pass(s: State) -> tuple[State, list[str]]:
    """The place of the compute-dtype cast whose prices the schedule search uses (cast.py `guess`: the least
    busiest-resource bound within the bytes the least-memory schedule leaves); the `cast` pass decides."""
    clip = s.barrier
    peak = exact_timeline(s.ir, s.train.grad_accum, minimal(s.ir), clip).peak
    room = (s.hw.device_bytes_for(s.budget) - peak, s.hw.host_memory_bytes - s.host_floor)
    where, lines = cast_place.guess(s.ir, s.hw, s.policy, clip, s.world, s.rank_irs, s.train.grad_accum, room)
    if not lines:
        return s, None
    return _searched_with(s, where), lines


def _searched_with(s: State, where: str) -> State:
    """`s` with the op prices of the cast at `where` and its extra bytes left free for the search."""
    device, host = cast_place.reserves(s.ir, where, s.world, s.rank_irs)
    return dataclasses.replace(s, costs=cost_model(s.ir, s.hw, s.policy, s.barrier, s.world,
                                                   where), searched_cast=where, device_reserve=device,
                               host_reserve=host)


def cast_pass(s: State) -> tuple[State, list[str]]:
    """Where the compute-dtype cast runs (cast.py): host, gpu or copy, the fastest the budgets allow, by the
    estimator on this program."""
    first = s.first_cast
    c = cast_place.choose(s.ir, s.hw, s.policy, s.barrier, s.world, s.program, s.budget,
                          s.rank_irs, only=s.searched_cast if first is not None else None)
    if first is not None:  # searched again with the place the first program's estimates chose
        c = cast_place.searched_again(first, c, s.hw, s.first_searched)
    return dataclasses.replace(s, program=c.program, costs=c.costs, estimate=c.estimate, cast=c), list(c.lines)


def verify_pass(s: State) -> tuple[State, list[str]]:
    verify(s.program, ir=s.ir, budget_bytes=s.budget, hardware=s.hw)
    return s, [f"{len(s.program.instrs)} instructions verified: slot, gradient-slot and checkpoint hazards "
               "(across the step boundary too), optimizer and clip order, layer-major order, peak <= budget"]


def estimate_pass(s: State) -> tuple[State, list[str]]:
    tl = program_timeline(s.program)
    est = s.estimate or estimate_time(s.program, s.costs)  # the cast pass estimated its choice already
    shares = ", ".join(f"{k} {v / est.step_time_s:.0%}" for k, v in est.critical_s.items() if v > 0)
    return dataclasses.replace(s, timeline=tl, estimate=est), [
        f"peak {format_bytes(tl.peak)} (buffers {format_bytes(tl.peak_buffers)}) -> GPU "
        f"{format_bytes(s.hw.gpu_bytes(tl.peak))} with {format_bytes(s.hw.reserved_bytes)} reserved and "
        f"{s.hw.allocator_margin:.0%} allocator margin",
        f"steady step {est.step_time_s:.4g} s (first step {est.first_step_s:.4g} s); critical path: {shares}"]


PASSES: tuple[tuple[str, Pass], ...] = (
    ("host_policy", host_policy_pass), ("chunks", chunks_pass), ("slots", slots_pass),
    ("cast_prices", cast_prices_pass), ("residency", residency_pass), ("checkpoints", checkpoints_pass), ("order", order_pass),
    ("optimizer", optimizer_pass), ("lower", lower_pass), ("collectives", collectives_pass),
    ("buffers", buffers_pass), ("sync", sync_pass), ("cast", cast_pass), ("verify", verify_pass),
    ("estimate", estimate_pass))


def plan(ir: ModelIR, hardware: Hardware | str, train: TrainSpec, gpu_budget_bytes: int | str | None = None,
         host_policy: str = "auto", world: World | None = None, barrier: bool = False,
         resident: str | Mapping[str, str] = "auto") -> Plan:
    """Plan one optimizer step of `ir` on `hardware` under `gpu_budget_bytes` (default: the GPU's memory),
    holding the host state under `host_policy` (a name of host_policy.POLICIES, or auto: the most exact that
    fits). With `world` (World(nproc=R, nnodes=N)): the step of one of R data-parallel ranks, each running
    grad_accum / R of the global step's micro-batches, the model state sharded (world.py). Raises
    InfeasiblePlanError (a ValueError) naming the smallest budget that works. With `barrier`, the host optimizer
    starts once every gradient has landed (the clip_grads barrier) even without clipping: a step that is
    applied whole or not at all (the runtime's on_nan="skip") needs it. `resident`: where each unit's state
    lives (docs/DESIGN.md 5): "none" streams every unit; a mapping {unit: "host" | "weights" | "device"} forces
    the named units' places (the rest "host"); "auto" (the default) lets the residency pass choose (residency.py)."""
    if not isinstance(ir, ModelIR):
        raise ValueError(f"plan takes a ModelIR (megatrain.trace(model, micro_batch, seq_len)), got "
                         f"{type(ir).__name__}")
    if not isinstance(train, TrainSpec):
        raise ValueError(f"train must be a TrainSpec, e.g. TrainSpec(micro_batch=1, seq_len=4096), got "
                         f"{type(train).__name__}")
    if not isinstance(resident, str | Mapping):
        raise ValueError(f"resident must be 'none', 'auto' or a mapping like {{'embed': 'device'}}, got "
                         f"{type(resident).__name__}")
    if world is not None and not isinstance(world, World):
        raise ValueError(f"world must be a World, e.g. World(nproc=8), got {type(world).__name__}")
    paused = gc.isenabled()
    gc.disable()  # NOTE: planning builds many small acyclic objects; the cyclic GC would cost time for nothing
    try:
        return _plan(ir, hardware, train, gpu_budget_bytes, host_policy, world or World(), barrier, resident)
    finally:
        if paused:
            gc.enable()


def _plan(ir: ModelIR, hardware: Hardware | str, train: TrainSpec, gpu_budget_bytes: int | str | None,
          host_policy: str, world: World, barrier: bool, resident: str | Mapping[str, str] = "auto") -> Plan:
    t0 = time.perf_counter()
    hw = resolve_hardware(hardware)
    budget = hw.gpu_memory_bytes if gpu_budget_bytes is None else parse_bytes(gpu_budget_bytes)
    _check_inputs(ir, hw, train, budget)
    local = train.replace(grad_accum=world.local_micro_batches(train.grad_accum)) if world.nproc > 1 else train
    ir = world_ir(ir, world.nproc)
    ranks = tuple(rank_ir(ir, world.nproc, r) for r in range(world.nproc)) if world.nproc > 1 else ()
    state = State(ir=ir, hw=hw, train=local, budget=budget, costs=CostModel(ir, hw), host_request=host_policy,
                  world=world, global_train=train, rank_irs=ranks, barrier=barrier or train.clip_norm is not None,
                  resident_request=resident)
    records: list[PassRecord] = []
    base = _run(state, records, PASSES[:SCHEDULE])
    head = list(records)
    if base.scheduled is not None:  # the residency pass ran the schedule passes on its choice already
        state, done = base.scheduled
        records += done
        state = _run(state, records, PASSES[SYNCED:])
    else:
        state = _run(base, records, PASSES[SCHEDULE:])
    state, records = _replan(base, head, state, records)
    return Plan(**plan_fields(state, tuple(records), time.perf_counter() - t0))


SCHEDULE = [name for name, _ in PASSES].index("checkpoints")  # the first pass that prices the ops
SYNCED = [name for name, _ in PASSES].index("sync") + 1  # the passes before it make the synced program


def _run(state: State, records: list[PassRecord], passes) -> State:
    for name, fn in passes:
        t = time.perf_counter()
        state, lines = fn(state)
        if lines is not None:
            records.append(PassRecord(name=name, decisions=tuple(lines), seconds=time.perf_counter() - t))
    return state


def _replan(base: State, head: list[PassRecord], state: State, records: list[PassRecord]):
    """When the cast pass chose another place than the one the schedule (placement, slots, optimizer order)
    was searched with, search it again from `base` (the state before `checkpoints`) with the chosen place's
    prices and bytes left free, and keep whichever predicts the shorter step."""
    where = state.cast.where if state.cast is not None else "none"
    if where in ("none", base.searched_cast):
        return state, records
    again = dataclasses.replace(_searched_with(base, where), first_cast=state.cast,
                                first_searched=base.searched_cast, scheduled=None)
    recs = list(head)
    try:
        again = _run(again, recs, PASSES[SCHEDULE:])
    except InfeasiblePlanError:  # the reserved bytes left no schedule: keep the first
        return state, records
    if again.estimate.step_time_s < state.estimate.step_time_s:
        return again, recs
    return state, records


def _check_inputs(ir: ModelIR, hw: Hardware, train: TrainSpec, budget: int) -> None:
    check_model(ir)
    got = (ir.micro_batch, ir.seq_len, ir.dtype)
    want = (train.micro_batch, train.seq_len, train.dtype)
    if got != want:
        raise ValueError(f"the ModelIR was traced for micro_batch={got[0]}, seq_len={got[1]}, dtype={got[2]} but "
                         f"the TrainSpec asks for {want[0]}, {want[1]}, {want[2]}; trace again with "
                         "megatrain.ir.trace(model, micro_batch, seq_len, dtype)")
    if budget <= 0:
        raise ValueError(f"GPU budget must be positive, got {budget} bytes; pass e.g. --gpu-mem 80GiB")
    if budget > hw.gpu_memory_bytes:
        raise ValueError(f"GPU budget {format_bytes(budget)} exceeds the {format_bytes(hw.gpu_memory_bytes)} of "
                         f"{hw.name}; lower --gpu-mem or use a profile with more GPU memory")


def _dominant(ir: ModelIR, K: int, dec: Decisions, clip: bool, tl: Timeline, hw: Hardware) -> tuple[str, int]:
    """The largest component of the device peak of `dec`'s program."""
    # NOTE: compute_only, as exact_timeline lowers: tl.index points into that list
    ops = lower_ops(ir, make_order(len(ir.units), K, dec), dec.placement, clip, compute_only=True,
                    replay=dec.replay)
    specs = {sp[0]: sp for sp in buffer_specs(ir, K, dec)}
    pos = tl.index[tl.peak_at]
    parts: dict[str, int] = {}
    labels = {"param_slot": "the parameter slot", "grad_slot": "the fp32 gradient slot",
              "resident": "resident tensors, batch and loss", "batch": "resident tensors, batch and loss",
              "loss": "resident tensors, batch and loss", "carry": "checkpoints and carries in flight",
              "saved": "kept activations", "grad_carry": "carry gradients in flight",
              "attention": "attention records kept for replay"}
    for name in live_at(ops, [n for n, sp in specs.items() if sp[3]], pos):
        label = labels[specs[name][1]]
        parts[label] = parts.get(label, 0) + specs[name][2]
    op = ops[pos]
    if op.workspace_bytes:
        parts[f"the {op.op} workspace of {op.unit}"] = op.workspace_bytes
    parts["reserved bytes and allocator margin"] = hw.gpu_bytes(tl.peak) - tl.peak
    what = max(parts, key=lambda k: parts[k])
    return f"{what} ({format_bytes(parts[what])} of {format_bytes(hw.gpu_bytes(tl.peak))})", parts[what]
