"""`megatrain train --plot`: the measured step (megatrain/runtime/timeline.measured_series) drawn beside the plan, and
a bad --plot refused before training starts."""

import sys

import pytest

from megatrain.cli import main
from megatrain.runtime.timeline import measured_series

TRAIN = ["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB", "--seq-len", "32",
         "--micro-batch", "2", "--dtype", "fp32", "--steps", "2", "--no-progress"]


@pytest.fixture()
def data(tmp_path):
    from runtime_schedules import make_token_files

    train, val = make_token_files(tmp_path)
    return ["--data", str(train), "--val-data", str(val)]


def test_measured_series_takes_one_step_and_what_runs_into_it():
    spans = [("compute", "forward(embed, slot=0, mb=0)", 0, 0.0, 1.0, 10),
             ("host", "optimizer_step(head)", 0, 1.5, 2.5, 10),
             ("compute", "free(carry.head.0)", 0, 1.0, 1.1, 4),
             ("compute", "forward(embed, slot=0, mb=0)", 1, 2.0, 3.0, 12),
             ("h2d", "load_params(blocks.0, slot=1)", 1, 2.1, 2.4, 12),
             ("compute", "backward(embed, slot=0, grad_slot=0, mb=0)", 1, 3.0, 4.0, 6)]
    m = measured_series(spans)
    assert m.step == 2 and m.end_s == 2.0 and m.peak_bytes == 12
    assert m.memory == ((0.0, 4), (1.0, 12), (2.0, 6))  # from what step 1 left, then after each compute op
    prev = [s for s in m.spans if s.previous]
    assert [(s.op, s.unit, s.start, s.end) for s in prev] == [("optimizer_step", "head", 0.0, 0.5)]
    assert [(s.lane, s.op, s.unit) for s in m.spans if not s.previous] == [
        ("compute", "forward", "embed"), ("h2d", "load_params", "blocks.0"), ("compute", "backward", "embed")]
    assert measured_series(spans, step=1).memory == ((1.0, 10), (1.1, 4))
    with pytest.raises(ValueError, match="no measured spans for step 7"):
        measured_series(spans, step=7)


def test_train_plot_draws_the_last_step(tmp_path, data, capsys):
    out = tmp_path / "run.png"
    assert main([*TRAIN, *data, "--plot", str(out)]) == 0
    assert f"wrote plot of step 2 to {out}" in capsys.readouterr().out
    assert out.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("plot, blocked, needle", [
    ("run.png", True, "--plot needs matplotlib: pip install matplotlib"),
    ("run.jpg", False, "use .png or .svg"),
])
def test_a_bad_plot_is_refused_before_training(tmp_path, data, monkeypatch, capsys, plot, blocked, needle):
    from megatrain.runtime import trainer

    def no_training(*a, **k):
        raise AssertionError("training started before --plot was checked")

    monkeypatch.setattr(trainer, "Trainer", no_training)
    if blocked:
        monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main([*TRAIN, *data, "--plot", str(tmp_path / plot)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err
