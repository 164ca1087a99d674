"""Printing a Plan: the summary, a per-unit table, the memory timeline as a sparkline, and `--explain`.

Where it sits: above plan.py (a Plan does not print itself: `format_plan(plan)` does, as `megatrain plan` calls
it); tests/planner/golden/ holds the printed plan of the tiny preset so a schedule change shows up in review.
Try it: `megatrain plan --model tiny --hardware cpu --seq-len 128 --micro-batch 2 --explain`.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table

from . import creation
from .bytesize import format_bytes

if TYPE_CHECKING:
    from .plan import Plan

BARS = " ▁▂▃▄▅▆▇█"


def _count(n: int) -> str:
    """12.3B, 455M, 103k: a parameter count at a readable scale."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def render(*items, width: int) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False, highlight=False)
    for item in items:
        console.print(item)
    return buf.getvalue()


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 1000 else f"{ms:.0f}"


def summary_lines(p: Plan) -> list[str]:
    t, hw = p.train, p.hardware
    counts = {k: sum(1 for u in p.units if u.placement == k and u.checkpoint_bytes)
              for k in ("device", "host", "keep", "rebuild")}
    params = p.ir.params_total
    ckpt = p.host_breakdown.get("checkpoints", 0)
    staging = p.host_breakdown.get("checkpoint_staging", 0)
    lines = [
        f"plan {p.ir.model} on {hw.name}: micro-batch {t.micro_batch} x seq {t.seq_len}, {t.grad_accum} "
        f"micro-batch(es)/step, {t.dtype}, {_count(params)} params",
        f"GPU   peak {format_bytes(p.peak_gpu_bytes)} of {format_bytes(p.gpu_budget_bytes)} budget "
        f"(buffers {format_bytes(p.peak_buffer_bytes)}, + workspace {format_bytes(p.peak_device_bytes - p.peak_buffer_bytes)}"
        f" at the peak, + {format_bytes(hw.reserved_bytes)} reserved, + {hw.allocator_margin:.0%} margin)",
        f"host  {format_bytes(p.host_bytes)} of {format_bytes(hw.host_memory_bytes)} "
        f"({p.state_bytes_per_param:.3g} B/param + {format_bytes(ckpt)} checkpoints"
        + (f" + {format_bytes(staging)} pinned checkpoint staging)" if staging else ")"),
        f"      host policy {p.host_policy_reason or p.host_policy}",
        f"      {creation.describe(hw, p.host_bytes, params)}",
        f"cast  {p.cast}: {p.cast_reason}" if p.cast_reason else f"cast  {p.cast}",
        f"step  {p.step_time_s:.4g} s, {p.tokens_per_s:,.0f} tokens/s, {p.model_tflops:.4g} model TFLOP/s, "
        f"MFU {p.mfu:.1%}; bottleneck {p.bottleneck} ({p.bottleneck_share:.0%} of the critical path)",
        *_world_lines(p),
        f"slots {p.n_slots} x {format_bytes(p.slot_bytes)} (prefetch distance {p.prefetch_distance}), "
        f"{p.n_grad_slots} gradient slot(s) x {format_bytes(p.grad_slot_bytes)}; checkpoints {counts['device']} "
        f"device, {counts['host']} host, {counts['keep']} keep"
        + (f", {counts['rebuild']} rebuild" if counts["rebuild"] else "")
        + (f"; {replays} replay attention" if (replays := sum(u.replay for u in p.units)) else ""),
    ]
    return lines + state_lines(p) + tiling_lines(p)


def state_lines(p: Plan) -> list[str]:
    """Which units' state lives on the device (the residency pass), and its device bytes; none when every unit
    streams."""
    if not p.resident_units:
        return []
    names = set(p.resident_units)
    held = sum(b.nbytes for b in p.program.buffers if b.static and b.unit in names)
    groups = []
    for name, group in unit_groups(p):
        places = {u.state for u in group}
        if places != {"host"}:
            groups.append(f"{name} {'/'.join(sorted(places))}")
    n_dev = sum(1 for u in p.units if u.state == "device")
    return [f"state {len(names)} unit(s) on the GPU ({n_dev} with their optimizer step there), "
            f"{format_bytes(held)} of dedicated slots and state: " + ", ".join(groups) +
            "; the rest streamed (--explain says why)"]


def tiling_lines(p: Plan) -> list[str]:
    """How the units run long sequences, for a plan that tiles them or whose trace was scaled; else none."""
    ir, out = p.ir, []
    if ir.chunk_tokens is not None:
        out.append(f"tiles {ir.chunk_tokens:,} tokens per chunk ({-(-ir.seq_len // ir.chunk_tokens)} per sequence; "
                   "the chunks pass chose it): norms, projections, RoPE and MLP tiled, attention fused")
    elif ir.chunk_choices:
        out.append("tiles none: the whole sequence fits untiled (the chunks pass priced "
                   f"{len(ir.chunk_choices) - 1} chunk sizes)")
    if ir.traced_seq_len is not None:
        out.append(f"trace at {ir.traced_seq_len:,} tokens, scaled to {ir.seq_len:,}: bytes and FLOPs exact, "
                   "op counts (dispatch overhead) extrapolated")
    return out


def _world_lines(p: Plan) -> list[str]:
    """A data-parallel plan's world: per-rank and per-node host bytes, the collectives' time."""
    if p.world.nproc == 1:
        return []
    shares = p.host_bytes_per_rank
    on_path = p.critical_path_s.get("collectives", 0.0)
    return [f"world {p.world}: this is one rank's step ({p.program.n_micro_batches} of the {p.train.grad_accum} "
            f"micro-batch(es)); host per rank {format_bytes(min(shares))}..{format_bytes(max(shares))} (1/"
            f"{p.world.nproc} of the state + staging), per node {format_bytes(p.host_bytes_per_node)}",
            f"      collectives {p.collectives_s * 1e3:.4g} ms per step on the comm stream, "
            f"{on_path / p.step_time_s:.0%} of the critical path; tokens/s counts every rank's"]


def unit_groups(p: Plan) -> list[tuple[str, list]]:
    """Consecutive units that print identically, merged: (row name such as `blocks.0-78 (79)`, units).
    The table prints one row per group; the pictures (megatrain/plots.py) label by the same groups."""
    rows: list[list] = []
    for u in p.units:
        key = _row_key(u)
        if rows and rows[-1][0] == key:
            rows[-1][1].append(u)
        else:
            rows.append([key, [u]])
    return [(g[0].name if len(g) == 1 else _span(g[0].name, g[-1].name, len(g)), g) for _, g in rows]


def _row_key(u) -> tuple:
    ckpt = "-" if not u.checkpoint_bytes else u.placement + ("+replay" if u.replay else "") + (
        "" if not u.resident else ", resident")
    if not u.checkpoint_bytes and u.resident:
        ckpt = "resident"
    return (u.kind, f"{u.params / 1e6:.4g}M", ckpt, u.state,
            format_bytes(u.checkpoint_bytes) if u.checkpoint_bytes else "-", _ms(u.forward_s), _ms(u.backward_s), _ms(u.h2d_s), _ms(u.d2h_s), _ms(u.optimizer_s))


def unit_table(p: Plan) -> Table:
    """One row per unit, consecutive identical units merged into one row; the state column only when some
    unit's state is not streamed from the host."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    placed = bool(p.resident_units)
    for col, justify in (("unit", "left"), ("params", "right"), *((("state", "left"),) if placed else ()),
                         ("checkpoint", "left"), ("bytes", "right"), ("slot", "right"), ("fwd ms", "right"),
                         ("bwd ms", "right"), ("h2d ms", "right"), ("d2h ms", "right"), ("opt ms", "right")):
        table.add_column(col, justify=justify)
    for name, group in unit_groups(p):
        key = _row_key(group[0])
        slots = sorted({u.slot for u in group})
        slot = str(slots[0]) if len(slots) == 1 else f"{slots[0]}-{slots[-1]}"
        table.add_row(name, key[1], *((key[3],) if placed else ()), key[2], key[4], slot, *key[5:])
    return table


def _span(first: str, last: str, count: int) -> str:
    """`blocks.0-63 (64)` for a run of units sharing a prefix, else `a .. b (n)`."""
    head_a, _, tail_a = first.rpartition(".")
    head_b, _, tail_b = last.rpartition(".")
    if head_a and head_a == head_b:
        return f"{head_a}.{tail_a}-{tail_b} ({count})"
    return f"{first} .. {last} ({count})"


def sparkline(p: Plan, width: int = 64) -> list[str]:
    """The device memory timeline (as the GPU needs it) against the budget, max per column."""
    values = [p.hardware.gpu_bytes(v) for v in p.memory_timeline]
    if not values:
        return []
    cols = min(width, len(values))
    line = ""
    for c in range(cols):
        lo, hi = c * len(values) // cols, max((c + 1) * len(values) // cols, c * len(values) // cols + 1)
        v = max(values[lo:hi])
        line += BARS[min(len(BARS) - 1, max(1, round(v / p.gpu_budget_bytes * (len(BARS) - 1))))]
    compute = [ins for ins in p.program.instrs if ins.stream == "compute"]
    turn = next((k for k, ins in enumerate(compute) if ins.op == "backward"), len(compute))
    col = min(cols - 1, turn * cols // len(values))
    marks = "forward".ljust(col) + "^ backward"
    return [f"memory |{line}| peak {format_bytes(p.peak_gpu_bytes)} of {format_bytes(p.gpu_budget_bytes)}",
            f"        {marks}  (compute-stream order; full height = budget)"]


def explain_lines(p: Plan, timings: bool = True) -> list[str]:
    out = []
    for rec in p.passes:
        out.append(f"[{rec.name}]" + (f" {rec.seconds * 1e3:.1f} ms" if timings else ""))
        out.extend(f"  {line}" for line in rec.decisions)
    return out


def format_plan(p: Plan, *, explain: bool = False, program: bool = False, timings: bool = True,
                width: int = 110, advice=None) -> str:
    """The printed plan: summary, per-unit table, sparkline; optionally the passes and the program. `advice`
    (planner/advice.py, when the host optimizer binds): what a larger --grad-accum or the other state-place
    choice would give, after the summary."""
    head = summary_lines(p) + (advice.lines() if advice is not None else [])
    parts = ["\n".join(head), "", render(unit_table(p), width=width).rstrip(), "",
             "\n".join(sparkline(p))]
    if explain:
        parts += ["", "passes:", "\n".join(explain_lines(p, timings))]
    if program:
        parts += ["", f"program ({len(p.program.instrs)} instructions):", str(p.program)]
    return "\n".join(parts) + "\n"


def format_units(prof) -> str:
    """A measured UnitProfile (planner/profile.py) as a table: milliseconds per op and template."""
    table = Table(box=box.SIMPLE_HEAD, title=f"unit profile {prof.key}: {prof.model}, micro-batch {prof.micro_batch} "
                  f"x seq {prof.seq_len}, {prof.dtype}, {prof.device} ({prof.device_name})")
    cols = ("template", "fwd", "fwd+graph", "bwd (graph)", "bwd (recompute)", "load", "store", "offload", "reload",
            "optimizer")
    for c in cols:
        table.add_column(c, justify="left" if c == "template" else "right")
    for t in prof.units.values():
        opt = ", ".join(f"{k} {_ms(v)}" for k, v in t.optimizer_s.items())
        table.add_row(t.template, _ms(t.forward_s), _ms(t.forward_graph_s), _ms(t.backward_s),
                      _ms(t.recompute_backward_s), _ms(t.load_s), _ms(t.store_s), _ms(t.offload_s), _ms(t.reload_s), opt)
    worst = max(((s, t, f) for s, v in prof.contention.items() for t, f in v.items()), key=lambda x: x[2],
                default=None)
    tail = [f"milliseconds per micro-batch (median of {prof.repeats} rounds); per instruction {prof.dispatch_s * 1e6:.1f} "
            f"us, a blocking cross-stream wait {prof.event_latency_s * 1e6:.1f} us, between steps "
            f"{prof.step_gap_s * 1e6:.1f} us"]
    if worst:
        tail.append(f"streams slow each other: most, {worst[0]} while {worst[1]} is busy, x{worst[2]:.2f} "
                    "(planner/contention.py)")
    return render(table, width=130) + "".join(line + "\n" for line in tail)
