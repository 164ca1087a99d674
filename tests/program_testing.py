"""A step program for decisions given by hand (tests of the schedule, the verifier and the runtime): the planner's
lowering and synchronisation without its search or its budget, so a test can run a schedule the planner might
not pick."""

from __future__ import annotations

from megatrain.ir.model_ir import ModelIR
from megatrain.ir.program import Buffer, Instr, Program
from megatrain.planner.schedule import Decisions, buffer_specs, lower_ops, make_order
from megatrain.planner.sync import insert_sync


def program_for(ir: ModelIR, n_micro: int, decisions: Decisions, clip: bool = False) -> Program:
    """The synced Program for explicit decisions, without the search or the budget: a schedule the planner
    might not pick, to run anyway."""
    order = make_order(len(ir.units), n_micro, decisions)
    ops, _ = insert_sync(lower_ops(ir, order, decisions.placement, clip, decisions.optimizer_split,
                                   host_grad_ring=decisions.host_grad_ring, replay=decisions.replay), ir)
    bufs = tuple(Buffer(name=n, kind=k, nbytes=b, static=st, unit=u, mb=m)
                 for n, k, b, st, u, m in buffer_specs(ir, n_micro, decisions))
    return Program(n_micro_batches=n_micro, buffers=bufs, instrs=tuple(Instr(**op.fields()) for op in ops))
