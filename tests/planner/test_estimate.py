"""The estimator: the networkx critical path equals a plain pass in program order, the critical path
covers the step, and the chosen host-optimizer order beats the naive ones on a real model."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from planner_testing import drawn_program, hardwares, model_irs
from program_testing import program_for

from megatrain.planner import TrainSpec, plan
from megatrain.planner.costs import CostModel
from megatrain.planner.estimate import estimate_time, step_period
from megatrain.planner.schedule import Decisions


@given(model_irs(max_blocks=4), hardwares(), st.data())
def test_networkx_equals_linear_pass_and_path_covers_step(ir, hw, data):
    p = drawn_program(ir, data)
    costs = CostModel(ir, hw)
    est = estimate_time(p, costs)
    sizes = {b.name: b.nbytes for b in p.buffers}
    period, first = step_period(p.instrs, [costs.op_seconds(i, sizes) for i in p.instrs])
    assert est.step_time_s == pytest.approx(period, rel=1e-9) and est.first_step_s == pytest.approx(first)
    assert sum(est.critical_s.values()) == pytest.approx(est.step_time_s, rel=1e-6)
    for resource, busy in est.busy_s.items():
        assert busy <= est.step_time_s * (1 + 1e-9), f"{resource} works longer than a step"


def test_optimizer_split_beats_naive_orders(ir70):
    hw = "h100-sxm"
    p = plan(ir70, hw, TrainSpec(micro_batch=1, seq_len=8192), "80GiB")
    costs = CostModel(ir70, p.hardware)
    dec = Decisions(p.n_slots, p.n_grad_slots, tuple(p.placement[u.name] for u in ir70.units))
    n = len(ir70.units)
    for split in (0, n):
        other = program_for(ir70, 1, Decisions(dec.n_slots, dec.n_grad_slots, dec.placement, split))
        assert p.step_time_s < estimate_time(other, costs).step_time_s


def test_dag_is_acyclic_and_numbered_topologically():
    import networkx as nx

    from megatrain.planner.estimate import instruction_dag
    from megatrain.planner.synthetic import transformer_ir

    ir = transformer_ir(n_layers=3)
    p = program_for(ir, 2, Decisions(2, 2, ("device", "host", "keep", "device", "host"), 2))
    g = instruction_dag(p)
    in_step = nx.DiGraph([(u, v) for u, v, d in g.edges(data="delay") if d == 0])
    assert nx.is_directed_acyclic_graph(in_step) and all(u < v for u, v in in_step.edges)
    assert all(u >= v for u, v, d in g.edges(data="delay") if d == 1)
