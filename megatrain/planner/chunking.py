"""The `chunks` pass: how many tokens a unit's tiled work takes at a time, chosen under the GPU budget.

Where it sits: the planner pass after host_policy (passes.py). A long-sequence trace prices every unit untiled and at each
candidate chunk size (`UnitIR.chunk_options`, ir/trace.py); this pass picks one and hands the rest of the
pipeline the IR at that size (`ModelIR.with_chunk`), whose `chunk_tokens` the runtime then applies in eager
and streamed units alike. Try it: `megatrain plan --model CONFIG --hardware h100-sxm --seq-len 262144 --explain`
with a config such as `{"base": "llama2-7b", "max_seq_len": 262144}`.

Rule: among the sizes whose least-memory schedule (one slot, one gradient slot, checkpoints on host; what the
`slots` pass requires) fits the budget, the one whose checkpoint search (placement.py) predicts the shortest
step; within 0.5% of that, the largest (the whole sequence, untiled, first): a larger chunk runs fewer, larger
kernels, while every tiled size costs the same recompute (the tiles' forward again in backward) and the
cost model charges a small one its dispatch overhead. When none fits, the size with the smallest floor, so
that the `slots` pass names the smallest workable budget with tiling considered.
"""

from __future__ import annotations

from megatrain.ir.model_ir import ModelIR

from .bytesize import format_bytes
from .costs import CostModel
from .hardware import Hardware
from .host_policy import HostPolicy
from .placement import analytic_time, exact_timeline, minimal, search

TIE = 0.005  # predicted steps this close count as equal: the larger chunk wins


def chunk_label(chunk: int | None) -> str:
    return "untiled" if chunk is None else f"{chunk:,} tokens"


def choose_chunk(ir: ModelIR, hw: Hardware, n_micro: int, clip: bool, budget: int, policy: HostPolicy | str,
                 host_state: int) -> tuple[ModelIR, list[str]]:
    """The IR at the chosen chunk size and the decision lines; `policy` and `host_state` (its host floor,
    host_policy.py) price the host optimizer and bound the checkpoints the host can take."""
    choices = ir.chunk_choices
    if not choices:
        what = ("untiled" if ir.chunk_tokens is None else f"tiled in chunks of {ir.chunk_tokens:,} tokens") + \
            " as traced"
        return ir, [f"{what}: the trace priced no other chunk sizes (it does for sequences over 8192 tokens)"]
    rows = []  # (chunk, floor, IR at it, predicted step or None when the floor does not fit)
    for chunk in choices:
        at = ir.with_chunk(chunk)
        floor = hw.gpu_bytes(exact_timeline(at, n_micro, minimal(at), clip).peak)
        step = None
        if floor <= budget:
            costs = CostModel(at, hw, policy, clip)
            dec, _, _ = search(at, costs, n_micro, clip, hw.device_bytes_for(budget), hw.host_memory_bytes - host_state)
            step = analytic_time(at, costs, n_micro, clip, dec)
        rows.append((chunk, floor, at, step))
    lines = ["least-memory schedule by chunk size: " + ", ".join(
        f"{chunk_label(c)} {format_bytes(n)}" for c, n, _, _ in rows)]
    fits = [r for r in rows if r[3] is not None]
    if fits:
        best = min(r[3] for r in fits)
        chunk, need, chosen, step = next(r for r in fits if r[3] <= best * (1 + TIE))
        lines.append("predicted step (analytic, after the checkpoint search): " + ", ".join(
            f"{chunk_label(c)} {t:.4g} s" for c, _, _, t in fits))
        lines.append(f"chose {chunk_label(chunk)}: " + ("the whole sequence fits and is as fast as any"
                     if chunk is None else f"the largest chunk within {TIE:.1%} of the fastest; "
                     f"{-(-ir.seq_len // chunk)} tiles per sequence") + f" (floor {format_bytes(need)})")
    else:
        chunk, need, chosen, _ = min(rows, key=lambda r: r[1])
        lines.append(f"nothing fits {format_bytes(budget)}: {chunk_label(chunk)} needs the least ({format_bytes(need)})")
    if chunk is not None:
        lines.append("tiled per chunk: input norm + q/k/v + RoPE, output projection, post-attention norm + MLP, and "
                     "the final norm inside the loss chunks; attention runs fused over the whole sequence")
    return chosen, lines
