"""Lowering: layer-major order, loads at most once per pass, resident units, slots, accumulate flags and
the host optimizer order."""

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st
from planner_testing import model_irs
from program_testing import program_for

from megatrain.planner.schedule import Decisions, make_order
from megatrain.planner.synthetic import transformer_ir


@given(model_irs(), st.data())
def test_program_shape(ir, data):
    n = len(ir.units)
    S, G, K = data.draw(st.integers(1, n + 1)), data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
    place = ("device",) + tuple(data.draw(st.sampled_from(["device", "host", "keep"])) for _ in range(n - 1))
    split = data.draw(st.integers(0, n))
    dec = Decisions(S, G, place, split)
    p = program_for(ir, K, dec)
    names = [u.name for u in ir.units]
    fwd = [(i.unit, i.mb) for i in p.instrs if i.op == "forward"]
    bwd = [(i.unit, i.mb) for i in p.instrs if i.op == "backward"]
    assert fwd == [(u, mb) for u in names for mb in range(K)]
    assert bwd == [(u, mb) for u in reversed(names) for mb in range(K)]
    loads = Counter(i.unit for i in p.instrs if i.op == "load_params")
    resident = set(names[max(0, n - S):])
    assert all(loads[u] == (1 if u in resident else 2) for u in names)
    slot_of = {}
    for ins in p.instrs:
        if ins.op in ("forward", "backward"):
            assert slot_of.setdefault(ins.unit, ins.slot) == ins.slot, "a unit changed slot between passes"
        if ins.op == "backward":
            assert ins.accumulate == (ins.mb > 0)
    stores = [i.unit for i in p.instrs if i.op == "store_grads"]
    assert stores == list(reversed(names))
    steps = [i.unit for i in p.instrs if i.op == "optimizer_step"]
    assert steps == list(reversed(names))[:split] + [u for u in names if u not in list(reversed(names))[:split]]
    assert sum(1 for i in p.instrs if i.op == "offload_act") == K * sum(
        1 for u, pl in zip(ir.units, place) if u.carry_in and pl == "host")


def test_clip_steps_in_forward_order_after_every_store():
    ir = transformer_ir(n_layers=3)
    p = program_for(ir, 2, Decisions(2, 2, ("device", "host", "keep", "device", "host")), clip=True)
    host = [i for i in p.instrs if i.stream == "host" and i.op != "wait"]
    assert host[0].op == "clip_grads"
    assert [i.unit for i in host if i.op == "optimizer_step"] == [u.name for u in ir.units]
    last_store = max(k for k, i in enumerate(p.instrs) if i.op == "store_grads")
    assert min(k for k, i in enumerate(p.instrs) if i.op == "clip_grads") > last_store


def test_order_reloads_and_grad_slots():
    o = make_order(6, 2, Decisions(2, 2, ("device",) * 6))
    assert o.reloads == (3, 2, 1, 0) and o.resident == frozenset({4, 5})
    assert o.grad_slot == (1, 0, 1, 0, 1, 0) and o.slot == (0, 1, 0, 1, 0, 1)
