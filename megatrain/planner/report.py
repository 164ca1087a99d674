"""Turn the pipeline's final state into a Plan's fields: host bytes, per-unit rows, throughput figures.

Where it sits: called once by `plan()` (passes.py) after the estimate pass. Try it:
`python -c "from megatrain.planner.report import program_host_breakdown; help(program_host_breakdown)"`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatrain.ir.base import dtype_bytes
from megatrain.ir.model_ir import ModelIR
from megatrain.ir.program import Program, checkpoint_tensors

from .creation import store_creation_s
from .host_policy import HostPolicy, host_layout, resolve
from .plan import PassRecord, UnitPlan

if TYPE_CHECKING:
    from .state import State


def program_host_breakdown(ir: ModelIR, program: Program, policy: HostPolicy | str) -> dict[str, int]:
    """Host bytes by component of `program` under `policy`: host_policy.host_layout with the program's own
    host gradient buffers (store_grads' host_grad) and offloaded checkpoints."""
    index = {u.name: i for i, u in enumerate(ir.units)}
    assignment: list[int | None] = list(range(len(ir.units)))
    for ins in program.instrs:
        if ins.op == "device_step":  # stepped on the device: no host gradient buffer (runtime/store.py agrees)
            assignment[index[ins.unit]] = None
    for ins in program.instrs:
        if ins.op == "store_grads" and ins.host_grad is not None:
            assignment[index[ins.unit]] = ins.host_grad
    offloaded = sorted({ins.buffer for ins in program.instrs if ins.op == "offload_act"})
    checkpoints = [tuple(t.nbytes for t in checkpoint_tensors(ir, program.buffer(name))) for name in offloaded]
    return host_layout(ir, resolve(policy), assignment, checkpoints, program.cast)


def plan_fields(s: State, passes: tuple[PassRecord, ...], seconds: float) -> dict:
    ir, hw, train, costs, dec, est, tl = s.ir, s.hw, s.train, s.costs, s.decisions, s.estimate, s.timeline
    K = train.grad_accum  # this rank's micro-batches (a world's rank runs its share of the global step)
    order = s.order
    units = []
    for i, u in enumerate(ir.units):
        place = dec.placement[i]
        host = place == "host" and bool(u.carry_in)
        resident = i in order.resident
        rep = dec.replays(i)
        where = dec.place_of(i)
        ckpt = K * (u.rebuild_bytes if place == "rebuild" else u.carry_in_bytes + (u.saved_bytes if place == "keep" else 0)
                    + (u.replay_bytes if rep else 0))
        moved = K * costs.offload_replay[i] if host and rep else 0.0
        back = K * costs.reload_replay[i] if host and rep else 0.0
        units.append(UnitPlan(
            name=u.name, kind=u.kind, params=u.n_params, placement=place, replay=rep, slot=order.slot[i],
            grad_slot=order.grad_slot[i], resident=resident, checkpoint_bytes=ckpt, state=dec.place_of(i),
            forward_s=K * (costs.fwd_replay[i] if rep else costs.fwd[i]),
            backward_s=K * costs.backward(i, place == "keep", place == "rebuild", rep),
            h2d_s=(0.0 if where == "device" else costs.load[i] * (1 if resident else 2))
            + (K * costs.reload[i] if host else 0.0) + back,
            d2h_s=(costs.norms_copy[i] if where == "device" else costs.store[i]) + (K * costs.offload[i] if host else 0.0)
            + moved, optimizer_s=costs.dstep[i] if where == "device" else costs.opt[i]))
    per_rank = [program_host_breakdown(r, s.program, s.policy) for r in s.rank_irs or (ir,)]
    totals = [sum(h.values()) for h in per_rank]
    host = per_rank[totals.index(max(totals))]  # the rank holding the most
    L = s.world.ranks_per_node
    tokens = (s.global_train or train).tokens_per_step  # every rank's tokens: the world's throughput
    model_flops = costs.model_flops_per_step(K)
    step = est.step_time_s
    flops = hw.flops(ir.dtype)
    db = dtype_bytes(ir.dtype)
    # elements per link pass: a unit whose state lives on the device never crosses
    crossing = sum(u.flat_numel for i, u in enumerate((s.rank_irs[0] if s.rank_irs else ir).units)
                   if dec.place_of(i) != "device")
    h2d_once = crossing * db / hw.h2d_bytes_per_s
    d2h_once = crossing * 4 / hw.d2h_bytes_per_s
    peak_ins = s.program.instrs[tl.index[tl.peak_at]] if tl.index else None
    return dict(
        ir=ir, hardware=hw, train=s.global_train or train, world=s.world, gpu_budget_bytes=s.budget, program=s.program, passes=passes,
        n_slots=dec.n_slots, prefetch_distance=dec.prefetch_distance, n_grad_slots=dec.n_grad_slots,
        slot_bytes=s.buffers[0].nbytes, grad_slot_bytes=s.buffers[dec.n_slots].nbytes,
        placement={u.name: p for u, p in zip(ir.units, dec.placement)}, units=tuple(units),
        state_place={u.name: dec.place_of(i) for i, u in enumerate(ir.units)},
        resident_units=tuple(u.name for i, u in enumerate(ir.units) if dec.place_of(i) != "host"),
        peak_gpu_bytes=hw.gpu_bytes(tl.peak), peak_device_bytes=tl.peak, peak_buffer_bytes=tl.peak_buffers,
        peak_at=f"{tl.index[tl.peak_at]}: {str(peak_ins).strip()}" if peak_ins else "",
        memory_timeline=tuple(tl.total), host_bytes=sum(host.values()), host_breakdown=host,
        host_bytes_per_rank=tuple(totals),
        host_bytes_per_node=max(sum(totals[n * L:(n + 1) * L]) for n in range(s.world.nnodes)),
        host_policy=s.policy.name, host_policy_reason=s.host_reason,
        cast=s.cast.where, cast_elements_per_s=s.cast.elements_per_s, cast_reason=s.cast.reason,
        cast_step_s=s.cast.step_s,
        step_time_s=step, first_step_s=est.first_step_s, tokens_per_s=tokens / step,
        time_to_first_step_s=store_creation_s(hw, sum(host.values()), ir.params_total),
        model_tflops=model_flops / step / 1e12, mfu=model_flops / step / hw.peak(ir.dtype),
        bottleneck=est.bottleneck, bottleneck_share=est.bottleneck_share, critical_path_s=est.critical_s,
        busy_s=est.busy_s, compute_bound_tokens_per_s=tokens / (max(model_flops, 1) / flops),
        collectives_s=sum(d for d, ins in zip(est.duration_s, s.program.instrs) if ins.stream == "comm"),
        link_bound_tokens_per_s=tokens / max(h2d_once, d2h_once, 1e-9), planner_seconds=seconds)
