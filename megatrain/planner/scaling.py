"""Predicted scaling of a data-parallel world: the same job planned on 1, 2, 4, ... GPUs up to the world's.

Where it sits: `megatrain plan --nproc R` prints it under the plan (and `--json` includes it). Two views:
- weak scaling: each GPU keeps its micro-batches per step (the global batch grows with the GPUs), the usual
  data-parallel figure: speedup = tokens/s over one GPU's, efficiency = speedup / GPUs;
- strong scaling: the global step of the plan (its --grad-accum) split over the GPUs, where that divides.
Every row is a whole plan (passes.py) of one rank, so what binds it (compute, link, collectives, host
optimizer) is the estimator's answer for that world.
Try it: `megatrain plan --model llama3-8b --hardware h100-sxm --seq-len 4096 --grad-accum 8 --nproc 8`.
"""

from __future__ import annotations

from megatrain.ir.model_ir import ModelIR

from .errors import InfeasiblePlanError
from .hardware import Hardware
from .passes import plan
from .train import TrainSpec
from .world import World


def worlds(world: World) -> list[World]:
    """1, 2, 4, ... GPUs up to the world's: one node's ranks first, then whole nodes of the world's size."""
    L, out = world.ranks_per_node, []
    n = 1
    while n < world.nproc:
        if n <= L or n % L == 0:
            out.append(World(nproc=n, nnodes=max(1, n // L)) if n > L else World(nproc=n))
        n *= 2
    return [*out, world]


def scaling(ir: ModelIR, hw: Hardware, train: TrainSpec, budget: int, world: World,
            host_policy: str = "auto") -> list[dict]:
    """One row per world of `worlds(world)`: weak and strong scaling predictions (see the module)."""
    local = world.local_micro_batches(train.grad_accum)
    rows, base = [], None
    for w in worlds(world):
        row = {"nproc": w.nproc, "nnodes": w.nnodes}
        try:
            weak = plan(ir, hw, train.replace(grad_accum=local * w.nproc), budget, host_policy, world=w)
        except InfeasiblePlanError as e:
            rows.append({**row, "error": str(e)})
            continue
        base = base or weak.tokens_per_s
        row.update(step_time_s=weak.step_time_s, tokens_per_s=weak.tokens_per_s, speedup=weak.tokens_per_s / base,
                   efficiency=weak.tokens_per_s / base / w.nproc, bottleneck=weak.bottleneck,
                   host_bytes_per_rank=weak.host_bytes, host_bytes_per_node=weak.host_bytes_per_node,
                   collectives_s=weak.collectives_s)
        if train.grad_accum % w.nproc == 0:
            strong = plan(ir, hw, train, budget, host_policy, world=w)
            row.update(strong_step_time_s=strong.step_time_s, strong_tokens_per_s=strong.tokens_per_s,
                       strong_bottleneck=strong.bottleneck)
        rows.append(row)
    return rows


def format_scaling(rows: list[dict], train: TrainSpec, world: World) -> str:
    """The scaling table as `megatrain plan` prints it."""
    from rich import box
    from rich.table import Table

    from .bytesize import format_bytes
    from .display import render

    local = world.local_micro_batches(train.grad_accum)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
                  title=f"predicted scaling: weak = {local} micro-batch(es) per GPU per step; strong = the global "
                  f"{train.grad_accum} split across the GPUs")
    for col in ("GPUs", "nodes", "step s", "tokens/s", "speedup", "efficiency", "bottleneck", "host/rank",
                "host/node", "strong step s", "strong tokens/s", "strong bottleneck"):
        table.add_column(col, justify="left" if "bottleneck" in col else "right")
    for r in rows:
        if "error" in r:
            table.add_row(str(r["nproc"]), str(r["nnodes"]), "infeasible", r["error"][:60], *[""] * 8)
            continue
        strong = ((f"{r['strong_step_time_s']:.4g}", f"{r['strong_tokens_per_s']:,.0f}", r["strong_bottleneck"])
                  if "strong_step_time_s" in r else ("-", "-", "-"))
        table.add_row(str(r["nproc"]), str(r["nnodes"]), f"{r['step_time_s']:.4g}", f"{r['tokens_per_s']:,.0f}",
                      f"{r['speedup']:.2f}x", f"{r['efficiency']:.0%}", r["bottleneck"],
                      format_bytes(r["host_bytes_per_rank"]), format_bytes(r["host_bytes_per_node"]), *strong)
    return render(table, width=150)
