"""The residency pass's auto choice (planner/residency.py choose_auto, passes.py residency_pass): units kept on
the device where the host optimizer binds and the budget has room, none where nothing fits or nothing binds,
"none" as the all-streamed program; in a data-parallel world, a rank's shard of each device unit's state; units
keeping their weights where the link binds; tune's grad-accum and resident axes; the optimizer-binds advice."""

import functools
import json
import re

from megatrain.planner import TrainSpec, hardware_preset, plan, tune
from megatrain.planner.advice import optimizer_advice
from megatrain.planner.bytesize import format_bytes
from megatrain.planner.display import format_plan
from megatrain.planner.residency import benefit_orders, device_state_bytes, resident_bytes
from megatrain.planner.synthetic import transformer_ir
from megatrain.planner.world import World, rank_ir

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


# -- a data-parallel world: a rank holds its shard of a device unit's state ----------------------------------------
# one host socket for every rank of the node: a rank's host AdamW takes as long as one GPU's alone (half the state
# at half the bandwidth), so the host optimizer binds a world as it binds one GPU (two sockets would halve it)
ONE_SOCKET = hardware_preset("h200").replace(host_sockets=1, name="h200-one-socket")


@functools.cache
def world8b(nproc: int, budget: str = "40GiB", hw=ONE_SOCKET, resident: str = "auto"):
    """llama3-8b at 8k, one micro-batch per rank (a rank's work is the single GPU's of plans8b)."""
    return plan(llama8b(), hw, TRAIN_8K.replace(grad_accum=nproc), budget, world=World(nproc=nproc) if nproc > 1 else None,
                resident=resident)


def _most_that_fit(p) -> int:
    """The most device units the residency pass found to fit beside a double-buffered least-memory schedule."""
    return max(int(re.search(r"the most that fit \((\d+) device\)", line)[1])
               for line in _record(p).decisions if "the most that fit" in line)


def _ranks(p, nproc: int):
    return tuple(rank_ir(p.ir, nproc, r) for r in range(nproc))


def test_auto_in_a_world_keeps_more_units_a_rank_where_the_host_optimizer_binds():
    """At the same per-rank budget a rank of 2 (4) holds half (a quarter) of each device unit's master and moments
    beside its whole slots: more units fit, and where the host optimizer binds more are chosen."""
    plans = {n: world8b(n) for n in (1, 2, 4)}
    assert all(p.resident_units and p.tokens_per_s > 0 for p in plans.values())
    fit = [_most_that_fit(plans[n]) for n in (1, 2, 4)]
    chosen = [len(plans[n].resident_units) for n in (1, 2, 4)]
    assert fit[0] < fit[1] < fit[2] and chosen[0] < chosen[1] < chosen[2], (fit, chosen)
    for n in (2, 4):
        p = plans[n]
        lines = _record(p).decisions
        assert not any("data-parallel world" in line for line in lines)
        assert lines[0].startswith("all streamed: step") and any(line.startswith("chose the") for line in lines)
        assert p.bottleneck == "host_optimizer" and p.peak_gpu_bytes <= p.gpu_budget_bytes
        assert p.summary()["resident_units"] == list(p.resident_units)
        # sized per rank: the units' whole slots and the rank's shard of their state, to the byte
        ranks = _ranks(p, n)
        held = sum(b.nbytes for b in p.program.buffers if b.static and b.unit in set(p.resident_units))
        assert held == sum(resident_bytes(p.ir.unit(u), place, p.host_policy, p.ir.dtype, ranks)
                           for u, place in p.state_place.items())
        device = [u for u, place in p.state_place.items() if place == "device"]
        for u in device:
            (buf,) = [b for b in p.program.buffers if b.name == f"dstate.{u}"]
            whole = device_state_bytes(p.ir.unit(u), p.host_policy, p.ir.dtype)
            assert buf.nbytes == max(device_state_bytes(r.unit(u), p.host_policy, p.ir.dtype) for r in ranks)
            assert buf.nbytes <= whole / n + 64
        # a device unit is never loaded nor stored: its gradient reduce_scattered, its stepped shard all_gathered
        instrs = p.program.instrs
        for op in ("reduce_scatter", "all_gather", "device_step"):
            assert {i.unit for i in instrs if i.op == op} >= set(device), op
        assert not {i.unit for i in instrs if i.op in ("load_params", "store_grads")} & set(device)


def test_a_world_fits_more_units_by_their_shards_on_a_stock_h200():
    """Two sockets for eight GPUs: the most that fit at 80 GiB grows with the ranks (16, 25, all 34)."""
    fit = [_most_that_fit(world8b(n, "80GiB", "h200")) for n in (1, 2, 4)]
    assert fit[0] == len(plans8b()[0].resident_units) and fit[0] < fit[1] < fit[2] == len(llama8b().units)


def test_auto_in_a_world_keeps_none_when_no_units_shard_fits():
    auto, none = world8b(2, "16GiB"), world8b(2, "16GiB", resident="none")
    assert not auto.resident_units and auto.program == none.program
    (line,) = [line for line in _record(auto).decisions if "every unit streamed" in line]
    head = auto.ir.units[-1]
    shard = format_bytes(resident_bytes(head, "device", auto.host_policy, auto.ir.dtype, _ranks(auto, 2)))
    assert f"not even head's state ({shard})" in line  # the rank's shard, not the whole unit's
    assert shard != format_bytes(resident_bytes(head, "device", auto.host_policy, auto.ir.dtype))


def test_plan_json_lists_the_units_auto_keeps_in_a_world(tmp_path, capsys):
    """`megatrain plan --nproc 2 --json` on a host whose AdamW binds: the device units auto chose."""
    from megatrain.cli import main

    hw = tmp_path / "slow-host.json"
    hw.write_text(hardware_preset("cpu").replace(name="cpu-slow-host", host_memory_bytes_per_s=1e8).to_json())
    argv = ["plan", "--model", "tiny", "--hardware", str(hw), "--seq-len", "32", "--micro-batch", "2", "--gpu-mem",
            "6MiB", "--grad-accum", "2", "--nproc", "2", "--host-policy", "exact", "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["resident_units"] and all(d["state_place"][u] == "device" for u in d["resident_units"])
    assert d["world"]["nproc"] == 2


# -- "weights": where the link binds every unit streamed ------------------------------------------------------------
SLOW_LINK = hardware_preset("h200").replace(h2d_bytes_per_s=8e9, name="h200-slow-link")


def test_auto_keeps_weights_where_the_link_binds():
    """An 8 GB/s link at 24 GiB: every unit streamed binds on the loads, and only one unit's device state fits; its
    weights take 2 B/param, so most units keep them (loaded once a step, not reloaded for the backward)."""
    ir = llama8b()
    auto, none = (plan(ir, SLOW_LINK, TRAIN_8K, "24GiB", resident=r) for r in ("auto", "none"))
    assert none.bottleneck == "h2d"
    places = list(auto.state_place.values())
    assert set(places) == {"host", "weights"} and places.count("weights") >= 16
    assert auto.tokens_per_s > 1.1 * none.tokens_per_s and auto.peak_gpu_bytes <= auto.gpu_budget_bytes
    lines = _record(auto).decisions
    assert any("weights only" in line and "h2d binds" in line for line in lines)
    assert any(line.startswith("chose weights only") for line in lines)
    loads = [i.unit for i in auto.program.instrs if i.op == "load_params"]
    assert all(loads.count(u) == 1 for u in auto.resident_units)  # once a step
    assert len(loads) < sum(i.op == "load_params" for i in none.program.instrs)


def test_auto_keeps_weights_where_a_worlds_collectives_bind():
    """8 ranks on a slow interconnect: the all_gathers bind every unit streamed; a unit keeping its weights is
    gathered once a step, not again for the backward."""
    ir = transformer_ir(n_layers=4, micro_batch=1, seq_len=64)
    hw = hardware_preset("h100-sxm").replace(intra_node_bytes_per_s=2e8, name="slow-links")
    train, world = TrainSpec(micro_batch=1, seq_len=64, grad_accum=8), World(nproc=8)
    auto, none = (plan(ir, hw, train, "8GiB", world=world, resident=r) for r in ("auto", "none"))
    assert none.bottleneck == "collectives" and "weights" in auto.state_place.values()
    assert auto.step_time_s < none.step_time_s
    lines = _record(auto).decisions
    assert any("collectives binds" in line and "weights only" in line for line in lines)
    assert any("its second all_gather" in line for line in lines)
    gathers = [i.unit for i in auto.program.instrs if i.op == "all_gather"]
    assert all(gathers.count(u) == 1 for u, p in auto.state_place.items() if p == "weights")
