"""Tuning: plan a grid of GPU budgets x micro-batch sizes (x micro-batches per step x state places) and mark
the Pareto front.

Where it sits: `megatrain.tune(...)` and `megatrain tune ...` (cli.py). Try it:
`megatrain tune --model llama3-8b --hardware h100-sxm --seq-len 4096 --gpu-mem 16GiB,24GiB,40GiB,80GiB --micro-batch 1,2,4
--grad-accum 1,4 --resident auto,none`.

A row is (micro_batch, grad_accum, resident, budget) with its Plan, or the InfeasiblePlanError's message. The
front is over (GPU budget, tokens/s): a feasible row is on it when no other feasible row has a budget no larger
and tokens/s at least as high, one of them strictly. A larger grad_accum steps the host optimizer once over more
tokens (what lifts a plan the optimizer binds), but it is also a larger batch, which the front cannot weigh: it
is a column to read, as the micro-batch is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import Field

from megatrain.ir.base import IRModel
from megatrain.ir.model_ir import ModelIR

from . import loading
from .bytesize import format_bytes, parse_bytes
from .errors import InfeasiblePlanError
from .hardware import Hardware, resolve_hardware
from .passes import plan
from .plan import Plan
from .train import TrainSpec


class TuneRow(IRModel):
    micro_batch: int
    grad_accum: int = Field(1, description="micro-batches per optimizer step")
    resident: str = Field("none", description="the state-place request the row was planned with: auto or none")
    depth_rank: int | None = Field(None, description="DepthSSD's rank N when tune sweeps it")
    gpu_budget_bytes: int
    feasible: bool
    plan: Plan | None = None
    error: str | None = None
    needed_bytes: int | None = Field(None, description="for infeasible rows: the smallest budget that works")
    pareto: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.plan.tokens_per_s if self.plan else 0.0


class TuneResult(IRModel):
    rows: tuple[TuneRow, ...]

    @property
    def front(self) -> list[TuneRow]:
        return [r for r in self.rows if r.pareto]

    def best(self) -> TuneRow | None:
        ok = [r for r in self.rows if r.feasible]
        return max(ok, key=lambda r: r.tokens_per_s) if ok else None

    def summary(self) -> list[dict]:
        """One dict per row, without the Plans (what `megatrain tune --json` prints)."""
        out = []
        for r in self.rows:
            d = {"depth_rank": r.depth_rank, "micro_batch": r.micro_batch, "grad_accum": r.grad_accum,
                 "resident": r.resident, "gpu_budget_bytes": r.gpu_budget_bytes, "feasible": r.feasible,
                 "pareto": r.pareto}
            if r.plan:
                p = r.plan
                d.update(peak_gpu_bytes=p.peak_gpu_bytes, host_bytes=p.host_bytes, host_policy=p.host_policy,
                         step_time_s=p.step_time_s,
                         tokens_per_s=p.tokens_per_s, mfu=p.mfu, bottleneck=p.bottleneck, n_slots=p.n_slots,
                         n_grad_slots=p.n_grad_slots, resident_units=list(p.resident_units))
            else:
                d.update(error=r.error, needed_bytes=r.needed_bytes)
            out.append(d)
        return out


def pareto_flags(points: Sequence[tuple[int, float] | None]) -> list[bool]:
    """For (budget, tokens/s) points (None = infeasible): which are not dominated."""
    flags = []
    for i, p in enumerate(points):
        if p is None:
            flags.append(False)
            continue
        dominated = any(q is not None and j != i and q[0] <= p[0] and q[1] >= p[1] and (q[0] < p[0] or q[1] > p[1])
                        for j, q in enumerate(points))
        flags.append(not dominated)
    return flags


def _listed(values, name: str, kinds: tuple[type, ...], example: str) -> list | None:
    """`values` as a list of `kinds` (one value alone is a list of it; None stays None), or one error."""
    if values is None:
        return None
    if isinstance(values, (int, str)) and not isinstance(values, bool):
        values = [values]  # one budget, micro-batch or rank: a string is never a list of its characters
    if not isinstance(values, Sequence) or not all(isinstance(v, kinds) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{name} must be a list of {' or '.join(k.__name__ for k in kinds)}, e.g. {example}, got "
                         f"{values!r:.60}")
    return list(values)


def tune(model, hardware: Hardware | str, train: TrainSpec, budgets: Sequence[int | str],
         micro_batches: Sequence[int] | None = None,
         trace_fn: Callable[[object, int, TrainSpec], ModelIR] | None = None,
         depth_ranks: Sequence[int] | None = None, host_policy: str = "auto", world=None,
         grad_accums: Sequence[int] | None = None, residents: Sequence[str] | None = None) -> TuneResult:
    """Plan every (micro-batch, budget) pair, and every DepthSSD rank in `depth_ranks`, every micro-batch count
    per step in `grad_accums` (default: train.grad_accum's) and every state-place request in `residents`
    ("auto", "none"; default: plan()'s) if given. `model` is a
    preset/config name, a ModelConfig or a ModelIR; a ModelIR at another micro-batch is re-traced from its
    config (synthetic ones rebuilt). Each (rank, micro-batch) is traced once (for the kernels of
    `hardware.device`); `train.micro_batch` is replaced by each value. The Pareto front is per rank: a
    larger N trades speed for quality, which the front cannot weigh. `world`: plan one rank of a data-parallel
    world (planner/world.py) for every row."""
    hw = resolve_hardware(hardware)
    if not isinstance(train, TrainSpec):
        raise ValueError(f"train must be a TrainSpec, e.g. TrainSpec(micro_batch=1, seq_len=4096), got "
                         f"{type(train).__name__}")
    budgets, micro_batches, depth_ranks = (_listed(budgets, "budgets", (int, str), "['40GiB', '80GiB']"),
                                           _listed(micro_batches, "micro_batches", (int,), "[1, 2]"),
                                           _listed(depth_ranks, "depth_ranks", (int,), "[1, 4, 16]"))
    accums = _listed(grad_accums, "grad_accums", (int,), "[1, 4]") or [train.grad_accum]
    if any(k <= 0 for k in accums):
        raise ValueError(f"grad_accums must be positive integers, got {accums}")
    places = _listed(residents, "residents", (str,), "['auto', 'none']")
    if places is not None and any(r not in ("auto", "none") for r in places):
        raise ValueError(f"residents must be 'auto' or 'none', got {places}")
    sizes = [parse_bytes(b) for b in budgets]
    mbs = list(micro_batches) if micro_batches else [train.micro_batch]
    if any(mb <= 0 for mb in mbs):
        raise ValueError(f"micro_batches must be positive integers, got {mbs}")
    if not sizes:
        raise ValueError("tune needs at least one budget, e.g. budgets=['40GiB', '80GiB']")
    too_big = [b for b in sizes if b > hw.gpu_memory_bytes]
    if too_big:
        raise ValueError(f"budget {format_bytes(too_big[0])} exceeds the {format_bytes(hw.gpu_memory_bytes)} of "
                         f"{hw.name}; drop it from the budgets or use a profile with more GPU memory")
    trace_fn = trace_fn or (lambda model, mb, spec: _trace(model, mb, spec, hw.device))
    rows: list[TuneRow] = []
    for rank in depth_ranks or [None]:
        variant = model
        if rank is not None:
            from megatrain.models import ModelConfig, load_model_config

            from .depth_rank import rank_config

            base = ModelConfig.model_validate(model.config) if isinstance(model, ModelIR) else load_model_config(model)
            variant = rank_config(base, rank)
        for mb in mbs:
            ir = trace_fn(variant, mb, train.replace(micro_batch=mb))  # the IR is per micro-batch, not per step
            for k in accums:
                spec = train.replace(micro_batch=mb, grad_accum=k)
                for res in places or [None]:
                    kw = {} if res is None else {"resident": res}
                    cell = dict(depth_rank=rank, micro_batch=mb, grad_accum=k, resident=res or _default_resident())
                    for budget in sizes:
                        try:
                            rows.append(TuneRow(**cell, gpu_budget_bytes=budget, feasible=True, plan=plan(
                                ir, hw, spec, budget, host_policy=host_policy, world=world, **kw)))
                        except InfeasiblePlanError as e:
                            rows.append(TuneRow(**cell, gpu_budget_bytes=budget, feasible=False, error=str(e),
                                                needed_bytes=e.needed_bytes))
    flags = [False] * len(rows)
    for rank in depth_ranks or [None]:
        idx = [i for i, r in enumerate(rows) if r.depth_rank == rank]
        for i, f in zip(idx, pareto_flags([(rows[i].gpu_budget_bytes, rows[i].tokens_per_s) if rows[i].feasible
                                           else None for i in idx])):
            flags[i] = f
    return TuneResult(rows=tuple(r.replace(pareto=f) for r, f in zip(rows, flags)))


def _default_resident() -> str:
    """What plan() does when not told where the state lives."""
    import inspect

    return inspect.signature(plan).parameters["resident"].default


def _trace(model: str | ModelIR, micro_batch: int, spec: TrainSpec, target: str) -> ModelIR:
    if isinstance(model, ModelIR):
        target = model.target
        if model.micro_batch == micro_batch and model.seq_len == spec.seq_len:
            return model
        if "synthetic" in model.config:
            from .synthetic import rebuild

            return rebuild(model, micro_batch)
        from megatrain.models import ModelConfig

        model = ModelConfig.model_validate(model.config)
    return loading.trace_model(model, micro_batch, spec.seq_len, spec.dtype, target)
