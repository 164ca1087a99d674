"""`megatrain report` (megatrain/runtime/report.py): tolerant reading of metrics files, labels, the text summary."""

import json

import pytest

from megatrain.cli import main
from megatrain.runtime.report import labels, read_metrics, summary_lines


def _write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def _rec(step, **kw):
    return {"step": step, "loss": 4.0 - step / 10, "step_time_s": 0.25, "tokens_per_s": 512.0, **kw}


def test_torn_line_events_and_relogged_steps(tmp_path):
    records = [_rec(1), _rec(2), {"step": 2, "event": "skipped", "reason": "nan"}, _rec(3), _rec(2, loss=9.0),
               _rec(4, val_loss=3.5)]
    path = _write(tmp_path / "run.jsonl", records, '{"step": 5, "lo')
    run = read_metrics(path)
    assert [r["step"] for r in run.records] == [1, 2, 3, 4]  # a resumed run re-logged step 2: the last wins
    assert run.records[1]["loss"] == 9.0 and run.torn and len(run.events) == 1
    assert run.tokens_per_step == 128 and run.series("val_loss") == ([512], [3.5])
    assert run.skipped_tokens() == [256] and run.label == "run"
    assert run.relogged == 1 and any("1 step record(s) repeat a step" in line for line in summary_lines(run))


@pytest.mark.parametrize("text, needle", [
    ('{"step": 1, "lo\n' + json.dumps(_rec(2)) + "\n", "line 1: not JSON"),
    ("[1, 2]\n", "expected a JSON object"),
    ('{"step": 1, "loss": 2.0}\n', "needs step_time_s, tokens_per_s"),
    ('{"step": 1, "event": "skipped"}\n', "no step records"),
])
def test_not_a_metrics_file_is_one_line(tmp_path, text, needle, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err


def test_labels_are_stems_told_apart_by_folders():
    assert labels(["a/metrics.jsonl", "b/metrics.jsonl"]) == ["a/metrics", "b/metrics"]
    assert labels(["out/lr1.jsonl", "out/lr2.jsonl"]) == ["lr1", "lr2"]
    assert labels(["x.jsonl", "x.jsonl"]) == ["x (1)", "x (2)"]


def test_report_prints_a_summary_per_file_and_draws_on_request(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", [_rec(k, grad_norm=1.0 / k, predicted_step_time_s=0.2)
                                      for k in (1, 2, 3)])
    b = _write(tmp_path / "b.jsonl", [_rec(1, moe_load_max_over_mean=1.5), {"step": 2, "event": "skipped"},
                                      _rec(2, moe_load_max_over_mean=1.25, val_loss=3.0)])
    assert main(["report", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "a: steps 1-3 (3 records, 384 tokens), loss 3.9 -> 3.7" in out
    assert "(predicted 0.2 s)" in out and "grad norm 1 -> 0.3333" in out
    assert "b: steps 1-2" in out and "val loss 3" in out and "MoE max/mean expert load 1.25" in out
    assert "1 step(s) skipped for a NaN/inf: 2" in out
    assert main(["report", str(a), str(b), "--plot", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes().startswith(b"\x89PNG")
    assert "wrote plot" in capsys.readouterr().out


def test_a_cuda_runs_summary_shows_each_measured_memory_figure_beside_its_plan_figure(tmp_path):
    from megatrain.runtime.report import summary_lines

    gib = 2**30
    mem = {"peak_device_bytes": 10 * gib, "planned_peak_device_bytes": 11 * gib, "peak_reserved_bytes": 12 * gib,
           "planned_peak_reserved_bytes": 13 * gib, "device_used_bytes": 14 * gib, "planned_peak_gpu_bytes": 15 * gib}
    line = summary_lines(read_metrics(_write(tmp_path / "g.jsonl", [_rec(1, **mem)])))[1]
    assert "device peak 10 GiB (planned 11 GiB), reserved 12 GiB (planned 13 GiB)" in line
    assert "GPU in use 14 GiB (planned 15 GiB)" in line
