"""The residency pass's auto choice (planner/residency.py choose_auto, passes.py residency_pass): units kept on
the device where the host optimizer binds and the budget has room, none where nothing fits or nothing binds,
"none" as the all-streamed program; tune's grad-accum and resident axes; the optimizer-binds advice."""

import functools

from megatrain.planner import TrainSpec, plan, tune
from megatrain.planner.advice import optimizer_advice
from megatrain.planner.display import format_plan
from megatrain.planner.residency import benefit_orders, resident_bytes
from megatrain.planner.synthetic import transformer_ir

TRAIN_8K = TrainSpec(micro_batch=1, seq_len=8192)


@functools.cache
def llama8b():
    """llama3-8b's shapes from formulas (the traced preset plans within a percent of it, in milliseconds)."""
    return transformer_ir(n_layers=32, d_model=4096, ffn_dim=14336, vocab=128256, n_heads=32, n_kv_heads=8,
                          seq_len=8192)


@functools.cache
def plans8b(budget: str = "80GiB"):
    ir = llama8b()
    return plan(ir, "h200", TRAIN_8K, budget, resident="auto"), plan(ir, "h200", TRAIN_8K, budget, resident="none")


def _record(p, name="residency"):
    return next((r for r in p.passes if r.name == name), None)


def test_auto_keeps_units_of_an_8b_on_an_80gib_h200():
    auto, none = plans8b()
    assert none.bottleneck == "host_optimizer" and not none.resident_units and _record(none) is None
    assert len(auto.resident_units) >= 8 and auto.tokens_per_s > 1.5 * none.tokens_per_s
    assert auto.peak_gpu_bytes <= auto.gpu_budget_bytes
    assert set(auto.resident_units) == {n for n, p in auto.state_place.items() if p != "host"}
    assert [u.name for u in auto.units if u.state != "host"] == list(auto.resident_units)
    steps = {i.unit for i in auto.program.instrs if i.op == "device_step"}
    assert steps == {n for n, p in auto.state_place.items() if p == "device"}
    assert not {i.unit for i in auto.program.instrs if i.op in ("optimizer_step", "store_grads")} & steps
    lines = _record(auto).decisions
    assert lines[0].startswith("all streamed: step") and any(line.startswith("chose the") for line in lines)
    assert any("host AdamW step" in line and "of the device each" in line for line in lines)  # why, and bytes
    # the printed plan says which units and their bytes; --json lists them
    text = format_plan(auto)
    assert "state " in text and "device" in text.split("unit ")[1]
    summary = auto.summary()
    assert summary["resident_units"] == list(auto.resident_units) and summary["state_place"] == auto.state_place


def test_the_device_bytes_it_spends_are_the_units_own():
    auto, _ = plans8b()
    ir = llama8b()
    held = sum(b.nbytes for b in auto.program.buffers if b.static and b.unit in set(auto.resident_units))
    want = sum(resident_bytes(ir.unit(n), p, auto.host_policy, ir.dtype) for n, p in auto.state_place.items())
    assert held == want


def test_auto_keeps_none_when_no_units_state_fits():
    ir = llama8b()
    auto = plan(ir, "h200", TRAIN_8K, "12GiB", resident="auto")
    none = plan(ir, "h200", TRAIN_8K, "12GiB", resident="none")
    assert not auto.resident_units and auto.program == none.program
    assert any("every unit streamed" in line for line in _record(auto).decisions)


def test_auto_keeps_none_where_compute_binds_and_none_is_the_all_streamed_program():
    ir = transformer_ir(n_layers=4, micro_batch=2, seq_len=128, target="cpu")
    train = TrainSpec(micro_batch=2, seq_len=128, grad_accum=2)
    auto, none = (plan(ir, "cpu", train, "64MiB", resident=r) for r in ("auto", "none"))
    assert not auto.resident_units and auto.program == none.program and _record(none) is None
    assert "compute binds" in _record(auto).decisions[0]
    # "none" prints as auto's plan does, but for the residency pass's record
    drop = "\n".join(["[residency]", *(f"  {line}" for line in _record(auto).decisions)]) + "\n"
    assert format_plan(none, explain=True, timings=False) == \
        format_plan(auto, explain=True, timings=False).replace(drop, "")


def test_benefit_orders_start_where_the_host_steps_bind():
    ir = transformer_ir(n_layers=3, tied=True)
    orders = benefit_orders(ir)
    n = len(ir.units)
    assert all(can not in o for o in orders.values() for can in (0, n - 1))  # tied holders never reside
    untied = benefit_orders(transformer_ir(n_layers=3))
    assert untied["head first"] == (n - 1, 0, 1, 2, 3) and untied["forward"] == (0, 1, 2, 3, n - 1)


def test_tune_sweeps_grad_accum_and_resident():
    ir = transformer_ir(n_layers=2, micro_batch=1, seq_len=128)
    result = tune(ir, "cpu", TrainSpec(micro_batch=1, seq_len=128), ["8MiB", "64MiB"], [1],
                  grad_accums=[1, 2], residents=["auto", "none"])
    cells = [(r.grad_accum, r.resident, r.gpu_budget_bytes >> 20) for r in result.rows]
    assert cells == [(k, res, b) for k in (1, 2) for res in ("auto", "none") for b in (8, 64)]
    assert all(r.plan.train.grad_accum == r.grad_accum for r in result.rows if r.feasible)
    row = next(d for d in result.summary() if d["feasible"])
    assert {"grad_accum", "resident", "resident_units"} <= set(row)


def test_advice_says_how_far_grad_accum_and_residency_move_an_optimizer_bound_plan():
    _, none = plans8b()
    advice = optimizer_advice(none, llama8b(), resident="none")
    assert advice is not None and advice.share == none.bottleneck_share
    flags = [v.flag for v in advice.variants]
    assert flags == ["--grad-accum 2", "--grad-accum 4", "--resident auto"]
    k2, k4, res = advice.variants
    assert none.tokens_per_s < k2.tokens_per_s < k4.tokens_per_s and res.resident_units >= 8
    lines = advice.lines()
    assert lines[0].startswith("the host optimizer binds") and "--grad-accum 4" in lines[2]
    assert "the host optimizer binds" in format_plan(none, advice=advice)
    compute_bound = plan(transformer_ir(n_layers=2), "cpu", TrainSpec(micro_batch=1, seq_len=128), "64MiB")
    assert optimizer_advice(compute_bound, transformer_ir(n_layers=2)) is None
