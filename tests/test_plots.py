"""megatrain/plots.py: each picture, drawn for a small model without pyplot, shows the plan's or the metrics'
numbers (read back from the Axes: stacked bands, the budget line, lane rectangles, curves, the front), is
written atomically in the format its suffix names, and `--plot` refuses in one line before any work when
matplotlib is missing or the path is wrong.
"""

import json
import sys

import pytest

from megatrain import plots
from megatrain.cli import main
from megatrain.planner import TrainSpec, hardware_preset, plan, tune
from megatrain.planner.loading import trace_model
from megatrain.planner.series import LAYERS, plan_series, tune_points
from megatrain.planner.synthetic import transformer_ir
from megatrain.runtime.report import read_runs
from megatrain.runtime.timeline import measured_series

TINY = ["--model", "tiny", "--hardware", "cpu", "--seq-len", "64", "--dtype", "fp32"]


@pytest.fixture(scope="module")
def tiny():
    hw = hardware_preset("cpu").replace(reserved_bytes=2**19, allocator_margin=0.05)
    ir = trace_model("tiny", 2, 64, "fp32", "cpu")
    return plan(ir, hw, TrainSpec(micro_batch=2, seq_len=64, dtype="fp32", grad_accum=2), 6 * 2**20)


def _by_gid(ax, prefix: str) -> dict:
    return {a.get_gid(): a for a in (*ax.collections, *ax.lines, *ax.texts)
            if (a.get_gid() or "").startswith(prefix)}


def _rects(coll) -> list[float]:
    """The x extents of a broken_barh's rectangles, in order, flat: [start, end, start, end, ...]."""
    return _flat((p.vertices[:, 0].min(), p.vertices[:, 0].max()) for p in coll.get_paths())


def _flat(pairs) -> list[float]:
    return [float(v) for pair in sorted(pairs) for v in pair]


def test_plan_picture_stacks_the_peak_by_kind_under_the_budget(tiny):
    s = plan_series(tiny)
    fig = plots.plan_figure(s)
    mem, lanes = fig.axes[:2]
    tscale, _ = plots.time_unit(s.step_time_s)
    bscale, _ = plots.byte_unit(s.peak_gpu_bytes)
    layers = _by_gid(mem, "layer:")
    assert set(layers) == {f"layer:{k}" for k in LAYERS if any(s.memory.layers[k])}
    j = s.peak
    x = (s.memory.start[j] + s.memory.end[j]) / 2 / tscale
    base = 0.0
    for k in LAYERS:  # at the peak each band is as thick as its kind's bytes, stacked in order
        v = s.memory.layers[k][j] / bscale
        if v:
            path = layers[f"layer:{k}"].get_paths()[0]
            assert path.contains_point((x, base + v / 2)), k
            assert not path.contains_point((x, base + v * 1.02)), k
            assert not path.contains_point((x, base - v * 0.02)), k
        base += v
    assert base == pytest.approx(tiny.peak_gpu_bytes / bscale)
    top = layers["layer:reserve"].get_paths()[0].vertices[:, 1].max()
    assert top == pytest.approx(tiny.peak_gpu_bytes / bscale)  # nowhere above the plan's peak
    budget = _by_gid(mem, "budget")["budget"]
    assert list(budget.get_ydata()) == [tiny.gpu_budget_bytes / bscale] * 2
    assert list(_by_gid(mem, "peak")["peak"].get_ydata()) == [pytest.approx(top)]
    for lane in ("compute", "h2d", "d2h", "host"):  # lane rectangles are the predicted intervals
        for op in {sp.op for sp in s.spans if sp.lane == lane and not sp.previous}:
            want = _flat((sp.start / tscale, sp.end / tscale) for sp in s.spans
                         if sp.lane == lane and sp.op == op and not sp.previous)
            assert _rects(_by_gid(lanes, f"lane:{lane}:{op}")[f"lane:{lane}:{op}"]) == pytest.approx(want)
    ticks = [t.get_text() for t in lanes.get_yticklabels()]
    assert f"compute\nbusy {s.busy['compute']:.0%}\n(bottleneck)" in ticks
    assert any("host optimizer" in t for t in ticks)
    groups = {g.removeprefix("group:") for g in _by_gid(lanes, "group:")}
    assert groups and groups <= {lab.text for lab in s.labels}
    assert "bottleneck compute" in fig.get_suptitle()


def test_a_budget_far_above_the_peak_is_a_note_not_a_line(tiny):
    roomy = plan(tiny.ir, tiny.hardware, tiny.train, 512 * 2**20)
    mem = plots.plan_figure(plan_series(roomy)).axes[0]
    assert "budget" not in _by_gid(mem, "budget")
    assert "off the scale" in _by_gid(mem, "budget-note")["budget-note"].get_text()


def _measured_from(s, speed: float = 0.5) -> list[tuple]:
    """Engine.measured_spans()-shaped tuples: the predicted step run at `speed`x the time, two steps."""
    out = []
    for step in (0, 1):
        t0 = step * s.step_time_s * speed
        for sp in s.spans:
            if sp.previous:
                continue
            label = f"{sp.op}({sp.unit}, slot=0)" if sp.unit else f"{sp.op}(buf)"
            out.append((sp.lane, label, step, t0 + sp.start * speed, t0 + sp.end * speed, 1000 * (step + 1)))
    return sorted(out, key=lambda t: t[3])


def test_run_picture_puts_the_measured_step_beside_the_plan(tiny):
    s = plan_series(tiny)
    measured = measured_series(_measured_from(s))
    assert measured.step == 2 and measured.memory[0] == (0.0, 1000) and measured.peak_bytes == 2000
    assert {sp.unit for sp in measured.spans if sp.op == "forward"} == \
        {sp.unit for sp in s.spans if sp.op == "forward"}
    fig = plots.run_figure(s, measured)
    mem, lanes = fig.axes[:2]
    buffers = {"layer:param_slot", "layer:grad_slot", "layer:static", "layer:checkpoint", "layer:grad_carry"}
    assert set(_by_gid(mem, "layer:")) <= buffers  # the pool counts buffers, not workspace
    tscale, _ = plots.time_unit(s.step_time_s)
    bscale, _ = plots.byte_unit(max(measured.peak_bytes, tiny.peak_buffer_bytes))
    line = _by_gid(mem, "measured-memory")["measured-memory"]
    assert list(line.get_ydata())[:-1] == pytest.approx([m / bscale for _, m in measured.memory])
    want = _flat((sp.start / tscale, sp.end / tscale) for sp in measured.spans if sp.lane == "h2d"
                 and sp.op == "load_params" and not sp.previous)
    key = "lane:h2d:measured:load_params"
    assert _rects(_by_gid(lanes, key)[key]) == pytest.approx(want)
    ticks = [t.get_text() for t in lanes.get_yticklabels()]
    assert ticks[:2] == ["compute \u00b7 plan", "compute \u00b7 measured"]
    fast = measured_series(_measured_from(s, speed=0.1))  # 10x apart: each side as a fraction of its step
    lanes = plots.run_figure(s, fast).axes[1]
    assert lanes.get_xlim() == (0, 1) and "fraction of each step" in lanes.get_xlabel()
    for key, spans, period in (("measured", fast.spans, fast.end_s), ("plan", s.spans, s.step_time_s)):
        want = _flat((sp.start / period, sp.end / period) for sp in spans if sp.lane == "compute"
                     and sp.op == "backward" and not sp.previous)
        assert _rects(_by_gid(lanes, f"lane:compute:{key}:backward")[f"lane:compute:{key}:backward"]) == \
            pytest.approx(want)


def _metrics(path, steps, moe=False, skip=None, torn=False):
    lines = []
    for k in range(1, steps + 1):
        rec = {"step": k, "loss": 5.0 / k, "lr": 1e-3, "step_time_s": 0.5, "tokens_per_s": 256.0,
               "peak_device_bytes": 10, "planned_peak_device_bytes": 10, "predicted_step_time_s": 0.4,
               "grad_norm": 2.0 / k}
        if k % 2 == 0:
            rec["val_loss"] = 6.0 / k
        if moe:
            rec.update(moe_load_max_over_mean=1.0 + 1 / k, moe_experts_per_token=2.0)
        lines.append(json.dumps(rec))
        if skip == k:
            lines.append(json.dumps({"step": k, "event": "skipped", "reason": "nan"}))
    path.write_text("\n".join(lines) + ("\n{\"step\": 9, \"lo" if torn else "\n"))
    return str(path)


def test_curves_overlay_runs_against_tokens(tmp_path):
    a = _metrics(tmp_path / "dense.jsonl", 4, skip=3, torn=True)
    b = _metrics(tmp_path / "moe.jsonl", 6, moe=True)
    fig = plots.curves_figure(read_runs([a, b]))
    axes = {ax.get_title(loc="left"): ax for ax in fig.axes if ax.get_visible()}
    assert len(axes) == 6 and any(t.startswith("MoE load") for t in axes)
    loss = _by_gid(axes["loss (val dashed)"], "")
    assert list(loss["loss:dense"].get_xdata()) == [128, 256, 384, 512]  # tokens: step x 0.5 s x 256 tokens/s
    assert list(loss["loss:moe"].get_ydata()) == pytest.approx([5.0 / k for k in range(1, 7)])
    assert list(loss["val_loss:moe"].get_ydata()) == pytest.approx([3.0, 1.5, 1.0])
    assert loss["val_loss:moe"].get_linestyle() == "--"
    assert list(loss["skipped:dense"].get_xdata()) == [384, 384]
    step = _by_gid(axes["step time (s): measured, predicted dashed"], "")
    assert set(step["predicted_step_time_s:dense"].get_ydata()) == {0.4}
    peak = _by_gid(axes["device peak (MiB): measured, planned dashed"], "")
    assert set(peak["planned_peak_device_bytes:moe"].get_ydata()) == {10 / 2**20}
    moe_ax = next(ax for t, ax in axes.items() if t.startswith("MoE"))
    assert set(_by_gid(moe_ax, "")) == {"moe_load_max_over_mean:moe"}  # the dense run has no MoE curve
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["dense", "moe"]
    dense_only = plots.curves_figure(read_runs([a]))
    assert not any(ax.get_title(loc="left").startswith("MoE") for ax in dense_only.axes if ax.get_visible())


def test_front_picture_marks_the_pareto_rows():
    ir = transformer_ir(n_layers=2, micro_batch=1, seq_len=128)
    budgets = ["100KiB", "4MiB", "8MiB", "64MiB"]
    result = tune(ir, "cpu", TrainSpec(micro_batch=1, seq_len=128), budgets, [1, 2])
    points = tune_points(result)
    fig = plots.front_figure(points, "tune")
    top, bottom, strip = fig.axes[:3]
    bscale, _ = plots.byte_unit(64 * 2**20)
    front = sorted((r.gpu_budget_bytes / bscale, r.tokens_per_s) for r in result.front)
    assert front and _flat(map(tuple, _by_gid(bottom, "pareto:")["pareto:tokens_per_s"].get_offsets())) == \
        pytest.approx(_flat(front))
    for mb in (1, 2):
        rows = [r for r in result.rows if r.micro_batch == mb and r.feasible]
        line = _by_gid(top, f"step:micro-batch {mb}")[f"step:micro-batch {mb}"]
        assert list(line.get_ydata()) == pytest.approx([r.plan.step_time_s for r in rows])
    bad = [r.gpu_budget_bytes / bscale for r in result.rows if r.micro_batch == 1 and not r.feasible]
    crosses = _by_gid(strip, "infeasible:1")["infeasible:1:None"].get_offsets()
    assert [x for x, _ in crosses] == pytest.approx(bad)
    nothing = plots.front_figure([pt for pt in points if not pt.feasible], "tune").axes[0]
    assert "none-fit" in _by_gid(nothing, "none-fit") and not nothing.lines


def test_save_is_atomic_and_takes_the_format_from_the_suffix(tmp_path, tiny):
    from matplotlib.figure import Figure

    fig = Figure()
    fig.subplots().plot([0, 1], [0, 1])
    png, svg = plots.save_figure(fig, tmp_path / "a.png"), plots.save_figure(fig, tmp_path / "a.svg")
    assert png.read_bytes().startswith(b"\x89PNG") and b"<svg" in svg.read_bytes()
    with pytest.raises(ValueError, match="use .png or .svg"):
        plots.save_figure(fig, tmp_path / "a.pdf")

    def broken(*a, **k):
        raise RuntimeError("disk full")

    fig.savefig = broken
    with pytest.raises(RuntimeError):
        plots.save_figure(fig, png)
    assert png.read_bytes().startswith(b"\x89PNG")  # the old picture, and no temporary file left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "a.svg"]


@pytest.mark.parametrize("argv", [
    ["plan", *TINY, "--plot", "{tmp}/p.png"],
    ["tune", *TINY, "--gpu-mem", "8MiB", "--plot", "{tmp}/t.png"],
    ["report", "{tmp}/missing.jsonl", "--plot", "{tmp}/c.png"],
])
def test_plot_without_matplotlib_is_one_line_before_any_work(argv, tmp_path, monkeypatch, capsys):
    from megatrain.planner import loading

    def no_trace(*a, **k):
        raise AssertionError("traced before checking --plot")

    monkeypatch.setattr(loading, "trace_model", no_trace)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err == "error: --plot needs matplotlib: pip install matplotlib (from the megatrain checkout: pip install -e '.[plot]')\n"


@pytest.mark.parametrize("name, message", [("p.pdf", "use .png or .svg"), ("sub.png", "is a folder")])
def test_bad_plot_paths_are_one_line(name, message, tmp_path, capsys):
    (tmp_path / "sub.png").mkdir()
    assert main(["plan", *TINY, "--plot", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--plot" in err and err.count("\n") == 1 and message in err


def test_plan_and_tune_write_their_pictures(tmp_path, capsys):
    assert main(["plan", *TINY, "--micro-batch", "2", "--gpu-mem", "6MiB", "--plot",
                 str(tmp_path / "p.svg")]) == 0
    assert f"wrote plot to {tmp_path / 'p.svg'}" in capsys.readouterr().out
    svg = (tmp_path / "p.svg").read_text()
    assert "predicted time in one steady-state step" in svg and "peak " in svg and "parameter slots" in svg
    assert main(["tune", *TINY, "--gpu-mem", "100KiB,6MiB", "--micro-batch", "1,2", "--plot",
                 str(tmp_path / "deep" / "t.png")]) == 0
    assert (tmp_path / "deep" / "t.png").read_bytes().startswith(b"\x89PNG")


def test_a_resume_with_no_steps_left_says_the_plot_is_not_written(tmp_path, capsys):
    ckpt = tmp_path / "ck"
    run = ["train", "--model", "tiny", "--device", "sim", "--gpu-mem", "6MiB", "--seq-len", "16", "--micro-batch",
           "1", "--dtype", "fp32", "--steps", "1", "--eval-every", "0", "--hardware", "cpu", "--no-progress"]
    assert main([*run, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]) == 0
    capsys.readouterr()
    assert main([*run, "--resume", str(ckpt), "--plot", str(tmp_path / "r.svg")]) == 0
    out = capsys.readouterr().out
    assert "nothing left to train" in out and "--plot not written" in out and "raise --steps" in out
    assert not (tmp_path / "r.svg").exists()
