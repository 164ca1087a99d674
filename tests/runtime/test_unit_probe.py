"""The unit probe (megatrain/runtime/unit_probe.py): it measures every template's ops through the engine on the sim
device, caches the profile under its key, and a Trainer with profile="auto" plans with it; the CLI's
`probe --model` prints it and then reads it back from the cache. No timing is asserted, only that every
figure is measured (positive where an op does work) and used."""

import pytest

from megatrain.ir.trace import trace
from megatrain.models import preset
from megatrain.planner import TrainSpec, hardware_preset
from megatrain.planner.costs import CostModel
from megatrain.runtime.build import profiled
from megatrain.runtime.config import RunConfig
from megatrain.runtime.trainer import Trainer
from megatrain.runtime.unit_probe import cached_hardware, probe_hardware, probe_threads

SPEC = TrainSpec(micro_batch=1, seq_len=16, dtype="fp32", lr=1e-3, total_steps=10)


@pytest.fixture
def profiles(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_PROFILES", str(tmp_path))
    return tmp_path


def test_probe_measures_every_template_and_trainer_uses_the_cache(profiles):
    ir = trace(preset("tiny"), 1, 16, "fp32", target="cpu")
    assert cached_hardware(ir, "sim", probe_threads("sim")) is None
    hw = probe_hardware(ir, hardware_preset("cpu"), "sim", repeats=1, measure_contention=False)
    prof = hw.units
    assert set(prof.units) == {u.template for u in ir.units}
    for t in prof.units.values():
        assert min(t.forward_s, t.forward_graph_s, t.backward_s, t.recompute_backward_s, t.load_s, t.store_s) > 0
        assert t.optimizer_s["exact"] > 0 and t.n_params > 0
        assert t.device_step_s["exact"] > 0 and t.store_norms_s > 0  # as a unit whose state lives on the device
    costs = CostModel(ir, hw, "exact")
    assert costs.dstep == [prof.units[u.template].device_step_s["exact"] for u in ir.units]
    assert prof.dispatch_s > 0 and prof.step_gap_s >= 0
    assert cached_hardware(ir, "sim", probe_threads("sim")) == hw
    assert cached_hardware(ir, "sim", {"compute": 99}) is None  # another thread setting: another key
    with Trainer(RunConfig(model="tiny", train=SPEC, gpu_mem=6 << 20, device="sim", profile="auto")) as tr:
        assert tr.plan.hardware.units == prof and str(profiles) in tr.profile_note
        assert all(CostModel(tr.plan.ir, tr.plan.hardware, tr.plan.host_policy).measured)
    given = hardware_preset("cpu").replace(host_memory_bytes=5 << 30)
    with Trainer(RunConfig(model="tiny", train=SPEC, gpu_mem=6 << 20, hardware=given, device="sim",
                           profile="auto")) as tr:
        assert tr.plan.hardware.units == prof  # the probe's speeds, the sizes given (--host-mem)
        assert tr.plan.hardware.host_memory_bytes == 5 << 30
    with Trainer(RunConfig(model="tiny", train=SPEC, gpu_mem=6 << 20, device="sim", profile="off")) as tr:  # the preset
        assert tr.plan.hardware.units is None


def test_probe_cli_caches_and_reuses(profiles, capsys):
    from megatrain.cli import main

    args = ["probe", "--device", "cpu", "--model", "tiny", "--seq-len", "16", "--micro-batch", "1", "--dtype",
            "fp32", "--repeats", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "unit profile" in out and "cached as" in out
    assert len(list(profiles.glob("hardware-*.json"))) == 1
    assert main(args) == 0
    assert "cached profile" in capsys.readouterr().out
    assert main(["probe", "--device", "cpu", "--model", "tiny", "--micro-batch", "1"]) == 2  # no --seq-len
    assert "--seq-len" in capsys.readouterr().err
    train = ["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB", "--seq-len", "16", "--micro-batch",
             "1", "--dtype", "fp32", "--steps", "1", "--eval-every", "0"]
    assert main(train) == 0  # --hardware auto (the default): the cached probe, named
    out = capsys.readouterr().out
    assert "planned with the probe of this machine" in out and str(profiles) in out
    assert main([*train, "--hardware", "cpu"]) == 0  # a preset named: the probe is not used
    assert "planned with the probe" not in capsys.readouterr().out


def test_a_world_plans_without_a_nodes_cached_probe(profiles):
    ir = trace(preset("tiny"), 1, 16, "fp32", target="cpu")
    probe_hardware(ir, hardware_preset("cpu"), "sim", repeats=1, measure_contention=False)
    given = hardware_preset("cpu")  # only the profile choice: no device, no store
    hardware, note = profiled(ir, given, device=None, comm=object())
    assert hardware is given  # each node has a cache of its own; the ranks must agree
    assert "in a world" in note


def test_the_host_optimizer_rates_are_measured_on_the_threads_training_gives_it(monkeypatch):
    """The hardware probe times each policy's step on the host optimizer's share of the threads (cpus.py),
    not the main thread's count, and leaves the main thread's count as it was."""
    import torch

    from megatrain.runtime import cpus
    from megatrain.runtime import machine_probe as probe_module

    monkeypatch.setenv(cpus.HOST_THREADS_ENV, "1")
    assert probe_module.host_optimizer_threads("cuda") == probe_module.host_optimizer_threads("cpu") == 1
    monkeypatch.delenv(cpus.HOST_THREADS_ENV)
    assert probe_module.host_optimizer_threads("cpu") == max(1, torch.get_num_threads() // 2)
    seen = []
    monkeypatch.setattr("megatrain.runtime.host_state.step_rate",
                        lambda name, n, repeats, clip=False: seen.append(torch.get_num_threads()) or 1.0)
    own = torch.get_num_threads()
    rates = probe_module.policy_rates(1024, 1, threads=1)
    assert set(seen) == {1} and torch.get_num_threads() == own
    assert set(rates) == {k for n in probe_module.ADAMW_BYTES for k in (n, f"{n}+clip")}


def test_kept_graphs_are_timed_as_a_pass_and_the_round_leaves_the_device_as_it_found_it():
    """On the sim device the kept-graph forward and backward run as a run's pass does: `graphs` forwards in a
    row, each graph held alive (PASS_BYTES of them, at least one), then their backwards in reverse; every one
    is a timed sample, and after the round only what was live before it is."""
    from megatrain.runtime.device import make_device
    from megatrain.runtime.unit_probe import NEXT, PASS_BYTES, PASS_MAX, ProbeEngine, _ops, _run_op

    ir = trace(preset("tiny"), 2, 32, "fp32", target="cpu")
    block = ir.units[1]
    device = make_device("sim", None)
    try:
        e = ProbeEngine(ir, block, device, "exact", SPEC, 1024)
        e.stores = {"exact": e.store}
        e.put_carry()
        device.synchronize()
        assert e.graphs == min(PASS_MAX, -(-PASS_BYTES // block.saved_bytes)) and e.graphs > 1
        before = device.pool.live()
        e.timeline, e._t0, e._t0_event = [], 0.0, None
        ops = _ops(e, ["exact"], clip=False)
        kinds = [what for what, _ in ops]
        assert kinds.count("forward_graph_s") == kinds.count("backward_s") == e.graphs
        most = 0
        for what, submit in ops:
            _run_op(e, what, submit)
            held = [n for n in device.pool.live() if n.startswith("probe.held.")]
            most = max(most, len(held) + (f"saved.{block.name}.0" in device.pool))
        assert most == e.graphs  # all alive at once before the first backward
        assert device.pool.live() == before and not e.held and f"carry.{NEXT}.0" not in e.bufs
        e.store.close()
    finally:
        device.close()


def test_the_spread_of_the_rounds_names_the_op_that_varied_most():
    from megatrain.runtime.unit_probe import worst_spread

    steady, noisy = [1.0, 1.0, 1.01, 0.99, 1.0], [1.0, 2.0, 1.0, 3.0, 1.5]
    got = worst_spread({"block": {"forward_s": steady, "opt:exact": noisy, "dispatch": [9.0, 1.0, 5.0, 7.0]},
                        "head": {"load_s": steady}})
    assert got == {"block opt:exact": 1.0}  # quartiles 1.0 and 2.5 over a median of 1.5; dispatch is not a main op
    assert worst_spread({"block": {"forward_s": [1.0, 2.0, 3.0]}}) == {}  # three rounds: no quartiles


def test_refresh_measures_again_and_replaces_the_cache(profiles, capsys):
    from megatrain.cli import main

    args = ["probe", "--device", "cpu", "--model", "tiny", "--seq-len", "16", "--micro-batch", "1", "--dtype",
            "fp32", "--repeats", "4"]
    assert main(args) == 0
    (cached,) = profiles.glob("hardware-*.json")
    first = cached.read_text()
    out = capsys.readouterr().out
    assert "rounds agree within" in out
    assert main([*args, "--refresh"]) == 0
    out = capsys.readouterr().out
    assert "measuring" in out and "cached as" in out and cached.read_text() != first  # measured anew, replaced
    assert main(args) == 0 and "--refresh measures again" in capsys.readouterr().out
    assert main([*args, "--refresh", "--no-cache"]) == 2
    assert "pass one" in capsys.readouterr().err
