"""The planner and attention replay (megatrain/models/replay.py): at long context the search keeps attention records
with the checkpoints and the predicted step falls by about the recomputes' attention; the lowering refuses a
replay the runtime cannot do; host memory counts the records; compiled units plan without it."""

import dataclasses

import pytest

from megatrain.ir.trace import trace
from megatrain.models import ModelConfig, preset
from megatrain.planner import TrainSpec, plan
from megatrain.planner.costs import CostModel
from megatrain.planner.hardware import hardware_preset
from megatrain.planner.placement import analytic_time
from megatrain.planner.schedule import Decisions, can_rebuild, lower_ops, make_order

LONG = ModelConfig(**{**preset("llama2-7b").model_dump(), "max_seq_len": 262144})
TRAIN = TrainSpec(micro_batch=1, seq_len=262144)


@pytest.fixture(scope="module")
def long_plan():
    ir = trace(LONG, 1, 262144, "bf16")
    return ir, plan(ir, "h100-sxm", TRAIN, "80GiB")


def test_long_context_plans_replay_and_predict_it_faster(long_plan):
    ir, p = long_plan
    replaying = [u for u in p.units if u.replay]
    assert len(replaying) >= 16 and all(u.placement in ("device", "host") for u in replaying)
    without = plan(ir.without_replay(), "h100-sxm", TRAIN, "80GiB")
    assert not any(u.replay for u in without.units)
    # the recompute's attention is about a quarter of a block's step here (forward 1, backward about 2.5)
    assert 1.1 < without.step_time_s / p.step_time_s < 1.4
    # each replaying unit's backward is priced without its attention forward, its checkpoint with the record
    costs = CostModel(ir, hardware_preset("h100-sxm"))
    for u in replaying:
        i = ir.unit(u.name).index
        assert u.backward_s == pytest.approx(costs.backward(i, False) - costs.replay_saves[i])
        assert costs.replay_saves[i] == pytest.approx(ir.units[i].attn_flops_fwd / hardware_preset("h100-sxm")
                                                      .flops(ir.dtype))


def test_host_memory_counts_the_offloaded_records(long_plan):
    ir, p = long_plan
    K = TRAIN.grad_accum
    held = sum(K * (u.carry_in_bytes + (u.replay_bytes if pu.replay else 0))
               for u, pu in zip(ir.units, p.units) if pu.placement == "host")
    assert p.host_breakdown["checkpoints"] == held
    assert sum(i.op == "offload_act" and i.buffer.startswith("attn.") for i in p.program.instrs) == \
        sum(1 for u in p.units if u.replay and u.placement == "host") * K


def test_the_analytic_model_counts_replay():
    ir = trace(preset("tiny"), 2, 256, "fp32", target="cpu")
    costs = CostModel(ir, hardware_preset("cpu"))
    host = tuple("host" if u.carry_in else "device" for u in ir.units)
    plain = Decisions(1, 1, host)
    replayed = dataclasses.replace(plain, replay=tuple(bool(u.replay) for u in ir.units))
    saved = sum(costs.replay_saves)
    assert saved > 0
    assert analytic_time(ir, costs, 1, False, plain) > analytic_time(ir, costs, 1, False, replayed)


@pytest.mark.parametrize("where", ["keep", "rebuild"])
def test_lowering_refuses_a_replay_the_runtime_cannot_do(where):
    config = ModelConfig(**{**preset("tiny").model_dump(), "depth_mixing": "depthssd:8"})
    ir = trace(config, 2, 64, "fp32", target="cpu")
    i = next(i for i in range(1, len(ir.units)) if can_rebuild(ir, i))
    place = tuple(where if j == i else "host" if j else "device" for j in range(len(ir.units)))
    replay = tuple(j == i for j in range(len(ir.units)))
    with pytest.raises(ValueError, match="cannot replay its attention"):
        lower_ops(ir, make_order(len(ir.units), 1, Decisions(1, 1, place)), place, False, replay=replay)
    embed = (True, *[False] * (len(ir.units) - 1))
    with pytest.raises(ValueError, match="unit embed cannot replay"):
        lower_ops(ir, make_order(len(ir.units), 1, Decisions(1, 1, place)), ("device", *["host"] * (len(ir.units) - 1)),
                  False, replay=embed)


def test_units_that_cannot_replay_are_never_planned_to():
    for ir in (trace(preset("tiny"), 2, 64, "fp32", target="cpu", packed=True),
               trace(preset("tiny"), 2, 64, "fp32", target="cuda"),  # CUDA fp32: the memory-efficient kernel
               trace(preset("tiny"), 2, 64, "fp32", target="cpu").without_replay()):
        assert not any(u.replay for u in ir.units)
        p = plan(ir, "cpu", TrainSpec(micro_batch=2, seq_len=64, dtype="fp32"), "5MiB")
        assert not any(u.replay for u in p.units)
        assert not any("replay" in (i.mode, i.source) for i in p.program.instrs)
    able = plan(trace(preset("tiny"), 2, 64, "fp32", target="cpu"), "cpu",
                TrainSpec(micro_batch=2, seq_len=64, dtype="fp32"), "5MiB")
    assert any(u.replay for u in able.units)  # the same budget with replay allowed does replay
    bf16 = trace(preset("tiny"), 2, 64, "bf16", target="cuda")
    assert all(bool(u.replay) == (u.kind == "block") for u in bf16.units)


@pytest.mark.parametrize("compute_only", [False, True])
def test_an_offloaded_record_is_freed_a_forward_later(compute_only):
    """Freeing a record waits for its copy to the host, which leaves just after the forward that made it: the
    compute stream frees it after the next forward instead, so it never idles on that copy (on the 2-core sim
    device the copy often started a millisecond late, its core taken by the next unit's load). The compute-only
    lowering (the placement search's model of the program's memory, placement.exact_timeline) frees it at the
    same point, or the search would accept plans the program breaks."""
    ir = trace(preset("tiny"), 2, 64, "fp32", target="cpu")
    host = tuple("host" if u.carry_in else "device" for u in ir.units)
    replay = tuple(bool(u.replay) for u in ir.units)
    assert sum(replay) >= 2
    ops = lower_ops(ir, make_order(len(ir.units), 3, Decisions(1, 1, host, replay=replay)), host, False,
                    compute_only=compute_only, replay=replay)
    forward_pass = ops[:next(k for k, o in enumerate(ops) if o.op == "backward")]
    compute = [o for o in forward_pass if o.stream == "compute" and o.op in ("forward", "free")]
    frees = [k for k, o in enumerate(compute) if o.op == "free" and o.buffer.startswith("attn.")]
    assert len(frees) == 3 * sum(replay)
    for k in frees:
        made = max(j for j in range(k) if compute[j].op == "forward" and compute[k].buffer in compute[j].writes)
        between = sum(o.op == "forward" for o in compute[made + 1:k])
        assert between == 1, compute[k].buffer


def test_the_search_counts_an_offloaded_record_through_the_next_forward_as_the_program_does():
    """An offloaded attention record is freed after the next forward (its copy leaves behind the forward that
    made it). The placement search's timeline once freed it at once: tiny at 4 x 1024 tokens, fp32, 64 MiB
    planned a program 36,940 bytes over its budget, which the verify pass then refused (ScheduleError). Every
    budget here either plans within it or is refused as infeasible, and the plan's peak is its program's."""
    from megatrain.planner import InfeasiblePlanError, check
    from megatrain.planner.timeline import program_timeline

    ir = trace(preset("tiny"), 4, 1024, "fp32", target="cpu")
    train = TrainSpec(micro_batch=4, seq_len=1024, dtype="fp32")
    planned = 0
    for mib in (48, 56, 60, 62, 64, 66, 72):
        try:
            p = plan(ir, "cpu", train, mib * 2**20)
        except InfeasiblePlanError:
            continue
        planned += 1
        assert any(u.replay and u.placement == "host" for u in p.units)  # the case: records leave with checkpoints
        assert program_timeline(p.program).peak == p.peak_device_bytes <= mib * 2**20
        assert check(p.program, ir=p.ir, budget_bytes=p.gpu_budget_bytes, hardware=p.hardware) == []
    assert planned >= 4
