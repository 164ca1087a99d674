"""The plain series behind the plan and tune pictures: memory by kind over predicted time, lanes, the grid.

Where it sits: megatrain/plots.py draws them (`megatrain plan --plot`, `megatrain tune --plot`); the run
picture (`megatrain train --plot`) puts runtime/timeline.py's measured series beside them. No matplotlib
here, so tests assert on the numbers. Try it:
`python -c "from megatrain.planner.series import plan_series; help(plan_series)"`.

Memory by kind comes from the planner's own rule: timeline.walk, run once per kind with every other kind's
buffers sized 0. The walk is a sum over live buffers, so the kinds add up to `plan.memory_timeline` at every
compute-stream instruction. The running forward/backward's workspace is split into the head's (the loss,
computed over one chunk of logits at a time) and the other units'. On top sits what the GPU needs beyond the
Program: hardware.gpu_bytes(total) - total (reserved bytes + allocator margin), so the stack's top at the
peak is `plan.peak_gpu_bytes`.

Time: the estimator unrolls three steps (estimate.py); the pictures show one period of the steady state,
from the last step's first instruction (x = 0) for one step time: this step's work, and the previous step's
that still runs into it (in steady state the same work a period earlier, so the window shows everything
that runs in a period).
"""

from __future__ import annotations

import math

from pydantic import Field

from megatrain.ir.base import IRModel

from .chrome_trace import plan_estimate, predicted_spans
from .display import unit_groups
from .plan import Plan
from .timeline import program_timeline, walk
from .tune import TuneResult

LAYERS = {  # drawing order, bottom to top: label
    "param_slot": "parameter slots", "grad_slot": "gradient slots",
    "device_state": "optimizer state on the device (issue 40)", "static": "batch, RoPE, losses",
    "checkpoint": "checkpoints on device", "grad_carry": "activation gradients",
    "workspace": "unit workspace", "loss_chunk": "loss chunk (head workspace)",
    "reserve": "reserve + allocator margin",
}
BUFFER_LAYER = {"param_slot": "param_slot", "grad_slot": "grad_slot", "resident": "static", "batch": "static",
                "loss": "static", "carry": "checkpoint", "saved": "checkpoint", "grad_carry": "grad_carry",
                "attention": "checkpoint", "cast_stage": "param_slot",  # cast: the weights' own way in
                "device_state": "device_state"}
BUFFER_LAYERS = ("param_slot", "grad_slot", "device_state", "static", "checkpoint", "grad_carry")
LANES = {"compute": "compute", "h2d": "h2d", "d2h": "d2h", "host": "host optimizer"}
MAX_LABELS = 12  # more table groups than this: label the compute lane by unit kind instead


class Span(IRModel):
    """One busy interval of a stream, in seconds from the shown step's start."""

    lane: str = Field(description="the stream: compute, h2d, d2h or host")
    op: str
    unit: str | None = None
    start: float
    end: float
    previous: bool = Field(False, description="the previous step's, still running into this one")


class Label(IRModel):
    """A group of units (as the plan's table groups them) in one phase, over the compute lane."""

    text: str
    start: float
    end: float


class MemorySeries(IRModel):
    """Per compute-stream instruction of the step: where it runs and its device bytes by layer (LAYERS)."""

    index: tuple[int, ...] = Field(description="program index")
    start: tuple[float, ...]
    end: tuple[float, ...]
    layers: dict[str, tuple[int, ...]]
    reserved_bytes: int = 0
    allocator_margin: float = 0.0

    def top(self, j: int, names=tuple(LAYERS)) -> int:
        return sum(self.layers[k][j] for k in names)

    def steps(self, names=tuple(LAYERS), period: float | None = None
              ) -> tuple[list[float], dict[str, list[int]]]:
        """The drawn step function (each value holds until the next x): an instruction's bytes from its
        start; its workspace (and the margin on it) ends with it, the buffers stay to the next one. Of
        instructions at one instant (records, frees) the last one's bytes are drawn. With `period`: the
        window [0, period) of the steady state, where the previous step (the same program a period earlier)
        holds what it left, or still runs, until this step's instructions start."""
        transient = {"workspace", "loss_chunk"} & set(names)
        n = len(self.start)
        raw: list[tuple[float, dict[str, int]]] = []
        for shift in (-period, 0.0) if period is not None else (0.0,):
            for j, (a, b) in enumerate(zip(self.start, self.end)):
                raw.append((a + shift, {k: self.layers[k][j] for k in names}))
                nxt = self.start[j + 1] if j + 1 < n else b
                if nxt > b and any(self.layers[k][j] for k in transient):
                    after = {k: 0 if k in transient else self.layers[k][j] for k in names}
                    if "reserve" in names:  # the margin is on what is left
                        left = self.top(j, BUFFER_LAYERS)
                        margin = math.ceil(left * (1 + self.allocator_margin)) - left
                        after["reserve"] = self.reserved_bytes + margin
                    raw.append((b + shift, after))
        if period is not None:
            before = [i for i, (x, _) in enumerate(raw) if x <= 0]
            first = before[-1] if before else 0
            raw = [(max(0.0, x), v) for x, v in raw[first:] if x < period]
        eps = 1e-9 * max(self.end, default=0.0)
        xs: list[float] = []
        ys: dict[str, list[int]] = {k: [] for k in names}
        for x, values in raw:
            if xs and x - xs[-1] <= eps:  # the same instant: the later instruction's bytes
                xs.pop()
                for k in names:
                    ys[k].pop()
            xs.append(x)
            for k in names:
                ys[k].append(values[k])
        return xs, ys


class PlanSeries(IRModel):
    """Everything the plan picture draws, in bytes and seconds."""

    title: str
    memory: MemorySeries
    spans: tuple[Span, ...]
    labels: tuple[Label, ...]
    budget_bytes: int
    peak_gpu_bytes: int
    peak: int = Field(description="position in `memory` of the first instruction at the peak")
    peak_text: str
    bottleneck: str
    bottleneck_share: float
    busy: dict[str, float] = Field(description="fraction of the step each lane works")
    step_time_s: float = Field(description="the steady-state period: the window drawn is [0, step_time_s)")
    turn_s: float | None = Field(None, description="when the first backward starts")


def memory_layers(plan: Plan) -> dict[str, list[int]]:
    """Device bytes by layer per compute-stream instruction (the same walk as the planner's timeline)."""
    prog = plan.program
    static = [b.name for b in prog.buffers if b.static]
    out: dict[str, list[int]] = {}
    for layer in BUFFER_LAYERS:
        sizes = {b.name: b.nbytes if BUFFER_LAYER[b.kind] == layer else 0 for b in prog.buffers}
        out[layer] = list(walk(prog.instrs, sizes, static).buffers)
    tl = program_timeline(prog)
    kinds = {u.name: u.kind for u in plan.ir.units}
    heads = [kinds.get(prog.instrs[i].unit) == "head" for i in tl.index]
    out["workspace"] = [0 if h else w for h, w in zip(heads, tl.workspace)]
    out["loss_chunk"] = [w if h else 0 for h, w in zip(heads, tl.workspace)]
    out["reserve"] = [plan.hardware.gpu_bytes(t) - t for t in tl.total]
    return out


def _short(ins, n_mb: int) -> str:
    args = [str(ins.unit or ins.buffer)] + ([f"mb {ins.mb}"] if ins.mb is not None and n_mb > 1 else [])
    return f"{ins.op}({', '.join(args)})"


def plan_series(plan: Plan) -> PlanSeries:
    """One period of the steady state, [0, step time) from the last unrolled step's first instruction:
    memory by layer, busy spans per stream (the previous step's that still run, cut at 0; this step's, cut
    at the period: their tails are the next period's previous-step spans), unit-group labels."""
    est = plan_estimate(plan)
    prog = plan.program
    last = len(est.start_s) - 1
    starts = est.start_s[last]
    t0, period = min(starts), plan.step_time_s
    tl = program_timeline(prog)
    memory = MemorySeries(index=tl.index, start=tuple(starts[i] - t0 for i in tl.index),
                          end=tuple(starts[i] + est.duration_s[i] - t0 for i in tl.index),
                          layers={k: tuple(v) for k, v in memory_layers(plan).items()},
                          reserved_bytes=plan.hardware.reserved_bytes,
                          allocator_margin=plan.hardware.allocator_margin)
    spans = []
    for step, _, ins, start, dur in predicted_spans(plan, est):
        a, b = start - t0, start + dur - t0
        if (step == last and a < period) or (step == last - 1 and b > 0):
            spans.append(Span(lane=ins.stream, op=ins.op, unit=ins.unit, start=max(a, 0.0),
                              end=min(b, period), previous=step != last))
    busy = {"compute": "compute", "h2d": "h2d", "d2h": "d2h", "host": "host_optimizer"}
    backward = [s.start for s in spans if s.op == "backward" and not s.previous]
    peak_ins = prog.instrs[tl.index[tl.peak_at]]
    return PlanSeries(
        title=f"{plan.ir.model} on {plan.hardware.name}: micro-batch {plan.train.micro_batch} x seq "
              f"{plan.train.seq_len}, {plan.train.grad_accum} micro-batch(es)/step, {plan.train.dtype}",
        memory=memory, spans=tuple(spans), labels=tuple(compute_labels(plan, spans)),
        budget_bytes=plan.gpu_budget_bytes, peak_gpu_bytes=plan.peak_gpu_bytes, peak=tl.peak_at,
        peak_text=_short(peak_ins, prog.n_micro_batches), bottleneck=plan.bottleneck,
        bottleneck_share=plan.bottleneck_share,
        busy={lane: plan.busy_s[key] / period if period else 0.0 for lane, key in busy.items()},
        step_time_s=period, turn_s=min(backward) if backward else None)


def compute_labels(plan: Plan, spans: list[Span]) -> list[Label]:
    """Per unit group and phase (forward, backward), the time from its first to its last compute span.
    Groups are the table's (display.unit_groups), or runs of one unit kind when there are too many."""
    groups = unit_groups(plan)
    if len(groups) > MAX_LABELS:
        runs: list[tuple[str, list]] = []
        for u in plan.units:
            if runs and runs[-1][1][-1].kind == u.kind:
                runs[-1][1].append(u)
            else:
                runs.append(("", [u]))
        groups = [(g[0].name if len(g) == 1 else f"{g[0].name}-{g[-1].name.rpartition('.')[2]} ({len(g)})", g)
                  for _, g in runs]
    group_of = {u.name: name for name, units in groups for u in units}
    out: list[Label] = []
    for phase, tag in (("forward", "fwd"), ("backward", "bwd")):
        run: list = []  # [group, start, end] of the current run of one group
        for s in spans:
            if s.op != phase or s.previous:
                continue
            name = group_of.get(s.unit, s.unit)
            if run and run[0] == name:
                run[2] = s.end
                continue
            if run:
                out.append(Label(text=f"{tag} {run[0]}", start=run[1], end=run[2]))
            run = [name, s.start, s.end]
        if run:
            out.append(Label(text=f"{tag} {run[0]}", start=run[1], end=run[2]))
    return out


class TunePoint(IRModel):
    """One tune row as the front picture draws it."""

    micro_batch: int
    depth_rank: int | None
    budget_bytes: int
    grad_accum: int = 1
    resident: str = "none"
    feasible: bool
    pareto: bool
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    bottleneck: str | None = None
    needed_bytes: int | None = None


def tune_points(result: TuneResult) -> list[TunePoint]:
    return [TunePoint(micro_batch=r.micro_batch, depth_rank=r.depth_rank, budget_bytes=r.gpu_budget_bytes,
                      grad_accum=r.grad_accum, resident=r.resident,
                      feasible=r.feasible, pareto=r.pareto, needed_bytes=r.needed_bytes,
                      step_time_s=r.plan.step_time_s if r.plan else None,
                      tokens_per_s=r.plan.tokens_per_s if r.plan else None,
                      bottleneck=r.plan.bottleneck if r.plan else None) for r in result.rows]
