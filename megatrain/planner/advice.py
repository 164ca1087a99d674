"""When the host optimizer binds: how far a larger --grad-accum, or the other state-place choice, would move it.

Where it sits: `megatrain plan` calls `optimizer_advice` on the plan it prints when the host optimizer holds the
largest share of the critical path; display.py prints its lines (in the printed plan, and so under --explain),
`plan --json` carries it as `optimizer_binds`. Try it:
`megatrain plan --model llama3-8b --hardware h200 --gpu-mem 80GiB --seq-len 8192 --resident none`.

Each variant is the same plan() with one setting changed: the IR is per micro-batch, so nothing is traced
again, and a variant costs one planning (tenths of a second at 8B). Why these two: the host steps every
parameter once per optimizer step whatever the tokens, so more micro-batches per step spread the same host
work over more tokens (a larger batch, though: the learning rate may want retuning), and a unit whose state
lives on the device takes its step off the host altogether (planner/residency.py).
"""

from __future__ import annotations

from pydantic import Field

from megatrain.ir.base import IRModel
from megatrain.ir.model_ir import ModelIR

from .errors import InfeasiblePlanError
from .passes import plan
from .plan import Plan

SCALES = (2, 4)  # the --grad-accum multiples priced


class Variant(IRModel):
    """The plan with one setting changed, as the advice states it."""

    flag: str = Field(description="the flag that gives it, e.g. `--grad-accum 2`")
    grad_accum: int
    resident: str
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    bottleneck: str | None = None
    bottleneck_share: float | None = None
    resident_units: int = 0
    error: str | None = Field(None, description="why it cannot be planned (an infeasible budget)")


class Advice(IRModel):
    """The host optimizer binds the plan: its share and what each variant would give."""

    share: float = Field(description="the host optimizer's share of the critical path")
    optimizer_s: float = Field(description="seconds of host AdamW work a step")
    tokens_per_s: float
    variants: tuple[Variant, ...]

    def lines(self) -> list[str]:
        out = [f"the host optimizer binds ({self.share:.0%} of the critical path, {self.optimizer_s:.4g} s of "
               "host AdamW a step); what would move it:"]
        for v in self.variants:
            if v.tokens_per_s is None:
                out.append(f"  {v.flag}: no plan ({v.error})")
                continue
            gain = v.tokens_per_s / self.tokens_per_s - 1
            what = (f"{v.resident_units} unit(s) with their state on the GPU" if v.resident_units else
                    "every unit streamed")
            tail = " (a larger batch per optimizer step)" if v.flag.startswith("--grad-accum") else f": {what}"
            out.append(f"  {v.flag}: {v.tokens_per_s:,.0f} tokens/s ({gain:+.0%}), bottleneck {v.bottleneck} "
                       f"{v.bottleneck_share:.0%}{tail}")
        return out


def binds(p: Plan) -> bool:
    """The host optimizer holds the largest share of the plan's critical path."""
    return p.bottleneck == "host_optimizer"


def optimizer_advice(p: Plan, ir: ModelIR, host_policy: str = "auto", resident: str = "auto",
                     world=None) -> Advice | None:
    """None unless the host optimizer binds `p`; else the plans of `--grad-accum` x2 and x4 (the same resident
    request) and of the other resident request at this grad_accum. `ir` is the IR `p` was planned from (before
    the chunks pass chose a tile size), `host_policy`, `resident` and `world` what it was planned with."""
    if not binds(p):
        return None
    K = p.train.grad_accum
    asks = [(f"--grad-accum {K * m}", K * m, resident) for m in SCALES]
    other = "none" if resident == "auto" else "auto"
    asks.append((f"--resident {other}", K, other))
    variants = []
    for flag, k, res in asks:
        try:
            q = plan(ir, p.hardware, p.train.replace(grad_accum=k), p.gpu_budget_bytes, host_policy=host_policy,
                     world=world, resident=res)
        except (InfeasiblePlanError, ValueError) as e:
            variants.append(Variant(flag=flag, grad_accum=k, resident=res, error=str(e).split(";")[0]))
            continue
        variants.append(Variant(flag=flag, grad_accum=k, resident=res, tokens_per_s=q.tokens_per_s,
                                step_time_s=q.step_time_s, bottleneck=q.bottleneck,
                                bottleneck_share=q.bottleneck_share, resident_units=len(q.resident_units)))
    return Advice(share=p.bottleneck_share, optimizer_s=p.busy_s.get("host_optimizer", 0.0),
                  tokens_per_s=p.tokens_per_s, variants=tuple(variants))
