"""The verifier accepts what sync produces and rejects hand-broken programs, naming what is wrong."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from planner_testing import find, model_irs, without
from program_testing import program_for

from megatrain.planner import ScheduleError, check, verify
from megatrain.planner.schedule import Decisions
from megatrain.planner.synthetic import transformer_ir

IR = transformer_ir(n_layers=4, micro_batch=1, seq_len=64)


def _program(S=2, G=2, place=None, K=2, clip=False, split=None):
    place = place or ("device", "host", "device", "keep", "host", "device")
    return program_for(IR, K, Decisions(S, G, place, split), clip)


def test_planner_programs_verify():
    for clip in (False, True):
        for S in (1, 2, 3, 6):
            for G in (1, 2):
                verify(_program(S, G, clip=clip), ir=IR)


def test_missing_wait_before_forward():
    p = _program()
    i = find(p, op="wait", stream="compute", event="load.blocks.0")
    with pytest.raises(ScheduleError, match=r"forward\(unit=blocks.0.*before load_params\(blocks.0\).*missing wait"):
        verify(without(p, i))


def test_slot_overwritten_before_use():
    p = _program(S=2)
    # the h2d stream must wait for the last forward of embed before loading blocks.1 into slot 0
    i = next(k for k, ins in enumerate(p.instrs) if ins.op == "wait" and ins.stream == "h2d"
             and p.instrs[k + 1].op == "load_params" and p.instrs[k + 1].unit == "blocks.1")
    with pytest.raises(ScheduleError, match=r"slot0 is overwritten by .*load_params\(unit=blocks.1.* before"):
        verify(without(p, i))


def test_read_of_checkpoint_on_host():
    p = _program()
    # drop the reload of blocks.0's first checkpoint (alloc, its record, the load_act and the compute wait)
    names = ("carry.blocks.0.0",)
    keep = [ins for ins in p.instrs if not (ins.buffer in names and ins.op in ("alloc", "load_act"))
            and not (ins.event or "").endswith("carry.blocks.0.0")
            or ins.op == "offload_act"]
    problems = check(p.replace(instrs=tuple(keep)))
    assert any("reads carry.blocks.0.0, which is not on device (its copy is on host" in m for m in problems)


def test_optimizer_before_store_and_missing_cross_step_wait():
    p = _program()
    i = find(p, op="wait", stream="host", event="store.blocks.2")
    with pytest.raises(ScheduleError, match=r"optimizer_step\(unit=blocks.2, host_grad=\d+\)\) may run before .*store_grads"):
        verify(without(p, i))
    j = find(p, op="wait", stream="h2d", event="opt.embed")
    assert any("before the previous step's optimizer_step(embed)" in m for m in check(without(p, j), ir=IR))


def test_grad_slot_and_accumulate_rules():
    p = _program(G=1)
    i = next(k for k, ins in enumerate(p.instrs) if ins.op == "wait" and ins.stream == "compute"
             and ins.event.startswith("store."))
    with pytest.raises(ScheduleError, match="grad0 is overwritten"):
        verify(without(p, i))
    k = find(p, op="backward", unit="blocks.1", mb=1)
    flipped = p.instrs[k].replace(accumulate=False)
    with pytest.raises(ScheduleError, match="should have accumulate=True"):
        verify(p.replace(instrs=p.instrs[:k] + (flipped,) + p.instrs[k + 1:]))


def test_clip_after_every_store_and_budget():
    p = _program(clip=True)
    c = find(p, op="clip_grads")
    moved = p.instrs[:c] + p.instrs[c + 1:]
    w = next(k for k, ins in enumerate(moved) if ins.op == "wait" and ins.stream == "host")
    early = p.replace(instrs=(p.instrs[c],) + moved[:w] + moved[w + 1:])
    assert any("clip_grads may run before" in m for m in check(early))
    with pytest.raises(ScheduleError, match="exceed the budget"):
        verify(p, budget_bytes=1000)


def test_layer_major_order_is_enforced():
    p = _program(K=2)
    a, b = find(p, op="forward", unit="blocks.0", mb=1), find(p, op="forward", unit="blocks.1", mb=0)
    instrs = list(p.instrs)
    instrs[a], instrs[b] = instrs[b], instrs[a]
    assert any("interleaved" in m for m in check(p.replace(instrs=tuple(instrs))))


@given(model_irs(max_blocks=4), st.data())
def test_every_wait_is_needed(ir, data):
    """Sync keeps only necessary waits, and the verifier notices each one's absence."""
    n = len(ir.units)
    S = data.draw(st.integers(1, n))
    G = data.draw(st.integers(1, 2))
    place = ("device",) + tuple(data.draw(st.sampled_from(["device", "host", "keep"])) for _ in range(n - 1))
    split = data.draw(st.integers(0, n))
    clip = data.draw(st.booleans())
    p = program_for(ir, data.draw(st.integers(1, 3)), Decisions(S, G, place, split), clip)
    assert check(p, ir=ir) == []
    waits = [k for k, ins in enumerate(p.instrs) if ins.op == "wait"]
    k = data.draw(st.sampled_from(waits))
    assert check(without(p, k), ir=ir), f"removing {p.instrs[k]} went unnoticed"


def test_host_gradient_ring_overwritten_before_its_step():
    """Units stepped as their gradients land share two host gradient buffers: a store into one waits for the
    step of the unit that used it before."""
    p = _program()
    stores = [(k, ins) for k, ins in enumerate(p.instrs) if ins.op == "store_grads"]
    assert sorted({ins.host_grad for _, ins in stores}) == [0, 1]  # no clip, every unit as it lands: a ring
    k, third = stores[2]
    assert third.host_grad == stores[0][1].host_grad
    i = next(j for j in range(k - 1, 0, -1) if p.instrs[j].op == "wait" and p.instrs[j].stream == "d2h"
             and p.instrs[j].event == f"opt.{stores[0][1].unit}")
    with pytest.raises(ScheduleError, match=rf"hgrad{third.host_grad} is overwritten by .*store_grads\(unit="
                       rf"{third.unit}.* before .*optimizer_step\(unit={stores[0][1].unit}.*missing wait"):
        verify(without(p, i))


def test_host_gradient_buffers_with_clipping_are_one_per_unit():
    p = _program(clip=True)
    grads = [ins.host_grad for ins in p.instrs if ins.op == "store_grads"]
    assert sorted(grads) == list(range(len(IR.units)))
    verify(p, ir=IR)


def test_norm_and_host_grad_flags_are_checked():
    p = _program(K=2)
    last = max(k for k, ins in enumerate(p.instrs) if ins.op == "backward" and ins.unit == "blocks.1")
    first = min(k for k, ins in enumerate(p.instrs) if ins.op == "backward" and ins.unit == "blocks.1")
    instrs = list(p.instrs)
    instrs[last] = instrs[last].replace(norm=False)
    instrs[first] = instrs[first].replace(norm=True)
    opt = next(k for k, ins in enumerate(instrs) if ins.op == "optimizer_step" and ins.unit == "blocks.2")
    instrs[opt] = instrs[opt].replace(host_grad=instrs[opt].host_grad + 1)
    problems = check(p.replace(instrs=tuple(instrs)))
    assert any("should have norm=True" in m for m in problems), problems
    assert any("should have no norm" in m for m in problems), problems
    assert any("optimizer_step(unit=blocks.2" in m and "steps from host_grad" in m for m in problems), problems


def test_a_backward_takes_its_graph_from_what_its_forward_kept():
    p = _program(K=2)  # blocks.2 is kept: its forwards keep the graph its backwards take
    fwd = next(k for k, ins in enumerate(p.instrs) if ins.op == "forward" and ins.unit == "blocks.2")
    bwd = next(k for k, ins in enumerate(p.instrs) if ins.op == "backward" and ins.unit == "blocks.2")
    assert (p.instrs[fwd].mode, p.instrs[bwd].source) == ("keep", "saved")
    instrs = list(p.instrs)
    instrs[bwd] = instrs[bwd].replace(source="recompute")
    problems = check(p.replace(instrs=tuple(instrs)))
    assert any("backward(unit=blocks.2" in m and "takes its graph from recompute" in m for m in problems), problems
    instrs = list(p.instrs)
    instrs[fwd] = instrs[fwd].replace(mode="replay", writes=instrs[fwd].writes[:1])
    problems = check(p.replace(instrs=tuple(instrs)))
    assert any("source=replay" in m for m in problems), problems
