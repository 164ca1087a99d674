"""megatrain/planner/series.py: the numbers the plan and tune pictures draw come from the plan itself.

Memory by kind adds up to the plan's timeline at every compute-stream instruction (and matches an
independent walk per kind); the lanes of one steady-state period hold exactly one step of each stream's
work; the compute-lane labels group units as the plan's table does.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_testing import hardwares, independent_timeline, model_irs, traced

from megatrain.planner import InfeasiblePlanError, TrainSpec, hardware_preset, plan, tune
from megatrain.planner import series as series_mod
from megatrain.planner.display import unit_groups
from megatrain.planner.series import BUFFER_LAYERS, LAYERS, plan_series, tune_points
from megatrain.planner.synthetic import transformer_ir
from megatrain.planner.timeline import program_timeline

LANE_BUSY = {"compute": "compute", "h2d": "h2d", "d2h": "d2h", "host": "host_optimizer"}
KINDS = {"param_slot": {"param_slot"}, "grad_slot": {"grad_slot"}, "device_state": {"device_state"},
         "static": {"resident", "batch", "loss"},
         "checkpoint": {"carry", "saved", "attention"}, "grad_carry": {"grad_carry"}}  # megatrain/ir/program.py's kinds, by band


@pytest.fixture(scope="module")
def tiny_plan():
    """tiny with two micro-batches, on a profile with a reserve and a margin so every band shows."""
    hw = hardware_preset("cpu").replace(reserved_bytes=2**20, allocator_margin=0.05)
    train = TrainSpec(micro_batch=2, seq_len=128, grad_accum=2)
    return plan(traced("tiny", 2, 128, "bfloat16", "cpu"), hw, train, 12 * 2**20)


def _assert_layers_are_the_timeline(p):
    s = plan_series(p)
    m = s.memory
    assert list(m.index) == list(program_timeline(p.program).index)
    for j, total in enumerate(p.memory_timeline):
        assert m.top(j, [k for k in LAYERS if k != "reserve"]) == total
        assert m.top(j) == p.hardware.gpu_bytes(total)
    assert m.top(s.peak) == p.peak_gpu_bytes == max(m.top(j) for j in range(len(m.index)))
    assert p.peak_at.startswith(f"{m.index[s.peak]}:")
    assert set(BUFFER_LAYERS) == set(KINDS)
    assert {b.kind for b in p.program.buffers} <= set().union(*KINDS.values())
    for layer, kinds in KINDS.items():  # each band against a walk written apart from megatrain/planner/timeline.py
        assert list(m.layers[layer]) == independent_timeline(p.program, kinds)[1], layer
    return s


def test_memory_by_kind_adds_up_to_the_plans_timeline_and_peak(tiny_plan):
    s = _assert_layers_are_the_timeline(tiny_plan)
    m, prog = s.memory, tiny_plan.program
    for layer in ("param_slot", "grad_slot", "static", "checkpoint", "grad_carry", "workspace", "loss_chunk",
                  "reserve"):
        assert any(m.layers[layer]), f"{layer} never shows on tiny"
    for j, i in enumerate(m.index):  # the loss chunk is the head's workspace, the rest the other units'
        ins = prog.instrs[i]
        assert m.layers["loss_chunk"][j] == (ins.workspace_bytes if ins.unit == "head" and ins.op in
                                             ("forward", "backward") else 0)
    assert m.layers["param_slot"][0] == tiny_plan.n_slots * tiny_plan.slot_bytes
    assert m.layers["grad_slot"][0] == tiny_plan.n_grad_slots * tiny_plan.grad_slot_bytes


@settings(max_examples=15)
@given(model_irs(max_blocks=4), hardwares(), st.integers(50_000, 400_000))
def test_memory_by_kind_on_random_models(ir, hw, budget):
    try:
        p = plan(ir, hw, TrainSpec(micro_batch=ir.micro_batch, seq_len=ir.seq_len), budget)
    except InfeasiblePlanError:
        return
    _assert_layers_are_the_timeline(p)


def test_one_period_holds_one_step_of_every_stream(tiny_plan):
    """In steady state the window [0, step time) sees each stream do one step's work: this step's spans cut
    at the period plus the previous step's that run into it add up to the estimator's busy seconds."""
    s = plan_series(tiny_plan)
    assert {sp.lane for sp in s.spans} == set(LANE_BUSY)
    for lane, key in LANE_BUSY.items():
        spans = sorted((sp for sp in s.spans if sp.lane == lane), key=lambda sp: sp.start)
        assert all(0 <= sp.start <= sp.end <= s.step_time_s for sp in spans)
        assert all(a.end <= b.start + 1e-12 for a, b in zip(spans, spans[1:])), f"{lane} runs two ops at once"
        busy = sum(sp.end - sp.start for sp in spans)
        assert busy == pytest.approx(tiny_plan.busy_s[key], rel=1e-9)
        assert s.busy[lane] == pytest.approx(tiny_plan.busy_s[key] / tiny_plan.step_time_s)
    n_forward = sum(1 for ins in tiny_plan.program.instrs if ins.op == "forward")
    assert sum(1 for sp in s.spans if sp.op == "forward" and not sp.previous) == n_forward
    assert s.turn_s == min(sp.start for sp in s.spans if sp.op == "backward" and not sp.previous)


def test_drawn_steps_cover_the_period_and_reach_the_peak(tiny_plan):
    s = plan_series(tiny_plan)
    m = s.memory
    xs, ys = m.steps(tuple(LAYERS), s.step_time_s)
    assert xs[0] == 0 and all(a < b for a, b in zip(xs, xs[1:])) and xs[-1] < s.step_time_s
    tops = [sum(ys[k][n] for k in LAYERS) for n in range(len(xs))]
    assert max(tops) == tiny_plan.peak_gpu_bytes
    last = len(m.index) - 1  # before this step's first instruction: what the previous step left
    assert m.end[last] - s.step_time_s <= 0 < m.start[0] and xs[1] == m.start[0]
    assert tops[0] == m.top(last)
    assert tiny_plan.program.instrs[m.index[last]].op not in ("forward", "backward")
    peak_x = xs.index(m.start[s.peak])
    assert tops[peak_x] == tiny_plan.peak_gpu_bytes
    for k in BUFFER_LAYERS:  # the buffers hold between instructions; only workspace ends with its op
        assert set(ys[k]) <= set(m.layers[k])


def test_labels_group_units_as_the_table(tiny_plan, monkeypatch):
    s = plan_series(tiny_plan)
    names = [name for name, _ in unit_groups(tiny_plan)]
    want = [f"fwd {n}" for n in names] + [f"bwd {n}" for n in reversed(names)]
    assert [lab.text for lab in s.labels] == want
    assert all(a.end <= b.start + 1e-12 for a, b in zip(s.labels, s.labels[1:]))
    monkeypatch.setattr(series_mod, "MAX_LABELS", 2)  # too many table rows: runs of one unit kind
    texts = [lab.text for lab in plan_series(tiny_plan).labels]
    assert texts == ["fwd embed", "fwd blocks.0-3 (4)", "fwd head",
                     "bwd head", "bwd blocks.0-3 (4)", "bwd embed"]


def test_80_units_get_a_handful_of_labels(ir70):
    # NOTE: the host cast priced as before it was measured (megatrain/planner/cast.py), so that the plan stays the one
    # whose period shows a backward: fed from a bf16 copy, the period ends before the backward starts; every unit
    # streamed, so that the 79 blocks print alike
    hw = hardware_preset("h100-sxm").replace(host_cast_elements_per_s={})
    p = plan(ir70, hw, TrainSpec(micro_batch=1, seq_len=8192), "80GiB", resident="none")
    assert p.cast == "host"
    s = plan_series(p)
    texts = [lab.text for lab in s.labels]
    assert len(texts) <= 2 * len(unit_groups(p)) <= 2 * series_mod.MAX_LABELS
    assert "fwd blocks.0-78 (79)" in texts and "bwd blocks.0-78 (79)" in texts
    assert s.peak_text == "backward(head)" and s.bottleneck == p.bottleneck
    from megatrain.plots import plan_figure  # drawn: groups of artists, not one per op of 80 units

    lanes = plan_figure(s).axes[1]
    assert len(lanes.texts) <= 8 and len(lanes.collections) <= 16
    assert {t.get_text() for t in lanes.texts} >= {"fwd blocks.0-78 (79)", "bwd blocks.0-78 (79)"}


def test_tune_points_are_the_rows():
    ir = transformer_ir(n_layers=2, micro_batch=1, seq_len=128)
    result = tune(ir, "cpu", TrainSpec(micro_batch=1, seq_len=128), ["100KiB", "8MiB", "64MiB"], [1, 2])
    points = tune_points(result)
    assert len(points) == len(result.rows)
    for pt, row in zip(points, result.rows):
        assert (pt.micro_batch, pt.budget_bytes, pt.feasible, pt.pareto) == (
            row.micro_batch, row.gpu_budget_bytes, row.feasible, row.pareto)
        assert pt.step_time_s == (row.plan.step_time_s if row.plan else None)
        assert pt.needed_bytes == row.needed_bytes
