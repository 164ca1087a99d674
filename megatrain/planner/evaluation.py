"""The evaluation program: the validation loss under the current weights, a forward-only Program.

Where it sits: the runtime's `evaluate` (runtime/engine.py) asks for it once per batch count, emits it through
codegen like the step program and runs it on the step's engine, between steps, after the device drained. It
is planned from the step program it runs beside: the same parameter slots (unit i in slot i % S, each load
issued as soon as the slot's previous unit has run every batch, so S - 1 units load ahead of compute), the same
sharding in a world (a sharded unit loads its shard and all-gathers it), the same static buffers.

Every forward has mode `eval`: the unit runs in inference mode (MoE routing's inference rule), keeps nothing
and records nothing. Layer-major, as the step: every batch through a unit before the next, so each unit's
weights cross the link once. The head writes each batch's summed token loss into `loss`.

Per-unit state (issue 40, ir/program.py `resident_units`): the shared slots rotate among the streamed units only;
a unit whose state lives on the device reads its dedicated slot, which holds its stepped weights, and loads
nothing; a unit keeping only its weights there loads them into its dedicated slot first (the host optimizer
stepped its master after the step's load).
"""

from __future__ import annotations

from megatrain.ir.model_ir import ModelIR
from megatrain.ir.program import Buffer, Instr, Program, resident_units

from .schedule import Op, carry
from .sync import insert_sync

EVENT_PREFIX = "eval."  # its events are its own: a step's wait must never be satisfied by an evaluation's record


def eval_program(ir: ModelIR, step: Program, n_batches: int) -> Program:
    """The evaluation of `n_batches` validation batches (this rank's) beside step program `step`."""
    statics = [b for b in step.buffers if b.static and b.kind in ("param_slot", "resident", "cast_stage")]
    n_slots = sum(b.kind == "param_slot" and b.unit is None for b in statics)  # the shared ones
    gathered = {ins.unit for ins in step.instrs if ins.op == "all_gather"}
    units = ir.units
    places = resident_units(step)
    dedicated = {b.unit: int(b.name.removeprefix("slot")) for b in statics if b.kind == "param_slot" and b.unit}
    streamed = [i for i, u in enumerate(units) if u.name not in places]
    slot = {i: j % n_slots for j, i in enumerate(streamed)}
    slot.update({i: dedicated[u.name] for i, u in enumerate(units) if u.name in places})
    ops: list[Op] = []

    def load(i: int) -> None:
        name, k = units[i].name, slot[i]
        ops.append(Op("load_params", "h2d", unit=name, slot=k, shard=name in gathered, writes=(f"slot{k}",)))
        if name in gathered:
            ops.append(Op("all_gather", "comm", unit=name, slot=k, reads=(f"slot{k}",), writes=(f"slot{k}",)))

    ahead = {i: streamed[j + n_slots] for j, i in enumerate(streamed) if j + n_slots < len(streamed)}
    for i in sorted(streamed[:n_slots] + [i for i, u in enumerate(units) if places.get(u.name) == "weights"]):
        load(i)
    for i, u in enumerate(units):
        for mb in range(n_batches):
            reads = [f"slot{slot[i]}", carry(u.name, mb) if u.carry_in else "batch"]
            reads += ["rope"] if u.kind == "block" else ["batch"] if u.kind == "head" else []
            writes = ("loss",) if i + 1 == len(units) else (carry(units[i + 1].name, mb),)
            ops.append(Op("forward", "compute", unit=u.name, mb=mb, slot=slot[i], mode="eval",
                          reads=tuple(reads), writes=writes, workspace_bytes=u.peak_fwd_bytes))
            if u.carry_in:
                ops.append(Op("free", "compute", buffer=carry(u.name, mb)))
        if i in ahead:
            load(ahead[i])
    synced, _ = insert_sync(ops, ir, repeats=False)
    for op in synced:
        if op.event is not None:
            op.event = EVENT_PREFIX + op.event
    buffers = [*statics,
               Buffer(name="batch", kind="batch", nbytes=n_batches * ir.micro_batch * ir.seq_len * 8 * 2, static=True),
               Buffer(name="loss", kind="loss", nbytes=n_batches * max(4, units[-1].carry_out_bytes), static=True)]
    buffers += [Buffer(name=carry(u.name, mb), kind="carry", nbytes=u.carry_in_bytes, static=False, unit=u.name,
                       mb=mb) for u in units if u.carry_in for mb in range(n_batches)]
    return Program(purpose="eval", n_micro_batches=n_batches, world_size=step.world_size, buffers=tuple(buffers),
                   instrs=tuple(Instr(**op.fields()) for op in synced), cast=step.cast)
