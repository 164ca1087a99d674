"""Measured unit profiles (megatrain/planner/profile.py): the cache keeps one per key and ignores a corrupt or
mismatched file; the cost model prices every op of a covered unit from the profile; the estimator's event
latency and step gap agree between the DAG and the linear pass; contention only ever stretches a step."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_testing import drawn_program, hardwares, model_irs, traced

from megatrain.planner import TrainSpec, hardware_preset, plan, profile_cache
from megatrain.planner import profile as pr
from megatrain.planner.costs import CostModel
from megatrain.planner.estimate import estimate_time, step_period


def synthetic_profile(ir, *, scale: float = 1.0, contention=None, dispatch=2e-5) -> pr.UnitProfile:
    """A UnitProfile of `ir` with made-up, distinct op times per template."""
    units = {}
    for k, u in enumerate(ir.units):
        if u.template in units:
            continue
        f = scale * (k + 1) * 1e-3
        units[u.template] = pr.UnitTimes(
            template=u.template, carry_in=tuple(s.shape for s in u.carry_in), n_params=u.n_params, forward_s=f,
            forward_graph_s=1.1 * f, backward_s=2 * f, recompute_backward_s=3.2 * f, norm_s=0.1 * f,
            forward_warm_s=0.8 * f, recompute_backward_warm_s=0.5 * 3.2 * f,
            load_s=0.5 * f, store_s=0.6 * f, offload_s=0.05 * f, reload_s=0.04 * f,
            optimizer_s={"exact": 0.7 * f}, optimizer_clip_s={"exact": 0.8 * f})
    fields = dict(device="sim", device_name="test cpu", torch="0", config_sha=pr.config_sha(ir.config),
                  micro_batch=ir.micro_batch, seq_len=ir.seq_len, dtype=ir.dtype, packed=ir.packed,
                  loss_chunk=1024, threads={"compute": 1}, compiled=False)
    return pr.UnitProfile(key=pr.profile_key(**fields), model=ir.model, dispatch_s=dispatch, event_latency_s=3e-5,
                       step_gap_s=1e-4, contention=contention or {}, units=units, **fields)


@pytest.fixture
def tiny():
    return traced("tiny", 2, 64, "float32", "cpu")


def test_cost_model_prices_covered_units_from_the_profile(tiny):
    prof = synthetic_profile(tiny)
    hw = hardware_preset("cpu").replace(units=prof)
    c, c_clip = CostModel(tiny, hw), CostModel(tiny, hw, clip=True)
    for i, u in enumerate(tiny.units):
        t = prof.units[u.template]
        assert c.measured[i]
        assert c.fwd[i] == t.forward_s and c.fwd_graph[i] == t.forward_graph_s
        assert c.backward(i, keep=True) == pytest.approx(t.backward_s)
        assert c.backward(i, keep=False) == pytest.approx(t.recompute_backward_s)  # backward + recompute
        assert c.load[i] == t.load_s and c.store[i] == t.store_s
        assert c.opt[i] == pytest.approx(t.optimizer_s["exact"])
        assert c_clip.opt[i] == pytest.approx(t.optimizer_clip_s["exact"])
    p = plan(tiny, hw, TrainSpec(micro_batch=2, seq_len=64, dtype="fp32"), "6MiB")
    sizes = {b.name: b.nbytes for b in p.program.buffers}
    for ins in p.program.instrs:  # every instruction costs the measured dispatch on top of its work
        assert c.op_seconds(ins, sizes) >= prof.dispatch_s
        if ins.op in ("record", "wait", "free", "alloc"):
            assert c.op_seconds(ins, sizes) == pytest.approx(prof.dispatch_s)


def test_a_profile_of_another_shape_is_not_used(tiny):
    other = traced("tiny", 1, 64, "float32", "cpu")  # another micro-batch
    hw = hardware_preset("cpu").replace(units=synthetic_profile(other))
    c, roofline = CostModel(tiny, hw), CostModel(tiny, hardware_preset("cpu"))
    assert not any(c.measured)
    assert c.fwd == roofline.fwd and c.dispatch_s == 0.0


def test_an_unwritable_profile_cache_is_refused_before_a_probe_measures(tiny, tmp_path, monkeypatch):
    from megatrain.runtime import unit_probe

    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MEGATRAIN_PROFILES", str(blocker / "profiles"))
    monkeypatch.setattr(unit_probe, "probe_units", lambda *a, **k: pytest.fail("measured before the check"))
    with pytest.raises(ValueError, match="cannot write a probed profile in megatrain's cache .*MEGATRAIN_CACHE"):
        unit_probe.probe_hardware(tiny, hardware_preset("cpu"))
    hw = hardware_preset("cpu").replace(units=synthetic_profile(tiny))
    with pytest.raises(ValueError, match="cannot write a probed profile"):
        profile_cache.write_cached(hw)


def test_cache_roundtrip_and_corrupt_entries(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_PROFILES", str(tmp_path))
    prof = synthetic_profile(tiny)
    assert pr.key_of(prof) == prof.key
    hw = hardware_preset("cpu").replace(units=prof)
    path = profile_cache.write_cached(hw)
    assert path == profile_cache.cache_path(prof.key) and path.parent == tmp_path
    assert profile_cache.read_cached(prof.key) == hw
    assert profile_cache.read_cached("0" * 24) is None  # nothing cached
    path.write_text("{not json")
    assert profile_cache.read_cached(prof.key) is None
    data = json.loads(hw.to_json())
    data["units"]["micro_batch"] = 7  # fields that no longer hash to the key
    path.write_text(json.dumps(data))
    assert profile_cache.read_cached(prof.key) is None


@settings(max_examples=30, deadline=None)
@given(model_irs(max_blocks=4), hardwares(), st.data())
def test_latencies_agree_between_dag_and_linear_pass(ir, hw, data):
    p = drawn_program(ir, data)
    costs = CostModel(ir, hw)
    costs.event_latency_s = data.draw(st.floats(0, 1e-2))
    costs.step_gap_s = data.draw(st.floats(0, 1e-2))
    est = estimate_time(p, costs)
    sizes = {b.name: b.nbytes for b in p.buffers}
    period, first = step_period(p.instrs, [costs.op_seconds(i, sizes) for i in p.instrs],
                                event_latency=costs.event_latency_s, step_gap=costs.step_gap_s)
    assert est.step_time_s == pytest.approx(period, rel=1e-9) and est.first_step_s == pytest.approx(first)
    costs.event_latency_s = costs.step_gap_s = 0.0
    assert estimate_time(p, costs).step_time_s <= est.step_time_s * (1 + 1e-9)  # latencies never speed up


def test_contention_only_stretches(tiny):
    spec = TrainSpec(micro_batch=2, seq_len=64, dtype="fp32", grad_accum=2)
    alone = hardware_preset("cpu").replace(units=synthetic_profile(tiny))
    f = {s: {t: 1.5 for t in ("compute", "h2d", "d2h", "host") if t != s} for s in ("compute", "h2d", "d2h", "host")}
    busy = hardware_preset("cpu").replace(units=synthetic_profile(tiny, contention=f))
    ones = {s: dict.fromkeys(v, 1.0) for s, v in f.items()}
    neutral = hardware_preset("cpu").replace(units=synthetic_profile(tiny, contention=ones))
    p = plan(tiny, alone, spec, "6MiB")
    t_alone = estimate_time(p.program, CostModel(tiny, alone)).step_time_s
    assert estimate_time(p.program, CostModel(tiny, neutral)).step_time_s == pytest.approx(t_alone, rel=1e-9)
    t_busy = estimate_time(p.program, CostModel(tiny, busy)).step_time_s
    assert t_alone < t_busy <= 2.5 * t_alone * (1 + 1e-9)  # at most 1 + 3 x 0.5: every other stream busy


def test_later_micro_batches_of_a_unit_are_priced_warm(tiny):
    """A forward or backward right after one of the same unit (a layer-major pass's later micro-batches) costs
    the profile's warm fraction; the first of each unit, and every op of a 1-micro-batch step, the cold time."""
    hw = hardware_preset("cpu").replace(units=synthetic_profile(tiny))
    c = CostModel(tiny, hw)
    assert c.warm_fwd == [pytest.approx(0.8)] * len(tiny.units) and c.warm_bwd == [pytest.approx(0.5)] * len(tiny.units)
    for accum in (1, 4):
        p = plan(tiny, hw, TrainSpec(micro_batch=2, seq_len=64, dtype="fp32", grad_accum=accum), "64MiB")
        instrs = p.program.instrs
        flags = CostModel.warm_flags(instrs)
        work = [(k, ins) for k, ins in enumerate(instrs) if ins.op in ("forward", "backward")]
        assert sum(flags) == len(work) - len({(ins.op, ins.unit) for _, ins in work})  # all but each unit's first
        for (k, ins), (_, prev) in zip(work[1:], work):
            assert flags[k] == ((ins.op, ins.unit) == (prev.op, prev.unit))
            cold = c.op_seconds(ins, None) - c.dispatch_s
            warm = c.warm_fwd if ins.op == "forward" else c.warm_bwd
            want = cold * warm[c.index[ins.unit]] if flags[k] else cold
            assert c.op_seconds(ins, None, flags[k]) - c.dispatch_s == pytest.approx(want)
        if accum == 1:
            assert not any(flags)
    old = synthetic_profile(tiny)  # a profile without warm repeats prices every op cold
    for t in old.units.values():
        object.__setattr__(t, "forward_warm_s", None)
        object.__setattr__(t, "recompute_backward_warm_s", None)
    assert CostModel(tiny, hardware_preset("cpu").replace(units=old)).warm_fwd == [1.0] * len(tiny.units)
