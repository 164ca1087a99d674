"""Printing IR values for people: human byte/count formats and the ModelIR table.

Where it sits: `str(model_ir)` and `megatrain inspect` use it; the planner's tables reuse the formatters.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from .model_ir import ModelIR


def format_bytes(n: int | float) -> str:
    """Binary units with three significant digits: `80.0 GiB`, `512 MiB`, `17 B`."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            v = n / scale
            return f"{sign}{v:.0f} {unit}" if v >= 100 else f"{sign}{v:.3g} {unit}"
    return f"{sign}{int(n)} B"


def fmt_count(n: float) -> str:
    """1_234_567 -> '1.23M' (decimal units, for parameters and FLOPs)."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def render(renderable, width: int = 120) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=False, color_system=None).print(renderable)
    return buf.getvalue()


def model_ir_table(ir: ModelIR, collapse: bool = True) -> Table:
    """Per-unit table; runs of identical blocks collapse into one row (`blocks.0-79 x80`)."""
    tokens = ir.tokens
    mixing = ir.config.get("depth_mixing", "residual")
    rebuild = any(u.rebuild_bytes is not None for u in ir.units)
    t = Table(title=f"{ir.model}: {fmt_count(ir.params_total)} params, micro-batch {ir.micro_batch} x "
                    f"{ir.seq_len} tokens, {ir.dtype}" + ("" if mixing == "residual" else f", depth mixing {mixing}"),
              title_justify="left")
    cols = ("unit", "params", "FLOPs/token fwd", "FLOPs/token bwd", "saved", "carry in", "carry out", "peak bwd")
    for col in (*cols, *(("rebuild ckpt",) if rebuild else ())):
        t.add_column(col, justify="left" if col == "unit" else "right")
    rows: list[list] = []
    for u in ir.units:
        key = (u.template, u.n_params, u.flops_fwd, u.flops_bwd, u.saved_bytes, u.carry_in_bytes, u.carry_out_bytes,
               u.peak_bwd_bytes, u.rebuild_bytes)
        if collapse and rows and rows[-1][0] == key:
            rows[-1][2] = u.name
            rows[-1][3] += 1
        else:
            rows.append([key, u.name, u.name, 1, u])
    for _key, first, last, count, u in rows:
        label = first if count == 1 else f"{first}-{last.split('.')[-1]} x{count}"
        t.add_row(label, fmt_count(u.n_params), fmt_count(u.flops_fwd / tokens), fmt_count(u.flops_bwd / tokens),
                  format_bytes(u.saved_bytes), format_bytes(u.carry_in_bytes), format_bytes(u.carry_out_bytes),
                  format_bytes(u.peak_bwd_bytes),
                  *((format_bytes(u.rebuild_bytes) if u.rebuild_bytes is not None else "-",) if rebuild else ()))
    fwd = sum(u.flops_fwd for u in ir.units)
    bwd = sum(u.flops_bwd for u in ir.units)
    t.add_section()
    t.add_row("total", fmt_count(ir.params_total), fmt_count(fwd / tokens), fmt_count(bwd / tokens),
              format_bytes(sum(u.saved_bytes for u in ir.units)), "", "", "", *(("",) if rebuild else ()))
    return t


def notes(ir: ModelIR) -> list[str]:
    """What the table's figures are, for a long-sequence trace: scaled, and priced at other chunk sizes."""
    out = []
    if ir.traced_seq_len is not None:
        out.append(f"traced at {ir.traced_seq_len:,} tokens and scaled to {ir.seq_len:,} (ir/scaled.py): bytes and "
                   "FLOPs exact, graph nodes extrapolated")
    if ir.chunk_tokens is not None:
        out.append(f"units tiled in chunks of {ir.chunk_tokens:,} tokens")
    attn = sum(u.attn_flops_fwd for u in ir.units) / max(1, sum(u.flops_fwd for u in ir.units))
    if attn >= 0.01:
        out.append(f"fused attention: {attn:.0%} of forward FLOPs (counted in full, T x T)")
    choices = [c for c in ir.chunk_choices if c is not None]
    if choices:
        block = max((u for u in ir.units if u.kind == "block"), key=lambda u: u.peak_bwd_bytes, default=None)
        if block is not None:
            figs = {o.chunk_tokens: o for o in block.chunk_options}
            out.append(f"{block.name} tiled (for the planner's chunks pass), peak bwd: " + ", ".join(
                f"{c:,} tokens {format_bytes(figs[c].peak_bwd_bytes)}" for c in choices[:1] + choices[-1:])
                + f"; untiled {format_bytes(figs[None].peak_bwd_bytes)}")
    return out


def format_model_ir(ir: ModelIR) -> str:
    return render(model_ir_table(ir)) + "".join(line + "\n" for line in notes(ir))
