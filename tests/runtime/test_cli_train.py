"""`megatrain train` and `megatrain compile` end to end on tiny inputs."""

import json

import pytest

from megatrain.cli import main
from megatrain.codegen import load


@pytest.fixture()
def token_files(tmp_path):
    from runtime_schedules import make_token_files

    return make_token_files(tmp_path)


def test_train_writes_metrics_and_trace(tmp_path, token_files, capsys):
    train, val = token_files
    metrics, trace = tmp_path / "m.jsonl", tmp_path / "t.json"
    rc = main(["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB", "--seq-len", "64",
               "--micro-batch", "2", "--grad-accum", "2", "--dtype", "fp32", "--steps", "6", "--lr", "3e-3",
               "--data", str(train), "--val-data", str(val), "--eval-every", "3", "--metrics", str(metrics),
               "--trace", str(trace), "--no-progress"])
    assert rc == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for r in records:
        assert {"step", "loss", "tokens_per_s", "peak_device_bytes", "planned_peak_device_bytes"} <= set(r)
        assert r["peak_device_bytes"] == r["planned_peak_device_bytes"]
    assert records[-1]["loss"] < records[0]["loss"]
    assert "val_loss" in records[2] and "val_loss" in records[5]
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e.get("tid") for e in events if e["ph"] == "X"} == {1, 2, 3, 4}  # all four streams worked
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["last_loss"] < summary["first_loss"]
    tokens = 2 * 64 * 2  # micro-batch x seq-len x grad-accum: the plan's promise beside the measurement
    assert summary["predicted_tokens_per_s"] == round(tokens / records[-1]["predicted_step_time_s"], 1)


def test_compile_writes_a_loadable_step_program(tmp_path):
    out = tmp_path / "step.py"
    assert main(["compile", "--model", "tiny", "--hardware", "cpu", "--gpu-mem", "6MiB", "--seq-len", "64",
                 "--micro-batch", "2", "--dtype", "fp32", "-o", str(out)]) == 0
    source = out.read_text()
    assert callable(load(source).step)
    assert "rt.forward(" in source and "rt.optimizer_step(" in source


@pytest.mark.parametrize("argv, needle", [
    (["train", "--model", "tiny", "--gpu-mem", "80XB", "--seq-len", "64", "--steps", "1"], "80XB"),
    (["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "100KiB", "--seq-len", "64", "--steps", "1",
      "--dtype", "fp32"], "smallest workable budget"),
    (["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB", "--seq-len", "64", "--steps", "1",
      "--dtype", "fp32", "--data", "/nonexistent/train.bin"], "train.bin"),
    (["compile", "--model", "tiny", "--hardware", "cpu", "--gpu-mem", "6MiB", "--seq-len", "64",
      "--dtype", "fp32", "-o", "/dev/null/dir/step.py"], "writable"),
])
def test_bad_input_is_one_line(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err
