"""Per-unit state placement (issue 40) as the planner lowers it: plan(resident=mapping) gives a verified program
whose device units are never loaded nor stored, with dedicated slots, and refuses what it cannot run."""

import pytest
from planner_testing import without

from megatrain.ir.program import Instr, Program, resident_units
from megatrain.planner import TrainSpec, plan
from megatrain.planner.errors import InfeasiblePlanError, ScheduleError
from megatrain.planner.residency import can_reside, device_state_bytes
from megatrain.planner.synthetic import transformer_ir
from megatrain.planner.verify import check, verify

MAPPING = {"embed": "device", "blocks.0": "device", "blocks.1": "weights"}


def _plan(clip=None, resident=MAPPING, tied=False, budget="16MiB", **kw):
    ir = transformer_ir(n_layers=4, micro_batch=2, seq_len=128, target="cpu", tied=tied)
    return plan(ir, "cpu", TrainSpec(micro_batch=2, seq_len=128, grad_accum=2, clip_norm=clip), budget,
                resident=resident, **kw)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_mapping_lowers_device_and_weights_units(clip):
    p = _plan(clip)
    prog = p.program
    verify(prog, ir=p.ir)
    assert resident_units(prog) == MAPPING
    assert p.resident_units == ("embed", "blocks.0", "blocks.1")
    ops = {(ins.op, ins.unit) for ins in prog.instrs}
    for unit in ("embed", "blocks.0"):
        assert ("load_params", unit) not in ops and ("store_grads", unit) not in ops
        assert ("optimizer_step", unit) not in ops
        assert ("device_step", unit) in ops and ("store_norms", unit) in ops
        dstate = prog.buffer(f"dstate.{unit}")
        assert dstate.static and dstate.nbytes == device_state_bytes(p.ir.unit(unit), p.host_policy, p.ir.dtype)
    loads = [ins.unit for ins in prog.instrs if ins.op == "load_params"]
    assert loads.count("blocks.1") == 1  # weights: once a step, no reload
    dedicated = {b.unit: b for b in prog.buffers if b.kind == "param_slot" and b.unit}
    assert set(dedicated) == set(MAPPING)
    assert all(b.nbytes == p.ir.unit(u).slot_bytes(p.ir.dtype) for u, b in dedicated.items())
    if clip is not None:
        clip_at = next(i for i, ins in enumerate(prog.instrs) if ins.op == "clip_grads")
        assert all(i > clip_at for i, ins in enumerate(prog.instrs) if ins.op == "device_step")


def test_none_is_todays_program_and_auto_defaults_to_it():
    base = _plan(resident="none")
    assert base.program == _plan(resident={}).program == _plan(resident="auto").program
    assert base.resident_units == () and set(base.state_place.values()) == {"host"}
    assert not any(ins.op in ("device_step", "store_norms") for ins in base.program.instrs)


def test_device_units_have_no_host_gradient_buffer():
    host = _plan(1.0, resident="none")  # with a clip every unit's gradient has a buffer of its own
    dev = _plan(1.0)
    assert dev.host_breakdown["grads"] < host.host_breakdown["grads"]
    assert dev.host_breakdown["master_fp32"] == host.host_breakdown["master_fp32"]  # the mirror stays
    assert dev.host_breakdown["moments"] == host.host_breakdown["moments"]


def test_refusals_name_the_cause():
    with pytest.raises(ValueError, match="tied"):
        _plan(resident={"embed": "device"}, tied=True)
    with pytest.raises(ValueError, match="does not have"):
        _plan(resident={"blocks.9": "device"})
    with pytest.raises(ValueError, match="one of host, weights, device"):
        _plan(resident={"embed": "gpu"})
    with pytest.raises(ValueError, match="exact host policy only|runs the exact"):
        _plan(host_policy="fp8")
    with pytest.raises(InfeasiblePlanError, match="keep fewer"):
        _plan(resident={u: "device" for u in ("embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3")},
              budget="4MiB")
    ir = transformer_ir(n_layers=2, tied=True)
    assert can_reside(ir, 0) and can_reside(ir, len(ir.units) - 1) and can_reside(ir, 1) is None


def test_verifier_catches_broken_residency():
    p = _plan(1.0)
    prog = p.program
    step = next(i for i, ins in enumerate(prog.instrs) if ins.op == "device_step")
    with pytest.raises(ScheduleError, match="never loaded"):
        verify(without(prog, step), ir=p.ir)
    # a load of a device unit would overwrite its stepped weights from the stale host mirror
    load = Instr(op="load_params", stream="h2d", unit="embed", slot=prog.instrs[step].slot,
                 writes=(f"slot{prog.instrs[step].slot}",))
    broken = Program(n_micro_batches=prog.n_micro_batches, buffers=prog.buffers, instrs=(load, *prog.instrs))
    assert any("whose weights the device steps" in m for m in check(broken, ir=p.ir))
    # device_step before clip_grads
    clip_at = next(i for i, ins in enumerate(prog.instrs) if ins.op == "clip_grads")
    moved = list(prog.instrs)
    ins = moved.pop(step)
    moved.insert(0, ins)
    early = Program(n_micro_batches=prog.n_micro_batches, buffers=prog.buffers, instrs=tuple(moved))
    assert clip_at >= 0 and any("before clip_grads" in m or "grad" in m for m in check(early, ir=p.ir))


def test_device_step_is_priced_at_device_memory_bandwidth():
    from megatrain.planner import hardware_preset
    from megatrain.planner.costs import CostModel, device_step_bytes
    from megatrain.planner.host_policy import resolve

    h100 = hardware_preset("h100-sxm")
    assert h100.device_memory_bytes_per_s == pytest.approx(3.35e12 * 0.5)
    assert hardware_preset("h200").device_memory_bytes_per_s == pytest.approx(4.8e12 * 0.5)
    ir = transformer_ir(n_layers=2)
    costs = CostModel(ir, h100, "exact")
    u = ir.units[1]
    want = u.n_params * device_step_bytes(resolve("exact"), ir.dtype) / h100.device_memory_bytes_per_s
    assert costs.dstep[1] == pytest.approx(want + len(u.params) * h100.op_overhead_s)
    p = _plan(1.0)
    est = {ins.op for ins in p.program.instrs}
    assert {"device_step", "store_norms"} <= est and p.step_time_s > 0
    by_unit = {u.name: u for u in p.units}
    assert by_unit["embed"].h2d_s == 0 and by_unit["blocks.1"].h2d_s > 0  # a device unit is never loaded
