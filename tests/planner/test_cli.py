"""`megatrain plan | tune | probe` through megatrain.cli.main (megatrain/cli/plan.py): output, files, errors and exit codes."""

import json

import pytest

from megatrain.cli import main
from megatrain.planner import Plan

TINY = ["--model", "tiny", "--hardware", "cpu", "--seq-len", "128"]


def test_plan_prints_summary_table_sparkline_and_explain(capsys, cached_traces):
    assert main(["plan", *TINY, "--micro-batch", "2", "--grad-accum", "2", "--gpu-mem", "8MiB", "--explain"]) == 0
    out = capsys.readouterr().out
    for text in ("GPU   peak", "host ", "tokens/s", "MFU", "bottleneck", "blocks.0", "memory |", "passes:",
                 "[slots]", "[checkpoints]", "[order]", "[optimizer]", "[lower]", "[buffers]", "[sync]",
                 "[verify]", "[estimate]"):
        assert text in out


def test_plan_trace_and_save(tmp_path, capsys, cached_traces):
    trace, saved = tmp_path / "t.json", tmp_path / "plan.json"
    assert main(["plan", *TINY, "--micro-batch", "2", "--trace", str(trace), "--save", str(saved)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert threads == {"compute", "h2d", "d2h", "host"}
    assert any(e["ph"] == "C" and e["name"].startswith("device memory") for e in events)
    assert {e["tid"] for e in events if e["ph"] == "X"} == {1, 2, 3, 4}
    plan = Plan.from_json(saved.read_text())
    assert plan.ir.model == "tiny" and "wrote trace" in capsys.readouterr().out


def test_plan_trace_of_a_world_has_a_comm_track(tmp_path, cached_traces):
    trace = tmp_path / "t.json"
    assert main(["plan", *TINY, "--micro-batch", "1", "--grad-accum", "2", "--nproc", "2", "--trace", str(trace)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    comm = [e for e in events if e["ph"] == "X" and e["tid"] == 5]
    assert {e["args"]["name"] for e in events if e.get("name") == "thread_name"} == {"compute", "h2d", "d2h",
                                                                                     "host", "comm"}
    assert comm and all(e["dur"] > 0 for e in comm)


def test_plan_json_infeasible_is_machine_readable(capsys, cached_traces):
    assert main(["plan", *TINY, "--gpu-mem", "100KiB", "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["feasible"] is False and out["needed_bytes"] > out["gpu_budget_bytes"] == 100 * 1024


@pytest.mark.parametrize("argv, message", [
    (["plan", *TINY, "--gpu-mem", "lots"], "cannot read 'lots' as a byte size"),
    (["plan", *TINY, "--gpu-mem", "1TiB"], "exceeds the 8 GiB of cpu"),
    (["plan", *TINY, "--dtype", "fp8"], "bf16"),
    (["plan", "--model", "gpt5", "--hardware", "cpu", "--seq-len", "8"], "unknown model preset 'gpt5'"),
    (["plan", *TINY[:2], "--hardware", "tpu", "--seq-len", "8"], "unknown hardware 'tpu'"),
    (["tune", *TINY, "--gpu-mem", "8MiB", "--micro-batch", "one"], "comma-separated integers"),
])
def test_user_errors_print_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_tune_table_and_json(capsys, cached_traces):
    argv = ["tune", *TINY, "--gpu-mem", "100KiB,6MiB,8MiB,64MiB", "--micro-batch", "1,2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Pareto" in out and "infeasible" in out
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 8 and any(r["pareto"] for r in rows) and not rows[0]["feasible"]


def test_probe_cpu_writes_a_profile(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    assert main(["probe", "--device", "cpu", "--quick", "--out", str(out)]) == 0
    assert main(["plan", *TINY[:2], "--hardware", str(out), "--seq-len", "128", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["feasible"]
