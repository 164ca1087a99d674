"""Units through torch.compile (megatrain/runtime/compiled.py, `train --compile-units`): streamed training with compiled
units equals eager PyTorch to fp32 round-off (losses to 1e-5; weights after AdamW steps within 1e-6 but for
under 1% of elements, where a near-zero gradient's round-off can flip an update's sign), with graphs
recomputed and kept; calls with a depth-mixing mode and MoE models run eagerly."""

import pytest
from runtime_schedules import make_batches, plans_by_shape, streamed_train

from megatrain.models import ModelConfig, preset, run_unit, templates
from megatrain.planner import TrainSpec
from megatrain.runtime.compiled import runners
from megatrain.runtime.reference import eager_train

TINY = ModelConfig(**{**preset("tiny").model_dump(), "n_layers": 2})


def test_compiled_units_equal_eager_to_round_off():
    train = TrainSpec(micro_batch=2, seq_len=32, grad_accum=2, dtype="fp32", lr=2e-3, warmup_steps=1,
                      total_steps=3, weight_decay=0.1, clip_norm=1.0)
    batches = make_batches(TINY, train, steps=3)
    model, eager_losses = eager_train(TINY, batches, train)
    plans = list(plans_by_shape(TINY, train, budgets_mib=(3, 64), replay=False).values())
    kinds = {v for p in plans for v in p.placement.values()}
    assert "keep" in kinds and ({"device", "host"} & kinds), kinds  # recomputed and kept graphs both run
    for p in plans:
        store, losses, peak = _train_compiled(p, batches)
        _assert_round_off(store, losses, model, eager_losses, train.lr, len(batches))
        # the plan's memory timeline comes from the eager trace; compiled blocks must not need more than it
        # (inductor saves what it chooses for backward; a compiled head saved its logits and passed it)
        assert 0 < peak <= p.peak_buffer_bytes, (peak, p.peak_buffer_bytes)


def _train_compiled(p, batches):
    from torch._dynamo.utils import counters

    counters.clear()
    out = streamed_train(p, batches, compile_units=True)
    assert counters["stats"]["unique_graphs"] > 0  # something was compiled: not an eager fallback throughout
    return out


def _assert_round_off(store, losses, model, eager_losses, lr, steps):
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    master = store.named_master()
    for name, param in model.named_parameters():
        # AdamW divides by sqrt(v): where a gradient is near 0 (a rare token's embedding row) its round-off
        # can flip the update's sign, at most 2 lr a step, so a few elements differ by more than round-off
        diff = (master[name] - param.detach()).abs()
        assert float(diff.max()) <= 2 * lr * steps, name
        assert int((diff > 1e-6).sum()) <= max(2, param.numel() // 100), name


def test_a_depth_mixing_rebuild_runs_its_modes_eagerly():
    """DepthSSD rebuilding a carry-in: the record and rebuild calls run eagerly, the plain ones compiled."""
    from types import SimpleNamespace

    from program_testing import program_for

    from megatrain.ir.trace import trace
    from megatrain.planner.schedule import Decisions

    config = ModelConfig(**{**TINY.model_dump(), "n_layers": 3, "depth_mixing": "depthssd:4"})
    train = TrainSpec(micro_batch=2, seq_len=32, grad_accum=2, dtype="fp32", lr=2e-3, warmup_steps=1,
                      total_steps=3, weight_decay=0.1, clip_norm=1.0)
    ir = trace(config, train.micro_batch, train.seq_len, train.dtype, target="cpu")
    program = program_for(ir, train.grad_accum, Decisions(1, 1, ("device", "rebuild", "host", "keep", "device")),
                          clip=True)
    assert any(i.source == "rebuild" for i in program.instrs if i.op == "backward")
    p = SimpleNamespace(ir=ir, program=program, train=train, gpu_budget_bytes=2**30)
    batches = make_batches(config, train, steps=2)
    model, eager_losses = eager_train(config, batches, train)
    store, losses, _ = _train_compiled(p, batches)
    _assert_round_off(store, losses, model, eager_losses, train.lr, len(batches))


def test_what_runs_eagerly():
    moe = preset("moe-tiny")
    assert set(runners(moe, templates(moe), True).values()) == {run_unit}  # MoE: its routing breaks graphs
    assert set(runners(TINY, templates(TINY), False).values()) == {run_unit}  # the default
    compiled = runners(TINY, templates(TINY), True)
    assert set(compiled) == set(templates(TINY))
    assert compiled["embed"] is compiled["head"] is run_unit and compiled["block"] is not run_unit


def test_no_compiler_is_one_line_before_any_work(monkeypatch, capsys):
    import shutil

    from megatrain.cli import main

    monkeypatch.setattr(shutil, "which", lambda name: None)
    args = ["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB", "--seq-len", "16", "--micro-batch",
            "1", "--steps", "1", "--compile-units", "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "--compile-units" in err and "C++ compiler" in err and "drop --compile-units" in err


def test_packed_batches_compile_and_equal_eager(tmp_path):
    """Packed documents (fine-tuning on chat data): the per-batch document boundaries change shapes, which
    the compiled units follow (dynamic after the first change) instead of falling back to eager."""
    from test_examples import _examples

    from megatrain.runtime.data import TokenFile
    from megatrain.runtime.examples import ExampleBatcher, write_example_file

    path = write_example_file(tmp_path / "train.bin", _examples(), vocab_size=256, tokenizer="bytes", format="chat")
    train = TrainSpec(micro_batch=2, seq_len=48, grad_accum=2, dtype="fp32", lr=2e-3, warmup_steps=1,
                      total_steps=3, clip_norm=1.0)
    b = ExampleBatcher(TokenFile.open(path), 2, 48, 2, seed=0)
    batches = [b.batch(s) for s in range(3)]
    model, eager_losses = eager_train(TINY, batches, train)
    (p,) = plans_by_shape(TINY, train, budgets_mib=(64,), packed=True).values()
    store, losses, _ = _train_compiled(p, batches)
    _assert_round_off(store, losses, model, eager_losses, train.lr, len(batches))
