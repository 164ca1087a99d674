"""Long context on the sim device: tiled units stream exactly, and the pool's peak is the plan's.

Streamed training with units tiled in chunks equals eager training tiled the same way bit for bit (the
same ops on the same shapes in the same order), over schedules with checkpoints on device, on host and kept,
dense and with depth mixings. A plan the chunks pass tiles, at a sequence the trace scales, measures on the
sim device exactly the buffer peak it predicts, far below what the untiled units would need.
"""

from types import SimpleNamespace

import pytest
from program_testing import program_for
from runtime_schedules import MIB, make_batches, streamed_train

from megatrain.ir.trace import trace
from megatrain.models import ModelConfig, preset
from megatrain.planner import TrainSpec, hardware_preset, plan
from megatrain.planner.placement import exact_timeline, minimal
from megatrain.planner.schedule import Decisions
from megatrain.planner.timeline import peak_buffer_bytes
from megatrain.runtime.reference import eager_train

TINY = preset("tiny")


def _bit_equal(store, losses, model, eager_losses):
    assert losses == eager_losses
    master = store.named_master()
    assert sorted(master) == sorted(n for n, _ in model.named_parameters())
    for name, param in model.named_parameters():
        assert master[name].equal(param.detach()), name


@pytest.mark.parametrize("mixing, grad_accum", [("residual", 2), ("depthssd:4", 1),
                                                pytest.param("hc-dynamic:2", 2, marks=pytest.mark.slow)])
def test_streamed_tiled_equals_eager_tiled_bit_for_bit(mixing, grad_accum):
    config = ModelConfig(**{**TINY.model_dump(), "n_layers": 3, "depth_mixing": mixing})
    train = TrainSpec(micro_batch=2, seq_len=64, grad_accum=grad_accum, dtype="fp32", lr=2e-3, warmup_steps=1,
                      total_steps=3, weight_decay=0.1, clip_norm=1.0)
    batches = make_batches(config, train, steps=2)
    model, eager_losses = eager_train(config, batches, train, chunk_tokens=24)
    ir = trace(config, 2, 64, "fp32", target="cpu", chunk_tokens=24)  # 24 does not divide 64: a short last tile
    assert ir.chunk_tokens == 24
    for slots, placement in [(1, ("device", "host", "host", "keep", "keep")),
                             (2, ("device", "keep", "device", "host", "device"))]:
        program = program_for(ir, grad_accum, Decisions(slots, 1, placement), clip=True)
        p = SimpleNamespace(ir=ir, program=program, train=train, gpu_budget_bytes=2**30)
        store, losses, peak = streamed_train(p, batches)
        _bit_equal(store, losses, model, eager_losses)
        assert peak == peak_buffer_bytes(program)


def test_staged_checkpoint_copies_stream_exactly(monkeypatch):
    """Checkpoints longer than the staging chunk (shrunk to 4 KiB here, so the 64 KiB carries cross in 16
    chunks) go through the pinned staging buffers into pageable host memory, and training stays bit-exact."""
    from megatrain.runtime import engine, staging

    monkeypatch.setattr(engine, "STAGING_BYTES", 4096)
    calls = []
    for name in ("to_host", "to_device"):
        real = getattr(staging.Staging, name)
        monkeypatch.setattr(staging.Staging, name, lambda self, d, s, real=real, n=name: calls.append(n) or real(self, d, s))
    train = TrainSpec(micro_batch=2, seq_len=64, grad_accum=2, dtype="fp32", lr=2e-3, total_steps=2, clip_norm=1.0)
    batches = make_batches(TINY, train, steps=2)
    model, eager_losses = eager_train(TINY, batches, train)
    ir = trace(TINY, 2, 64, "fp32", target="cpu")
    program = program_for(ir, 2, Decisions(1, 1, ("device", *["host"] * (len(ir.units) - 1))), clip=True)
    store, losses, _ = streamed_train(SimpleNamespace(ir=ir, program=program, train=train, gpu_budget_bytes=2**30),
                                      batches)
    _bit_equal(store, losses, model, eager_losses)
    assert calls.count("to_host") == calls.count("to_device") == 2 * 2 * (len(ir.units) - 1)  # steps x micro-batches


def _long_plan(seq_len, n_layers, budget_mib):
    config = ModelConfig(**{**TINY.model_dump(), "n_layers": n_layers, "max_seq_len": seq_len})
    train = TrainSpec(micro_batch=1, seq_len=seq_len, grad_accum=1, dtype="fp32", lr=1e-3, total_steps=2)
    ir = trace(config, 1, seq_len, "fp32", target="cpu", chunk_options=True, scaled=True)
    return config, train, ir, plan(ir, hardware_preset("cpu"), train, budget_mib * MIB)


def _check_long(seq_len, n_layers, budget_mib):
    config, train, ir, p = _long_plan(seq_len, n_layers, budget_mib)
    assert ir.traced_seq_len is not None and ir.traced_seq_len < seq_len
    assert p.ir.chunk_tokens is not None and p.ir.chunk_tokens < seq_len
    untiled = ir.with_chunk(None)
    floor = exact_timeline(untiled, 1, minimal(untiled), False).peak  # the least the untiled units need
    assert p.peak_device_bytes < floor / 2
    store, losses, peak = streamed_train(p, make_batches(config, train, steps=1))
    assert peak == p.peak_buffer_bytes <= p.gpu_budget_bytes
    assert losses[0] > 0


def test_sim_peak_equals_plan_for_a_tiled_long_sequence():
    _check_long(8192, 1, 52)


@pytest.mark.slow
def test_sim_peak_equals_plan_at_32k_tokens():
    _check_long(32768, 2, 220)
