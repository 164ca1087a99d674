"""Units whose state lives on the device (issue 40, runtime/resident.py) keep the central invariant: training with
some units' optimizer state on the device ("device") or their weights kept there ("weights") equals the same run
all streamed bit for bit (every master, moment and step count) and equals eager training; the plan's device
peak, host bytes and device state bytes are what the run allocates; a checkpoint and its resume, export and the
fault verdict are unchanged by it."""

import functools

import pytest
import torch
from runtime_schedules import make_batches, streamed_train

from megatrain import fake_cuda
from megatrain.codegen import emit, load
from megatrain.ir.trace import trace
from megatrain.models import ModelConfig, preset
from megatrain.planner import TrainSpec, hardware_preset, plan
from megatrain.runtime import checkpoint
from megatrain.runtime.engine import Engine
from megatrain.runtime.evaluation import evaluate
from megatrain.runtime.export import export_weights
from megatrain.runtime.optim import lr_at
from megatrain.runtime.reference import eager_train, mixed_train
from megatrain.runtime.store import HostStore
from megatrain.runtime.stream_device import SimDevice

TINY = preset("tiny")
MAPPING = {"embed": "device", "blocks.1": "device", "blocks.0": "weights"}
MIB = 2**20


def _train(dtype="fp32", grad_accum=1, clip=None):
    return TrainSpec(micro_batch=2, seq_len=64, grad_accum=grad_accum, dtype=dtype, lr=2e-3, warmup_steps=1,
                     total_steps=3, weight_decay=0.1, clip_norm=clip)


@functools.cache
def _ir(config, dtype, target):
    return trace(config, 2, 64, dtype, target=target)


def _plans(config, train, mapping=MAPPING, target="cpu"):
    ir = _ir(config, train.dtype, target)
    hw = hardware_preset("cpu")
    return (plan(ir, hw, train, 16 * MIB, host_policy="exact"),
            plan(ir, hw, train, 16 * MIB, host_policy="exact", resident=mapping))


def _same_state(a: HostStore, b: HostStore) -> None:
    for unit in a.units:
        sa, sb = a.state_tensors(unit), b.state_tensors(unit)
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"{k} differs"


@pytest.mark.parametrize("dtype, grad_accum, clip", [
    ("fp32", 2, 1.0), ("bf16", 1, None),  # a barrier (device steps after clip_grads) and none (right after the backward)
    pytest.param("fp32", 1, None, marks=pytest.mark.slow), pytest.param("bf16", 2, 0.05, marks=pytest.mark.slow)])
def test_resident_units_train_as_streamed_and_eager(dtype, grad_accum, clip):
    _trains_as_streamed_and_eager(_train(dtype, grad_accum, clip), MAPPING, ("embed", "blocks.0", "blocks.1"))


# every unit but one keeping its weights on the device (the last block streams: the shared slots have a unit)
WEIGHTS = {"embed": "weights", "blocks.0": "weights", "blocks.1": "weights", "blocks.2": "weights", "head": "weights"}


@pytest.mark.parametrize("dtype, grad_accum, clip", [("bf16", 2, 1.0), ("fp32", 1, None)])
def test_weights_units_train_as_streamed_and_eager(dtype, grad_accum, clip):
    """A plan whose units keep only their weights on the device ("weights": loaded once a step, never reloaded
    for the backward, stepped by the host) trains as all streamed and as eager, bit for bit."""
    train = _train(dtype, grad_accum, clip)
    resident = _trains_as_streamed_and_eager(train, WEIGHTS, tuple(WEIGHTS))
    loads = [i.unit for i in resident.program.instrs if i.op == "load_params"]
    assert all(loads.count(u) == 1 for u in WEIGHTS) and loads.count("blocks.3") >= 1
    assert not any(i.op == "device_step" for i in resident.program.instrs)


def _trains_as_streamed_and_eager(train, mapping, units):
    """Train 3 steps with `mapping`'s places and all streamed: the same losses, every master, moment and step
    count bit for bit, the planned peak and host bytes, and eager training's weights. Returns the plan."""
    streamed, resident = _plans(TINY, train, mapping)
    assert resident.resident_units == units
    dtype = train.dtype
    batches = make_batches(TINY, train, steps=3)
    s0, l0, _ = streamed_train(streamed, batches)
    s1, l1, peak = streamed_train(resident, batches)
    assert l1 == l0
    assert peak == resident.peak_buffer_bytes  # the dedicated slots and dstate buffers, to the byte
    assert s1.host_bytes() == resident.host_bytes  # no host gradient buffer for the device units
    _same_state(s0, s1)
    model, eager_losses = (eager_train if dtype == "fp32" else mixed_train)(TINY, batches, train)
    assert l1 == pytest.approx(eager_losses, rel=1e-6)
    master = s1.named_master()
    for name, param in model.named_parameters():
        assert torch.equal(master[name], param.detach()), name
    return resident


def test_depth_mixing_units_reside_too():
    config = ModelConfig(**{**TINY.model_dump(), "n_layers": 3, "depth_mixing": "depthssd:4"})
    train = _train("fp32", 2, 1.0)
    streamed, resident = _plans(config, train, {"blocks.2": "device", "embed": "device"})
    batches = make_batches(config, train, steps=2)
    s0, l0, _ = streamed_train(streamed, batches)
    s1, l1, _ = streamed_train(resident, batches)
    assert l1 == l0
    _same_state(s0, s1)


def _engine(p, dev, init=True):
    store = HostStore(p.ir, p.train, seed=p.train.seed, policy=p.host_policy, program=p.program, device=dev.kind,
                      init=init)
    return store, Engine(p.ir, p.program, dev, store)


def test_checkpoint_resume_and_export_of_resident_units(tmp_path):
    train = _train("fp32", 2, 1.0)
    streamed, resident = _plans(TINY, train)
    batches = make_batches(TINY, train, steps=3)
    step = load(emit(resident)).step
    meta = {"model": TINY.model_dump(), "train": train.model_dump(mode="json")}
    whole, _, _ = streamed_train(streamed, batches)
    with SimDevice(budget_bytes=resident.gpu_budget_bytes) as dev:
        store, engine = _engine(resident, dev)
        for i in range(2):
            step(engine, batches[i], lr_at(train, i))
        dev.synchronize()
        saved = checkpoint.save_checkpoint(tmp_path / "run", 2, store, meta)  # the store pulls the device state
        # the evaluation program reads the device units' stepped weights from their own slots
        val = evaluate(engine, batches[2])
    with SimDevice(budget_bytes=streamed.gpu_budget_bytes) as dev:
        store0, engine0 = _engine(streamed, dev)
        streamed_step = load(emit(streamed)).step
        for i in range(2):
            streamed_step(engine0, batches[i], lr_at(train, i))
        dev.synchronize()
        assert evaluate(engine0, batches[2]) == val
    with SimDevice(budget_bytes=resident.gpu_budget_bytes) as dev:
        store, engine = _engine(resident, dev, init=False)
        checkpoint.load_checkpoint(saved, checkpoint.read_manifest(saved), store)  # uploaded at the next begin
        engine.step_index = 2
        step(engine, batches[2], lr_at(train, 2))
        dev.synchronize()
        _same_state(whole, store)
        final = checkpoint.save_checkpoint(tmp_path / "run", 3, store, meta)
    ref = checkpoint.save_checkpoint(tmp_path / "ref", 3, whole, meta)
    a, b = export_weights(final, tmp_path / "a.safetensors"), export_weights(ref, tmp_path / "b.safetensors")
    assert a["tensors"] == b["tensors"]
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_a_non_finite_gradient_never_reaches_a_device_master():
    """No barrier (no clip): each device unit's own norms decide on the device, the host hears of it at end()."""
    train = _train("fp32", 1, None)
    units = ("embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head")  # every unit on the device: no host step sees the fault
    _, resident = _plans(TINY, train, dict.fromkeys(units, "device"))
    batches = make_batches(TINY, train, steps=1)
    step = load(emit(resident)).step
    with SimDevice(budget_bytes=resident.gpu_budget_bytes) as dev:
        store, engine = _engine(resident, dev)
        store.check_finite = True
        head = store.named_master()["head.lm_head.weight"]
        head[0] = float("nan")  # every gradient below the head is NaN
        before = {u: {k: v.clone() for k, v in store.state_tensors(u).items()} for u in units}
        step(engine, batches[0], 1e-3)
        dev.synchronize()
        faults = store.take_faults()
        assert {why for _, why in faults} == {f"the gradients of {u} are not finite" for u in units}, faults
        for unit, state in before.items():
            now = store.state_tensors(unit)
            for k, v in state.items():  # the injected NaN included
                torch.testing.assert_close(now[k], v, rtol=0, atol=0, equal_nan=True, msg=k)


@pytest.mark.cuda
@pytest.mark.skipif(not fake_cuda.installed(), reason="checks the CUDA path on the fake backend (make test-cuda-fake)")
def test_a_resident_step_on_the_cuda_path_waits_only_where_the_program_says():
    train = _train("bf16", 2, 1.0)
    streamed, resident = _plans(TINY, train, target="cuda")
    batches = make_batches(TINY, train, steps=2)
    state = fake_cuda.state()
    state.syncs.clear()
    s1, l1, _ = streamed_train(resident, batches, kind="cuda")
    implicit = [(k, where) for k, where in state.syncs if k.startswith("implicit")]
    assert not implicit, implicit[:5]
    # the upload at construction and the step's end: the device's own synchronize, nothing inside a step
    assert {where.split(":")[0] for k, where in state.syncs} <= {"runtime/device.py"}, state.syncs[:5]
    s0, l0, _ = streamed_train(streamed, batches, kind="cuda")
    assert l1 == pytest.approx(l0, rel=1e-5)
    m0, m1 = s0.named_master(), s1.named_master()
    for name in m0:
        torch.testing.assert_close(m1[name], m0[name], rtol=1e-5, atol=1e-6, msg=name)
