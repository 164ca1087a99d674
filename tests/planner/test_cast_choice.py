"""The `cast` pass (megatrain/planner/cast.py): where the compute-dtype cast feeding the loads runs, priced from the
profile's cast rates, within the host and GPU budgets, and the plan that says so."""

import json

import pytest
from planner_testing import traced

from megatrain.cli import main
from megatrain.planner import Hardware, ScheduleError, TrainSpec, hardware_preset, plan
from megatrain.planner.cast import SAVING, device_stage_elems, with_cast
from megatrain.planner.costs import CostModel, load_seconds_per_element
from megatrain.planner.hardware import HOST_CAST
from megatrain.planner.synthetic import transformer_ir
from megatrain.planner.verify import verify
from megatrain.runtime.machine_probe import cast_thread_counts

TRAIN_8K = TrainSpec(micro_batch=1, seq_len=8192)


def test_llama3_8b_on_h200_json_names_the_place_and_its_rate(capsys, cached_traces):
    """The issue's case: at the preset's host cast (3.5 G elements/s on the h2d worker's 2 threads) casting on
    the host would make the link feed the bottleneck; the plan takes the fastest place and says at what rate."""
    argv = ["plan", "--model", "llama3-8b", "--hardware", "h200", "--gpu-mem", "80GiB", "--seq-len", "8192",
            "--micro-batch", "1", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    cast = out["cast"]
    assert cast["where"] in ("gpu", "copy") and cast["elements_per_s"] > 0 and cast["reason"]
    steps = cast["step_time_s"]
    assert set(steps) == {"host", "gpu", "copy"} and out["step_time_s"] <= min(steps.values()) * (1 + 1e-9)
    assert steps["host"] > 1.5 * out["step_time_s"]  # the host cast at its measured-like rate is the bottleneck
    assert (out["host_breakdown"]["transfer_copy"] > 0) == (cast["where"] == "copy")


def test_the_printed_plan_says_where_and_why_and_explain_prices_every_place(cached_traces, capsys):
    argv = ["plan", "--model", "llama3-8b", "--hardware", "h200", "--gpu-mem", "80GiB", "--seq-len", "8192",
            "--micro-batch", "1"]
    assert main(argv + ["--explain"]) == 0
    text = capsys.readouterr().out
    (line,) = [x for x in text.splitlines() if x.startswith("cast  ")]
    assert "step" in line and " vs " in line
    explain = text.split("[cast]", 1)[1].split("\n[", 1)[0]
    for where in ("host", "gpu", "copy"):
        assert f"\n  {where:<5} step " in explain


def test_fp32_casts_nothing():
    ir = transformer_ir(n_layers=2, micro_batch=2, seq_len=64, target="cpu", dtype="float32")
    p = plan(ir, "cpu", TrainSpec(micro_batch=2, seq_len=64, dtype="fp32"), "64MiB")
    assert p.cast == "none" and p.program.cast == "none" and p.cast_elements_per_s is None
    assert not [b for b in p.program.buffers if b.kind == "cast_stage"]
    assert p.summary()["cast"]["where"] == "none"


def test_a_place_that_does_not_fit_is_not_taken():
    """gpu needs its staging buffer on the device, copy its bf16 copy in host memory: each refused where the
    budget leaves no room, and named so."""
    ir = transformer_ir(n_layers=4, micro_batch=2, seq_len=128, target="cpu")
    train = TrainSpec(micro_batch=2, seq_len=128, grad_accum=2)
    p = plan(ir, "cpu", train, "6MiB")
    lines = next(r.decisions for r in p.passes if r.name == "cast")
    assert any(x.startswith("gpu   does not fit: its") for x in lines), lines
    host = p.host_bytes
    fast_link = hardware_preset("cpu").replace(h2d_bytes_per_s=1e12, host_memory_bytes=host + 1024,
                                                host_cast_elements_per_s={1: 1e6})
    q = plan(ir, fast_link, train, "64MiB")
    lines = next(r.decisions for r in q.passes if r.name == "cast")
    assert q.cast == "gpu" and any(x.startswith("copy  does not fit: host bytes") for x in lines), lines


def test_another_place_must_save_more_than_the_threshold():
    """On the cpu preset the tiny model is compute-bound: every place predicts about the same step, and the
    host (the least memory) is kept."""
    ir = traced("tiny", 2, 128, target="cpu")
    p = plan(ir, "cpu", TrainSpec(micro_batch=2, seq_len=128, grad_accum=2), "64MiB")
    assert p.cast == "host" and p.bottleneck == "compute"
    assert min(p.cast_step_s.values()) > p.cast_step_s["host"] * (1 - SAVING)


def test_loads_are_priced_per_place():
    hw = hardware_preset("h200")
    link = hw.h2d_bytes_per_s
    assert load_seconds_per_element(hw, "bfloat16", "host") == max(2 / link, 1 / HOST_CAST[2])
    assert load_seconds_per_element(hw, "bfloat16", "gpu") == 4 / link + 1 / hw.device_cast_elements_per_s
    assert load_seconds_per_element(hw, "bfloat16", "copy") == 2 / link
    assert load_seconds_per_element(hw, "float32", "none") == 4 / link
    ir = transformer_ir(n_layers=2, micro_batch=1, seq_len=128)
    host, copy = CostModel(ir, hw, "exact", cast="host"), CostModel(ir, hw, "exact", cast="copy")
    assert copy.opt[1] == pytest.approx(host.opt[1] * (28 + 2) / 28)  # the optimizer writes 2 B more a param
    with pytest.raises(ValueError, match="unknown cast place"):
        load_seconds_per_element(hw, "bfloat16", "disk")


def test_a_profile_without_cast_rates_prices_the_host_cast_as_before():
    """A profile written before the cast was measured: the host cast at host bandwidth / 6 B (what every load
    was priced at then), and no GPU-side cast offered (its rate is not known)."""
    data = json.loads(hardware_preset("h200").to_json())
    for key in ("host_cast_elements_per_s", "cast_threads", "device_cast_elements_per_s"):
        data.pop(key)
    old = Hardware.model_validate(data)
    assert old.host_cast_rate() == old.host_memory_bytes_per_s / 6
    ir = transformer_ir(n_layers=2, micro_batch=1, seq_len=128)
    p = plan(ir, old, TrainSpec(micro_batch=1, seq_len=128), "80GiB")
    lines = next(r.decisions for r in p.passes if r.name == "cast")
    assert any(x.startswith("gpu   does not fit: hardware") for x in lines)
    # a rate per thread count: the one measured at the worker's threads, else the nearest count below
    hw = old.replace(host_cast_elements_per_s={1: 2e9, 4: 6e9}, cast_threads=2)
    assert hw.host_cast_rate() == 2e9 and hw.host_cast_rate(8) == 6e9
    assert Hardware.model_validate_json(hw.to_json()).host_cast_elements_per_s == {1: 2e9, 4: 6e9}
    with pytest.raises(ValueError, match="thread count 0"):
        hw.replace(host_cast_elements_per_s={0: 1e9})


def test_the_verifier_checks_the_cast_and_its_buffer():
    ir = traced("tiny", 2, 128, target="cpu")
    p = plan(ir, "cpu", TrainSpec(micro_batch=2, seq_len=128), "64MiB")
    gpu = with_cast(p.program, ir, "gpu")
    verify(gpu, ir=ir)
    stage = next(b for b in gpu.buffers if b.kind == "cast_stage")
    assert stage.static and stage.nbytes == 4 * device_stage_elems(ir)
    for bad in (with_cast(p.program, ir, "none"), gpu.replace(cast="host"),
                gpu.replace(buffers=tuple(b for b in gpu.buffers if b.kind != "cast_stage"))):
        with pytest.raises(ScheduleError, match="cast"):
            verify(bad, ir=ir)


def test_the_probe_sweeps_thread_counts_up_to_the_cores():
    assert cast_thread_counts(2, 1) == [1, 2]
    assert cast_thread_counts(12, 2) == [1, 2, 3, 4, 5, 6, 7, 8, 12]
    assert cast_thread_counts(128, 2)[-3:] == [32, 64, 128] and cast_thread_counts(1, 2) == [1]
