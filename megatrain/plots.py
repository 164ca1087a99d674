"""The pictures behind `--plot`: a plan's step, a measured step beside its plan, training curves, a tune grid.

Where it sits: `megatrain plan | train | tune | report ... --plot FILE` call `check_plot_path` before any
long work and `save_figure(<picture>_figure(series), FILE)` at the end. The series are plain values computed
elsewhere (planner/series.py, runtime/timeline.py, runtime/report.py); this module only draws them, with
matplotlib (the optional `plot` extra), imported here lazily and used without pyplot: every picture is its
own `matplotlib.figure.Figure`, so nothing leaks between calls. Try it:
`megatrain plan --model tiny --hardware cpu --gpu-mem 12MiB --seq-len 128 --micro-batch 2 --plot plan.png`.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from megatrain.files import atomic_open, writable_dir

if TYPE_CHECKING:
    from megatrain.planner.series import PlanSeries, TunePoint
    from megatrain.runtime.report import Run
    from megatrain.runtime.timeline import MeasuredSeries

FORMATS = (".png", ".svg")
INSTALL = "--plot needs matplotlib: pip install matplotlib (from the megatrain checkout: pip install -e '.[plot]')"
LAYER_COLORS = {"param_slot": "#4c72b0", "grad_slot": "#dd8452", "device_state": "#64b5cd", "static": "#937860", "checkpoint": "#55a868",
                "grad_carry": "#8172b3", "workspace": "#c44e52", "loss_chunk": "#da8bc3",
                "reserve": "#e0e0e0"}
OP_COLORS = {"forward": "#4c72b0", "backward": "#1f3b66", "load_params": "#dd8452", "load_act": "#f0b27a",
             "store_grads": "#55a868", "offload_act": "#a6d8b0", "optimizer_step": "#8172b3",
             "clip_grads": "#c44e52", "device_step": "#b07aa1", "store_norms": "#8cd17d", "alloc": "#999999",
             "free": "#999999"}
PREVIOUS = "#c8c8c8"
RUN_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
STYLE = {"font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9, "legend.fontsize": 8,
         "xtick.labelsize": 8, "ytick.labelsize": 8, "axes.spines.top": False, "axes.spines.right": False,
         "svg.hashsalt": "megatrain",
         "svg.fonttype": "none"}


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(INSTALL) from None


def check_plot_path(path: str, flag: str = "--plot") -> Path:
    """Refuse a bad picture path in one line before any long work: the suffix (.png, .svg), matplotlib, and
    whether its folder takes a file (created if missing)."""
    out = Path(path)
    if out.suffix.lower() not in FORMATS:
        raise ValueError(f"{flag} {path}: the format comes from the suffix; use .png or .svg")
    require_matplotlib()
    if out.is_dir():
        raise ValueError(f"{flag} {path} is a folder; pass a file path such as {out / 'plot.png'}")
    writable_dir(out.parent, flag, f"{flag} {path}")
    return out


@contextmanager
def _style():
    import matplotlib

    with matplotlib.rc_context(STYLE):
        yield


def save_figure(fig, path: str | Path, flag: str = "--plot") -> Path:
    """Write `fig` atomically (megatrain.files.atomic_open), in the format that the suffix names."""
    out = Path(path)
    fmt = out.suffix.lower().lstrip(".")
    if "." + fmt not in FORMATS:
        raise ValueError(f"{flag} {path}: the format comes from the suffix; use .png or .svg")
    with atomic_open(out, "wb", flag) as f, _style():
        if fmt == "svg":
            fig.savefig(f, format="svg", metadata={"Date": None})
        else:
            _write_png(fig, f)
    return out


def _write_png(fig, f) -> None:
    """A 256-colour PNG: a chart has few colours, and the file is a third of the size (Pillow comes with
    matplotlib)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    image = Image.open(buf).convert("RGB")
    image = image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    image.save(f, "png", optimize=True)


# -- units --------------------------------------------------------------------------------------------------
def byte_unit(largest: float) -> tuple[float, str]:
    for scale, name in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if largest >= scale:
            return scale, name
    return 1, "B"


def time_unit(largest: float) -> tuple[float, str]:
    return (1.0, "s") if largest >= 2 else (1e-3, "ms")


def _fmt_bytes(n: float) -> str:
    scale, name = byte_unit(n)
    return f"{n / scale:.3g} {name}"


# -- the plan and run pictures -------------------------------------------------------------------------------
def _memory(ax, series: PlanSeries, names, end: float, tscale: float, bscale: float) -> None:
    """The layers `names` stacked as filled steps over [0, end), in tscale seconds and bscale bytes."""
    from megatrain.planner.series import LAYERS

    xs, ys = series.memory.steps(names, series.step_time_s)
    xs = [x / tscale for x in [*xs, end]]
    base = [0.0] * len(xs)
    for k in names:
        values = [v / bscale for v in [*ys[k], ys[k][-1]]]
        if not any(values):
            continue
        top = [b + v for b, v in zip(base, values)]
        ax.fill_between(xs, base, top, step="post", color=LAYER_COLORS[k], linewidth=0, label=LAYERS[k],
                        gid=f"layer:{k}", hatch="///" if k == "reserve" else None, edgecolor="#b0b0b0")
        base = top


def _budget(ax, budget: int, top: float, bscale: float) -> None:
    """The budget line, or a note when it is far above what the step uses."""
    if budget / bscale <= 2.5 * top:
        ax.axhline(budget / bscale, color="#d62728", linestyle="--", linewidth=1.2, gid="budget",
                   label=f"budget {_fmt_bytes(budget)}")
        ax.set_ylim(0, max(budget / bscale, top) * 1.12)
    else:
        ax.set_ylim(0, top * 1.25)
        note = f"budget {_fmt_bytes(budget)} (off the scale, {budget / bscale / top:.0f}x the peak)"
        ax.text(0.995, 0.97, note, transform=ax.transAxes, ha="right", va="top", color="#d62728",
                gid="budget-note")


def _phases(ax, series: PlanSeries, tscale: float) -> None:
    if series.turn_s is None:
        return
    x = series.turn_s / tscale
    ax.axvline(x, color="#555555", linestyle=":", linewidth=1)
    for text, ha in ((" backward \u2192", "left"), ("\u2190 forward ", "right")):
        ax.text(x, 1.0, text, transform=ax.get_xaxis_transform(), va="bottom", ha=ha, fontsize=8)


def _lanes(ax, rows: list[tuple[str, str, list]], tscale: float, bottleneck: str | None) -> dict[str, float]:
    """Busy spans, one row per (key, tick label, spans), top to bottom; returns each row's y."""
    ys = {}
    for r, (key, _, spans) in enumerate(rows):
        y = len(rows) - 1 - r
        ys[key] = y
        if r % 2 == 0:
            ax.axhspan(y - 0.5, y + 0.5, color="#f4f4f4", zorder=0, linewidth=0)
        groups: dict[tuple[str, bool], list] = {}
        for s in spans:
            groups.setdefault((s.op, s.previous), []).append((s.start / tscale, (s.end - s.start) / tscale))
        for (op, previous), bars in groups.items():
            color = PREVIOUS if previous else OP_COLORS.get(op, "#777777")
            ax.broken_barh(bars, (y - 0.38, 0.76), facecolors=color, edgecolors=color, linewidth=0.4,
                           gid=f"lane:{key}:{op}" + (":previous" if previous else ""))
    ax.set_yticks([ys[k] for k, _, _ in rows], [t for _, t, _ in rows])
    for label, (key, _, _) in zip(ax.get_yticklabels(), rows):
        if bottleneck and key.split(":")[0] == bottleneck:
            label.set_color("#d62728")
            label.set_fontweight("bold")
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.tick_params(axis="y", length=0)
    return ys


def _op_legend(ax, spans) -> None:
    from matplotlib.patches import Patch

    ops = [op for op in OP_COLORS if any(s.op == op for s in spans) and op not in ("alloc", "free")]
    handles = [Patch(color=OP_COLORS[op], label=op) for op in ops]
    if any(s.op in ("alloc", "free") for s in spans):
        handles.append(Patch(color=OP_COLORS["alloc"], label="alloc, free"))
    if any(s.previous for s in spans):
        handles.append(Patch(color=PREVIOUS, label="previous step"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)


def _group_labels(ax, series: PlanSeries, y: float, tscale: float, xmax: float, fig) -> None:
    """Unit-group names over the compute lane where they fit (never every op of an 80-unit model)."""
    width_px = fig.get_figwidth() * fig.dpi * 0.72
    for lab in series.labels:
        a, b = lab.start / tscale, lab.end / tscale
        if (b - a) / xmax * width_px < len(lab.text) * 5.2 + 6:
            continue
        ax.plot([a, b], [y - 0.3, y - 0.3], color="#444444", linewidth=0.8, solid_capstyle="butt")
        ax.text((a + b) / 2, y - 0.2, lab.text, ha="center", va="bottom", fontsize=7.5,
                gid=f"group:{lab.text}")


def plan_figure(series: PlanSeries):
    """Memory by kind over the predicted steady-state step against the budget, above a lane per stream."""
    from matplotlib.figure import Figure

    from megatrain.planner.series import LANES, LAYERS

    with _style():
        fig = Figure(figsize=(12, 7), layout="constrained")
        mem, lanes = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
        tscale, tname = time_unit(series.step_time_s)
        bscale, bname = byte_unit(max(series.peak_gpu_bytes, 1))
        xmax = series.step_time_s / tscale
        _memory(mem, series, tuple(LAYERS), series.step_time_s, tscale, bscale)
        top = series.peak_gpu_bytes / bscale
        _budget(mem, series.budget_bytes, top, bscale)
        j = series.peak
        px = (series.memory.start[j] + series.memory.end[j]) / 2 / tscale
        mem.plot([px], [top], marker="v", color="black", markersize=6, gid="peak")
        right = px > 0.6 * xmax
        mem.annotate(f"peak {_fmt_bytes(series.peak_gpu_bytes)}: {series.peak_text}", (px, top),
                     xytext=(-10 if right else 10, 10), textcoords="offset points",
                     ha="right" if right else "left", fontsize=8.5, fontweight="bold",
                     arrowprops={"arrowstyle": "-", "color": "black", "lw": 0.6},
                     bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85})
        _phases(mem, series, tscale)
        mem.set_ylabel(f"device memory ({bname})")
        mem.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False, title="memory by kind",
                   reverse=True)
        bottleneck = "host" if series.bottleneck == "host_optimizer" else series.bottleneck
        rows = [("units", "", [])] + [
            (lane, f"{name}\nbusy {series.busy.get(lane, 0):.0%}" + ("\n(bottleneck)" * (lane == bottleneck)),
             [s for s in series.spans if s.lane == lane]) for lane, name in LANES.items()]
        ys = _lanes(lanes, rows, tscale, bottleneck)
        _group_labels(lanes, series, ys["units"], tscale, xmax, fig)
        _op_legend(lanes, series.spans)
        lanes.set_xlim(0, xmax)
        grey = ("; grey: the previous step's work still running" if any(sp.previous for sp in series.spans)
                else "")
        lanes.set_xlabel(f"predicted time in one steady-state step ({tname}){grey}")
        fig.suptitle(f"{series.title}\npredicted step {series.step_time_s / tscale:.3g} {tname}; peak "
                     f"{_fmt_bytes(series.peak_gpu_bytes)} of {_fmt_bytes(series.budget_bytes)} budget; "
                     f"bottleneck {series.bottleneck.replace('_', ' ')} ({series.bottleneck_share:.0%} of "
                     "the critical path)", fontsize=10)
    return fig


APART = 2.0  # prediction and measurement further apart than this: each on its own step's scale


def run_figure(predicted: PlanSeries, measured: MeasuredSeries):
    """The measured step over the plan's prediction: device buffers (planned by kind, measured as a line)
    above a pair of lanes per stream (plan, measured) on one time axis, or, when the two step times are more
    than APART times apart, each as a fraction of its own step (the title keeps the seconds)."""
    from matplotlib.figure import Figure

    from megatrain.planner.series import BUFFER_LAYERS, LANES

    with _style():
        fig = Figure(figsize=(12, 7.5), layout="constrained")
        mem, lanes = fig.subplots(2, 1, sharex=True, height_ratios=[2.2, 3])
        plan_s, real_s = predicted.step_time_s, measured.end_s
        tscale, tname = time_unit(max(plan_s, real_s))
        apart = max(plan_s, real_s) > APART * min(plan_s, real_s)
        pscale, mscale = (plan_s, real_s) if apart else (tscale, tscale)
        planned_peak = max(predicted.memory.top(j, BUFFER_LAYERS) for j in range(len(predicted.memory.index)))
        bscale, bname = byte_unit(max(planned_peak, measured.peak_bytes, 1))
        _memory(mem, predicted, BUFFER_LAYERS, plan_s, pscale, bscale)
        xs = [x / mscale for x, _ in measured.memory] + [real_s / mscale]
        vals = [m / bscale for _, m in measured.memory]
        mem.step(xs, [*vals, vals[-1]], where="post", color="black", linewidth=1.3, gid="measured-memory",
                 label="measured (device pool)")
        _budget(mem, predicted.budget_bytes, max(planned_peak, measured.peak_bytes) / bscale, bscale)
        mem.set_ylabel(f"device buffers ({bname})")
        mem.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False, reverse=True,
                   title="planned by kind")

        def scaled(spans, lane, by):
            return [sp.replace(start=sp.start / by, end=sp.end / by) for sp in spans if sp.lane == lane]

        rows = []
        for lane, name in LANES.items():
            rows.append((f"{lane}:plan", f"{name} \u00b7 plan", scaled(predicted.spans, lane, pscale)))
            rows.append((f"{lane}:measured", f"{name} \u00b7 measured", scaled(measured.spans, lane, mscale)))
        _lanes(lanes, rows, 1.0, None)
        _op_legend(lanes, [*predicted.spans, *measured.spans])
        lanes.set_xlim(0, 1 if apart else max(plan_s, real_s) / tscale)
        ratio = max(plan_s, real_s) / min(plan_s, real_s)
        axis = (f"fraction of each step (plan and measured are {ratio:.0f}x apart: see the title)" if apart
                else f"time in the step ({tname}): the plan's steady state")
        lanes.set_xlabel(f"{axis}, and measured step {measured.step}")
        fig.suptitle(f"{predicted.title}\nstep: predicted {plan_s / tscale:.3g} {tname}, measured "
                     f"{real_s / tscale:.3g} {tname} (first op to last); device buffers peak: planned "
                     f"{_fmt_bytes(planned_peak)}, measured {_fmt_bytes(measured.peak_bytes)}", fontsize=10)
    return fig


# -- curves and the tune front -------------------------------------------------------------------------------
CURVES = (("loss", "loss (val dashed)"), ("tokens_per_s", "tokens/s"),
          ("step_time_s", "step time (s): measured, predicted dashed"),
          ("peak_device_bytes", "device peak (MiB): measured, planned dashed"),
          ("grad_norm", "gradient norm"), ("moe_load_max_over_mean", "MoE load: max/mean over experts"))
PAIRED = {"loss": "val_loss", "step_time_s": "predicted_step_time_s",
          "peak_device_bytes": "planned_peak_device_bytes"}
SCALE = {"peak_device_bytes": 2**-20, "planned_peak_device_bytes": 2**-20}


def curves_figure(runs: list[Run]):
    """Loss (and validation loss), tokens/s, measured against predicted step time, grad norm and MoE load
    balance against tokens, one color per run."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter, FuncFormatter

    panels = [(k, t) for k, t in CURVES if k in ("loss", "tokens_per_s", "step_time_s")
              or any(r.series(k)[0] for r in runs)]  # the rest only where a run logged them
    cols = 2 if len(panels) > 1 else 1
    nrows = (len(panels) + cols - 1) // cols
    with _style():
        fig = Figure(figsize=(11, 2.9 * nrows + 0.5), layout="constrained")
        axes = fig.subplots(nrows, cols, squeeze=False).ravel()
        for ax in axes[len(panels):]:
            ax.set_visible(False)
        for ax, (key, title) in zip(axes, panels):
            ax.set_title(title, loc="left")
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))
            ax.set_xlabel("tokens")
            ax.grid(True, color="#eeeeee")
            drawn: list[float] = []
            for i, run in enumerate(runs):
                color = RUN_COLORS[i % len(RUN_COLORS)]
                for name, style in ((key, "-"), (PAIRED.get(key), "--")):
                    xs, ys = run.series(name) if name else ([], [])
                    ys = [y * SCALE.get(name, 1) for y in ys]
                    drawn += ys
                    if xs:
                        ax.plot(xs, ys, color=color, linestyle=style, linewidth=1.2,
                                label=run.label if style == "-" else None, gid=f"{name}:{run.label}",
                                markersize=3, marker="o" if len(xs) < 3 or name == "val_loss" else None)
                if key == "loss":
                    for x in run.skipped_tokens():
                        ax.axvline(x, color=color, linestyle=":", linewidth=0.8, gid=f"skipped:{run.label}")
            low, high = min(drawn, default=1), max(drawn, default=1)
            if key == "step_time_s" and 0 < low and high > 20 * low:
                ax.set_yscale("log")  # prediction and measurement far apart: both stay readable
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                ax.yaxis.set_minor_formatter(FuncFormatter(  # 0.02, 0.05, 0.2, ...: legible, not crowded
                    lambda v, _: f"{v:g}" if v > 0 and f"{v:.0e}"[0] in "25" else ""))
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside upper center", ncol=min(len(runs), 6), frameon=False)
    return fig


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def front_figure(points: list[TunePoint], title: str):
    """Step time and tokens/s against GPU budget, a series per micro-batch (and DepthSSD rank, micro-batches per
    step and state-place request, where the grid has several), the Pareto front over (budget, tokens/s) marked;
    infeasible cells as crosses in a strip below, a row per series."""
    from matplotlib.figure import Figure

    largest = max(p.budget_bytes for p in points)
    bscale, bname = byte_unit(largest)
    ranks = sorted({p.depth_rank for p in points}, key=lambda r: -1 if r is None else r)
    mbs = sorted({p.micro_batch for p in points})
    accums = sorted({p.grad_accum for p in points})
    places = sorted({p.resident for p in points})
    # a series: its rank, micro-batch, micro-batches per step and state place; colour by (micro-batch, accum),
    # marker by rank, line style by place
    series = [(r, mb, k, res) for r in ranks for mb in mbs for k in accums for res in places]
    colours = [(mb, k) for mb in mbs for k in accums]

    def of(p) -> tuple:
        return (p.depth_rank, p.micro_batch, p.grad_accum, p.resident)

    def label(key: tuple, short: bool = False) -> str:
        rank, mb, k, res = key
        parts = [f"mb {mb}" if short else f"micro-batch {mb}"]
        if len(accums) > 1:
            parts.append(f"accum {k}")
        if len(places) > 1:
            parts.append(f"resident {res}")
        if rank is not None:
            parts.append(f"N={rank}")
        return ", ".join(parts)

    def infeasible_gid(key: tuple) -> str:
        rank, mb, k, res = key
        extra = (f":{k}" if len(accums) > 1 else "") + (f":{res}" if len(places) > 1 else "")
        return f"infeasible:{mb}:{rank}{extra}"

    with _style():
        fig = Figure(figsize=(10, 7.5), layout="constrained")
        cells = [key for key in series if any(not p.feasible and of(p) == key for p in points)]
        axes = fig.subplots(3 if cells else 2, 1, sharex=True,
                            height_ratios=[3, 3, 0.35 + 0.25 * len(cells)] if cells else [1, 1])
        top, bottom = axes[0], axes[1]
        ring = "Pareto front" + (" (per N)" if ranks != [None] else "")
        for key in series:
            rank, mb, k, res = key
            cell = sorted((p for p in points if p.feasible and of(p) == key), key=lambda p: p.budget_bytes)
            if not cell:
                continue
            name = label(key)
            ri = ranks.index(rank)
            style = {"color": RUN_COLORS[colours.index((mb, k)) % len(RUN_COLORS)],
                     "marker": MARKERS[ri % len(MARKERS)],
                     "linestyle": ("-", "--", ":", "-.")[(ri + places.index(res)) % 4], "linewidth": 1.2,
                     "markersize": 5}
            xs = [p.budget_bytes / bscale for p in cell]
            top.plot(xs, [p.step_time_s for p in cell], label=name, gid=f"step:{name}", **style)
            bottom.plot(xs, [p.tokens_per_s for p in cell], gid=f"tokens:{name}", **style)
        for rank in ranks:
            front = sorted((p for p in points if p.depth_rank == rank and p.pareto),
                           key=lambda p: p.budget_bytes)
            if front:
                tag = "" if rank is None else f", N={rank}"
                fx = [p.budget_bytes / bscale for p in front]
                for ax, key in ((top, "step_time_s"), (bottom, "tokens_per_s")):
                    ax.scatter(fx, [getattr(p, key) for p in front], s=140, facecolors="none",
                               edgecolors="black", linewidths=1.3, zorder=5, gid=f"pareto:{key}{tag}",
                               label=ring if ax is top else None)
                ring = None  # one legend entry for the rings
                bottom.step(fx, [p.tokens_per_s for p in front], where="post", color="black", alpha=0.35,
                            linewidth=3, zorder=1, gid=f"front{tag}")
                at: dict[tuple, list] = {}  # rows that tie (auto streaming every unit, as none does) share a label
                for p in front:
                    at.setdefault((p.budget_bytes, p.tokens_per_s), []).append(p)
                for (b, tps), ps in at.items():
                    more = f" (+{len(ps) - 1} tied)" if len(ps) > 1 else ""
                    bottom.annotate(f"{label(of(ps[0]), short=True)}{more}: {ps[0].bottleneck}", (b / bscale, tps),
                                    xytext=(6, -12), textcoords="offset points", fontsize=7)
        if cells:  # a row of crosses per series that has infeasible budgets
            strip = axes[2]
            for y, key in enumerate(reversed(cells)):
                bad = [p for p in points if not p.feasible and of(p) == key]
                strip.scatter([p.budget_bytes / bscale for p in bad], [y] * len(bad), marker="x",
                              color=RUN_COLORS[colours.index(key[1:3]) % len(RUN_COLORS)], gid=infeasible_gid(key))
            strip.set_yticks(range(len(cells)), [label(key, short=True) for key in reversed(cells)])
            strip.set_ylim(-0.6, len(cells) - 0.4)
            strip.set_title("infeasible: too little budget for these cells", loc="left", fontsize=8)
            strip.tick_params(axis="y", length=0)
        budgets = sorted({p.budget_bytes / bscale for p in points})
        if budgets[-1] / max(budgets[0], 1e-12) > 10:
            bottom.set_xscale("log")
        pad = (budgets[-1] - budgets[0]) * 0.04 or budgets[0] * 0.1
        bottom.set_xlim(budgets[0] - pad if bottom.get_xscale() == "linear" else budgets[0] / 1.15,
                        budgets[-1] + pad if bottom.get_xscale() == "linear" else budgets[-1] * 1.15)
        if len(budgets) <= 12:
            bottom.set_xticks(budgets, [f"{b:g}" for b in budgets])
            bottom.minorticks_off()
        top.set_ylabel("predicted step time (s)")
        bottom.set_ylabel("predicted tokens/s")
        axes[-1].set_xlabel(f"GPU budget ({bname})")
        for ax in (top, bottom):
            ax.grid(True, color="#eeeeee")
            ax.margins(y=0.12)
        if top.get_legend_handles_labels()[0]:
            top.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)
        else:
            top.text(0.5, 0.5, "no budget in the grid fits", transform=top.transAxes, ha="center", gid="none-fit")
        fig.suptitle(title + "\nPareto front over (budget, tokens/s): no other cell reaches the tokens/s "
                     "with no more budget", fontsize=10)
    return fig
