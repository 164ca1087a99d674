"""Choosing DepthSSD's rank N: the largest N in {1, 2, 4, 8, 16} whose plan fits the budget and whose predicted
step time stays within a tolerance of N = 1's (`megatrain plan --depth-rank auto`).

Where it sits: `megatrain plan` (cli/plan.py) calls `choose_rank` for `--depth-rank auto`; `tune(depth_ranks=...)` sweeps N.
Why: the depth state is N x T x d in fp32 per micro-batch on every unit boundary (models/depth/depthssd.py), so
N costs memory (carries, or the rebuild the planner may pick instead) and a little compute; a larger N buys
quality (reference/depth_mixing.md §5). The rank is the one model choice the budget decides, so the planner
makes it: each N is traced and planned, and the table of what every N costs is the reason given.

The reference is N = 1 planned with the GPU's whole memory: the fastest N = 1 step this hardware allows. Against
N = 1 at the same budget the choice would not grow with the budget: at some budgets N = 1 gains a prefetch slot
that N = 2's larger carries cannot afford yet, and N would drop. Against the fixed reference, every N's step time
only falls as the budget grows, so the chosen N only grows; when no N is within the tolerance (a budget so small
that even N = 1 is slowed), N = 1 is chosen.
Try it: `megatrain plan --model 1b --hardware h100-pcie --seq-len 4096 --depth-rank auto --gpu-mem 20GiB`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatrain.models.config import ModelConfig
from megatrain.models.depth.spec import DEFAULT_CHUNK, RANKS, parse_depth

from .bytesize import format_bytes
from .errors import InfeasiblePlanError
from .hardware import Hardware
from .passes import plan
from .plan import Plan
from .train import TrainSpec

DEFAULT_TOLERANCE = 0.05


def with_depth(config: ModelConfig, spec: str) -> ModelConfig:
    """`config` with another depth mixing (validated)."""
    return ModelConfig(**{**config.model_dump(), "depth_mixing": spec,
                          "name": f"{config.name}+{parse_depth(spec)}" if spec != config.depth_mixing else config.name})


def rank_config(config: ModelConfig, rank: int) -> ModelConfig:
    """`config` as DepthSSD-`rank`; a model with another non-residual depth mixing is refused."""
    spec = parse_depth(config.depth_mixing)
    if spec.kind not in ("residual", "depthssd"):
        raise ValueError(f"--depth-rank sets DepthSSD's rank, but the model mixes depth with {config.depth_mixing}; "
                         "drop --depth-rank or use --depth-mixing depthssd")
    chunk = f":chunk={spec.chunk}" if spec.kind == "depthssd" and spec.chunk != DEFAULT_CHUNK else ""
    return with_depth(config, f"depthssd:{rank}{chunk}")  # the model's state read kept


@dataclass(frozen=True)
class RankChoice:
    rank: int
    plan: Plan
    lines: tuple[str, ...]
    rows: tuple[dict, ...]


def choose_rank(config: ModelConfig, hw: Hardware, train: TrainSpec, budget: int,
                trace_fn: Callable[[ModelConfig, TrainSpec], object], tolerance: float = DEFAULT_TOLERANCE,
                ranks: Sequence[int] = RANKS, host_policy: str = "auto", **plan_kw) -> RankChoice:
    """Plan each rank; pick the largest that fits with step time <= (1 + tolerance) x that of N = 1. `plan_kw`:
    plan()'s other settings (resident=...)."""
    if not tolerance >= 0:
        raise ValueError(f"--rank-tolerance must be >= 0 (a fraction: 0.05 = 5%), got {tolerance}")
    plans: dict[int, Plan | InfeasiblePlanError] = {}
    for n in sorted(ranks):
        try:
            plans[n] = plan(trace_fn(rank_config(config, n), train), hw, train, budget, host_policy=host_policy,
                            **plan_kw)
        except InfeasiblePlanError as e:
            plans[n] = e
    if isinstance(plans[min(plans)], InfeasiblePlanError):
        raise plans[min(plans)]
    base = plan(trace_fn(rank_config(config, min(plans)), train), hw, train, max(budget, hw.gpu_memory_bytes),
                host_policy=host_policy, **plan_kw)
    limit = base.step_time_s * (1 + tolerance)
    rows, best = [], min(plans)
    for n, p in plans.items():
        if isinstance(p, InfeasiblePlanError):
            verdict = f"does not fit: needs {format_bytes(p.needed_bytes)}" if p.needed_bytes else "does not fit"
            rows.append({"rank": n, "feasible": False, "needed_bytes": p.needed_bytes, "verdict": verdict})
            continue
        slower = p.step_time_s / base.step_time_s - 1
        ok = p.step_time_s <= limit
        if ok:
            best = max(best, n)
        rows.append({"rank": n, "feasible": True, "peak_gpu_bytes": p.peak_gpu_bytes, "step_time_s": p.step_time_s,
                     "slower": slower, "rebuild_units": sum(1 for v in p.placement.values() if v == "rebuild"),
                     "verdict": "within tolerance" if ok else f"{slower:+.1%} over N=1, beyond {tolerance:.0%}"})
    lines = [f"depth rank: N={best}, the largest of {{{', '.join(map(str, sorted(plans)))}}} that fits "
             f"{format_bytes(budget)} within {tolerance:.0%} of N=1's step time with the whole "
             f"{format_bytes(base.gpu_budget_bytes)} ({base.step_time_s:.4g} s)"]
    for r in rows:
        if r["feasible"]:
            lines.append(f"  N={r['rank']:<3d} peak {format_bytes(r['peak_gpu_bytes']):>10}  step "
                         f"{r['step_time_s']:.4g} s ({r['slower']:+.1%})  {r['rebuild_units']} units rebuild  "
                         f"{r['verdict']}")
        else:
            lines.append(f"  N={r['rank']:<3d} {r['verdict']}")
    return RankChoice(rank=best, plan=plans[best], lines=tuple(lines), rows=tuple(rows))
