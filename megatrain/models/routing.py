"""Routing for mixture-of-experts layers: which tokens go to which expert, the routing state, its statistics.

Where it sits: models/moe.py's MoE feed-forward calls `select` in every forward; the runtime (engine, host
store) and the eager reference (runtime/reference.py) set a `step_context` around each unit call, collect
each training forward's `RoutingLog`, and after the optimizer step call `update_buffers` on the unit with the
step's logs. Run its tests: `.venv/bin/pytest tests/models/test_moe.py`.

Routers (the Expert Threshold paper, arXiv 2603.11535, "ET" below):
- et (Expert Threshold): expert i takes token t when its raw router logit r_ti >= c_i, a per-expert threshold
  that estimates the (1 - top_k/E) quantile of the logits. c_i is an EMA (momentum beta) of the per-batch
  k-th largest logit, k = ceil(N * top_k / E) over the N tokens of the micro-batch, averaged over the step's
  micro-batches and updated once per optimizer step, with Adam-style bias correction c_eff = c_raw / (1 -
  beta^n) after n updates. For the first `warmup_steps` optimizer steps training routes by expert choice
  while the EMA warms up. In training every expert takes between k_min = floor((1-C)k) and k_max =
  floor((1+C)k) tokens: the lowest-scoring tokens above the threshold are dropped above k_max, the
  highest-scoring tokens below it pad up to k_min. At inference (eval mode) the rule is the pure test
  r >= c_eff: causal, one token at a time.
- ec (Expert Choice): in training expert i takes the k tokens of the micro-batch with the largest r_ti (an
  earlier token's routing depends on later tokens) while the same EMA of cutoffs as ET's learns; at inference
  it routes by that EMA, r >= c_eff (causal: the paper's evaluation of EC), or with ec_eval="topk" by the
  top-k over the micro-batch (the non-causal reference).
- tc (Token Choice): token t takes its top_k experts by r_t (+ a bias b with balance="bias"). Balancing:
  "aux" (Switch: alpha * E * sum_i f_i P_i, f the dispatch fractions, P the mean softmax probabilities),
  "bias" (DeepSeek loss-free: b_i += u * sign(mean load - load_i) once per step; b only selects) or none.

State (unit buffers, fp32, all starting at 0): et and ec: `threshold` (c_raw, E) and `updates` (n, a scalar:
the optimizer steps so far, so it also drives ET's warmup switch); tc with bias balancing: `bias` (E). The
forward reads them and never writes them; `update_buffers` changes them, once per optimizer step, from the
statistics the step's first forwards recorded. A backward's recompute routes exactly like the first forward
(the buffers have not changed) and records nothing: its step context has no log.

Host syncs (a GPU must not wait for the host in every layer): a training forward reads nothing back. The
routing decision stays on the device (the threshold's bias correction and the warmup switch are tensor ops,
tokens are grouped by expert with a scatter, no nonzero, mask indexing, bincount or blocking copy) and every
training selection has a static row count: expert choice k per expert, token choice N x top_k pairs, ET at
most k_max per expert, so E x k_max rows of which the first sum(take) are pairs and the rest padding
(`Selection.rows`). The experts run on device offsets (models/moe.py, torch._grouped_mm). What still reads
the row counts (`read_counts`, its one named device read): inference's threshold test (its total is not
bounded below N x E) and the experts' fallback loop where torch._grouped_mm cannot run without one. A
training forward records its counts, on the device, in its RoutingLog; the backward's recompute is handed
them (`step_context(..., replay=log.counts)`) and checks on the device, without a read, that it routed the
same. The statistics travel to the host by non-blocking copies into pinned memory on the d2h stream
(`to_host`).

Static shapes for tracing: on the meta device every expert takes ceil(N * top_k / E) tokens, so traced
FLOPs are those of the expected active tokens (the grouped matmuls compute no padding row); under
`capacity_bound()` (the tracer's memory pass) an ET expert takes k_max, the E x k_max rows a training step
keeps, so traced saved bytes bound what it can keep (moe.py prices the grouped matmuls on meta).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import Tensor

BUFFERS = {"et": (("threshold", "experts"), ("updates", "scalar")), "bias": (("bias", "experts"),)}


@dataclass
class RoutingLog:
    """What the MoE layers of one unit record in one training forward: one dict of statistics per layer, in
    module order (`cutoff`: the k-th largest logit per expert; `lag`: the threshold lag c_eff - cutoff per
    expert and `above`: the pairs with r >= c_eff, meaningful once the EMA has an update (`lagged` 1); `counts`:
    tokens each expert took; `dropped`, `padded`: capacity drops and pads; `zero`: tokens with no routed
    expert; `tokens`; `aux`: the aux loss), and per layer its experts' row counts, on the device (`counts`,
    what a recompute checks its routing against)."""

    records: list[dict[str, Tensor]] = field(default_factory=list)
    counts: list[Tensor] = field(default_factory=list)

    def to_host(self, copy=None) -> list[dict[str, Tensor]]:
        """The records on the host; `copy(t)` moves one tensor (default: a blocking `.to("cpu")`; the engine
        passes its device's non-blocking copy into pinned memory)."""
        copy = copy or (lambda t: t.to("cpu"))
        return [{k: copy(v) for k, v in r.items()} for r in self.records]


class Replay:
    """The row counts a training forward routed (device tensors), handed in order to the recompute of the
    same unit, which checks its own against them."""

    def __init__(self, counts: list[Tensor]):
        self.counts, self.at = counts, 0

    def next(self) -> Tensor:
        if self.at >= len(self.counts):
            raise RuntimeError(f"a recompute routed {self.at + 1} MoE layers, but its forward recorded "
                               f"{len(self.counts)}; the recompute must run the forward's layers in order")
        self.at += 1
        return self.counts[self.at - 1]


@dataclass(frozen=True)
class StepContext:
    log: RoutingLog | None  # where a step's first forward records; None in a recompute, which must not
    loss_scale: float  # d(step loss) / d(summed token loss): 1 / the step's target tokens
    replay: Replay | None = None  # a recompute's row counts, as its forward routed them


_CONTEXT: ContextVar[StepContext | None] = ContextVar("megatrain_routing_context", default=None)
_CAPACITY_BOUND: ContextVar[bool] = ContextVar("megatrain_routing_capacity_bound", default=False)


@contextmanager
def step_context(log: RoutingLog | None, loss_scale: float, replay: list[Tensor] | None = None) -> Iterator[None]:
    """Run a unit as part of a training step: MoE layers record into `log` (when given) and add their aux
    loss's gradient scaled by `loss_scale`. Without a context a layer records nothing and adds no aux loss.
    `replay`: the row counts the unit's forward recorded (its log's `counts`), for a recompute that checks,
    on the device, that it routes as its forward did."""
    token = _CONTEXT.set(StepContext(log, loss_scale, Replay(replay) if replay is not None else None))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current() -> StepContext | None:
    return _CONTEXT.get()


@contextmanager
def capacity_bound() -> Iterator[None]:
    """Trace with every ET expert at its training capacity k_max (the memory bound), not at k."""
    token = _CAPACITY_BOUND.set(True)
    try:
        yield
    finally:
        _CAPACITY_BOUND.reset(token)


# -- sizes ---------------------------------------------------------------------------------------------------
def expected_rows(n_tokens: int, top_k: int, n_experts: int) -> int:
    """k: the tokens an expert takes on average, ceil(N * top_k / E), at least 1 and at most N."""
    return max(1, min(n_tokens, -(-n_tokens * top_k // n_experts)))


def capacity(k: int, factor: float, n_tokens: int) -> tuple[int, int]:
    """(k_min, k_max) = (floor((1-C)k), floor((1+C)k)), clamped to [0, k] and [k, N]."""
    return max(0, math.floor((1 - factor) * k)), min(n_tokens, max(k, math.floor((1 + factor) * k)))


# -- selection -----------------------------------------------------------------------------------------------
@dataclass
class Selection:
    """The (token, expert) pairs a layer computes in R rows, grouped by expert: expert e's `counts_t[e]` pairs
    follow expert e-1's. Where `rows` is given, only the rows it marks are pairs: the rest, at the end, are
    padding (token 0, the last expert) that the experts leave 0 and so contributes nothing. `counts`: the
    counts on the host where known without a device read (static selections, or one that read them), else None."""

    token_idx: Tensor  # (R,) int64
    expert_idx: Tensor  # (R,) int64
    counts: list[int] | None
    stats: dict[str, Tensor] = field(default_factory=dict)
    counts_t: Tensor | None = None  # (E,) int64, on the logits' device
    rows: Tensor | None = None  # (R,) bool, the rows that are pairs; None: every row is

    def offsets(self) -> Tensor:
        """Each expert's end row, int32 on the device: torch._grouped_mm's `offs`."""
        return self.counts_t.cumsum(0).to(torch.int32)


def select(moe, logits: Tensor, buffers: dict[str, Tensor], training: bool) -> Selection:
    """Route the (N, E) fp32 logits of one micro-batch; no gradient flows through the choice. In a training
    step's forward the row counts go into its log; in its recompute they are checked against the log's."""
    sel = _route(moe, logits, buffers, training)
    ctx = current()
    if training and ctx is not None and logits.device.type != "meta":
        if ctx.replay is not None:
            _check_replay(sel.counts_t, ctx.replay.next())
        elif ctx.log is not None:
            ctx.log.counts.append(sel.counts_t)
    return sel


def _route(moe, logits: Tensor, buffers: dict[str, Tensor], training: bool) -> Selection:
    n, e = logits.shape
    k = expected_rows(n, moe.top_k, e)
    if logits.device.type == "meta":
        rows = capacity(k, moe.capacity_factor, n)[1] if moe.router == "et" and _CAPACITY_BOUND.get() else k
        sel = _static(logits, rows)
        if moe.router == "et" and training:  # as a run's ET selection: a row mask (every row a pair here)
            sel.rows = torch.ones(sel.token_idx.shape, dtype=torch.bool, device=logits.device)
        return sel
    if moe.router == "tc":
        bias = buffers.get("bias")
        return token_choice(logits if bias is None else logits + bias, moe.top_k)
    c_eff = corrected_threshold(buffers["threshold"], buffers["updates"], moe.momentum)
    if not training:
        if moe.router == "ec" and moe.ec_eval == "topk":
            return expert_choice(logits, k)
        return _from_mask(logits >= c_eff)
    if moe.router == "ec":  # expert choice in training; its EMA of the cutoffs learns for causal evaluation
        sel = expert_choice(logits, k)
        sel.stats["cutoff"] = logits.topk(k, dim=0).values[k - 1]
    else:
        sel = threshold_with_capacity(logits, c_eff, k, *capacity(k, moe.capacity_factor, n),
                                      warmup=buffers["updates"] < moe.warmup_steps)
    # the threshold lag (how far the EMA is from this pool's k-th logit) and what the pure threshold test would
    # route, as tensors (no read of the update count): the host keeps them once the EMA has an update
    sel.stats["lag"] = c_eff - sel.stats["cutoff"]
    sel.stats["above"] = (logits >= c_eff).sum().float()
    sel.stats["lagged"] = (buffers["updates"] > 0).float()
    return sel


def corrected_threshold(c_raw: Tensor, updates: Tensor, momentum: float) -> Tensor:
    """c_eff = c_raw / (1 - beta^n), the bias-corrected EMA; c_raw itself (0) before the first update. On the
    device (beta^n in fp64, as Python computes it): no read of n."""
    n = updates.to(torch.float64)
    denom = (1.0 - torch.pow(torch.full_like(n, momentum), n)).to(c_raw.dtype)
    return torch.where(n > 0, c_raw / torch.where(n > 0, denom, 1.0), c_raw)


def expert_choice(logits: Tensor, k: int) -> Selection:
    """Each expert takes its k highest-scoring tokens of the pool."""
    return _static(logits, k)


def threshold_with_capacity(logits: Tensor, c_eff: Tensor, k: int, k_min: int, k_max: int,
                            warmup: Tensor | bool = False) -> Selection:
    """Tokens with r >= c_eff, at most k_max (the lowest dropped) and at least k_min (padded with the next
    highest below the threshold) per expert; while `warmup` (a device bool: updates < warmup_steps), expert
    choice instead: each expert's k highest. Either way the k-th largest logit (`cutoff`) is recorded. The
    selection has E x k_max rows, the pairs first, padding after (Selection.rows)."""
    values, top = logits.topk(k_max, dim=0)  # (k_max, E), each column by descending logit
    top = top.T  # (E, k_max)
    above = (logits >= c_eff).sum(0)
    warm = torch.as_tensor(warmup, device=logits.device)
    take = torch.where(warm, k, above.clamp(k_min, k_max))
    capped = (~warm).float()  # drops and pads count only once thresholds route
    stats = {"dropped": (above - k_max).clamp(min=0).sum().float() * capped,
             "padded": (k_min - above).clamp(min=0).sum().float() * capped,
             "cutoff": values[k - 1]}
    sel = _grouped(torch.arange(k_max, device=logits.device) < take[:, None], top, take, top.numel(), padded=True)
    sel.stats.update(stats)
    return sel


def token_choice(scores: Tensor, top_k: int) -> Selection:
    """Each token takes its top_k experts by `scores`: N x top_k pairs."""
    chosen = scores.topk(top_k, dim=1).indices
    return _from_mask(torch.zeros_like(scores, dtype=torch.bool).scatter_(1, chosen, True), chosen.numel())


def _from_mask(mask: Tensor, pairs: int | None = None) -> Selection:
    """The pairs of an (N, E) assignment mask, grouped by expert, tokens ascending within each; `pairs`: how
    many there are, where known statically (else read from the device)."""
    n = mask.shape[0]
    tokens = torch.arange(n, device=mask.device).expand(mask.shape[1], n)
    return _grouped(mask.T, tokens, mask.sum(0), pairs)


def _grouped(valid: Tensor, values: Tensor, counts_t: Tensor, rows: int | None, padded: bool = False) -> Selection:
    """Selection of the `values` (E, M) where `valid`, expert by expert in row order, with `counts_t` (E,) =
    valid.sum(1), in `rows` rows: exactly the pairs, or with `padded` a bound on them (the rest padding);
    `rows` None: the pairs read from the device (read_counts; only inference's threshold test, whose total
    has no useful static bound). A scatter places each valid entry at its expert's offset plus its rank (each
    invalid one in a slot of its own past the end, so no two writes meet, then dropped)."""
    counts = None
    if rows is None:
        counts = read_counts(counts_t)
        rows = sum(counts)
    e, m = valid.shape
    rank = valid.cumsum(1) - 1
    ends = counts_t.cumsum(0)
    spill = rows + torch.arange(e * m, device=valid.device).view(e, m)
    dest = torch.where(valid, (ends - counts_t)[:, None] + rank, spill)
    flat = torch.zeros(rows + e * m, dtype=torch.long, device=valid.device)  # zeros: padding rows take token 0
    # NOTE: a copy of its own: the gather keeps token_idx for backward, which must not hold the spill slots
    token_idx = flat.scatter_(0, dest.reshape(-1), values.reshape(-1))[:rows].clone()
    row = torch.arange(rows, device=valid.device)
    expert_idx = torch.searchsorted(ends, row, right=True).clamp_(max=e - 1)  # the expert whose rows hold it
    return Selection(token_idx, expert_idx, counts, counts_t=counts_t, rows=row < ends[-1] if padded else None)


def read_counts(counts_t: Tensor) -> list[int]:
    """counts_t to host ints: a device sync (its own function so tests can count them). A training forward
    makes none where torch._grouped_mm runs (models/moe.py, grouped_mm_runs)."""
    return counts_t.tolist()


def _check_replay(counts_t: Tensor, counts: Tensor) -> None:
    """A recompute must route as its forward did: compare its row counts with the forward's on the device."""
    if counts.shape != counts_t.shape:
        raise RuntimeError(f"a recompute checks {counts.numel()} expert counts for a layer of {counts_t.numel()} "
                           "experts: its forward recorded another layer")
    # NOTE: a failed device assert on CUDA ends the process's CUDA context: better than wrong gradients
    torch._assert_async((counts_t == counts).all())


def _static(logits: Tensor, rows: int) -> Selection:
    e = logits.shape[1]
    token_idx = logits.topk(rows, dim=0).indices.T.reshape(-1)
    expert_idx = torch.arange(e, device=logits.device).repeat_interleave(rows)
    counts_t = torch.full((e,), rows, dtype=torch.long, device=logits.device)
    return Selection(token_idx, expert_idx, [rows] * e, counts_t=counts_t)


def record_stats(sel: Selection, n_tokens: int, n_experts: int) -> dict[str, Tensor]:
    """The statistics of one layer's training forward (RoutingLog's per-layer dict), on the device: no sync."""
    counts = sel.counts_t.float()
    hits = torch.ones_like(sel.token_idx) if sel.rows is None else sel.rows.long()  # padding routes no token
    routed = torch.zeros(n_tokens, dtype=torch.long, device=counts.device).index_add_(0, sel.token_idx, hits) > 0
    zero = torch.zeros((), device=counts.device)
    return {"counts": counts, "zero": (~routed).sum().float(), "dropped": sel.stats.get("dropped", zero),
            "padded": sel.stats.get("padded", zero), "tokens": torch.full((), float(n_tokens), device=counts.device),
            **{k: sel.stats[k] for k in ("cutoff", "lag", "above", "lagged") if k in sel.stats}}


# -- state ---------------------------------------------------------------------------------------------------
def buffer_shapes(moe, n_experts: int) -> list[tuple[str, tuple[int, ...]]]:
    """The routing buffers of one layer, by local name (all fp32, all starting at 0)."""
    kind = "et" if moe.router in ("et", "ec") else "bias" if moe.balance == "bias" else None
    return [(name, (n_experts,) if size == "experts" else ()) for name, size in BUFFERS.get(kind, ())]


def update_layer(moe, buffers: dict[str, Tensor], records: list[dict[str, Tensor]]) -> None:
    """One optimizer step's update of one layer's buffers from its micro-batches' records, in place."""
    if not records or not buffers:
        return
    if moe.router in ("et", "ec"):
        cutoff = torch.stack([r["cutoff"] for r in records]).mean(0)
        buffers["threshold"].mul_(moe.momentum).add_(cutoff, alpha=1.0 - moe.momentum)
        buffers["updates"].add_(1.0)
    elif moe.balance == "bias":
        load = torch.stack([r["counts"] for r in records]).sum(0)
        buffers["bias"].add_(torch.sign(load.mean() - load), alpha=moe.bias_rate)


# -- metrics -------------------------------------------------------------------------------------------------
def summarize(logs: dict[str, list[list[dict[str, Tensor]]]], top_k: int) -> dict:
    """Per-step routing metrics from each MoE unit's records (one list per micro-batch).

    Per layer: `load` (fraction of tokens each expert took; the target is top_k/E), `experts_per_token`,
    `zero_expert_share` (tokens with no routed expert), `drop_rate` and `pad_rate` (capacity drops and pads
    per target assignment, N x top_k), `load_max_over_mean`, `aux_loss`; et and ec: `threshold_lag` and
    `threshold_lag_abs` (the mean over experts and micro-batches of c_eff - the pool's k-th largest logit, and
    of its absolute value: > 0, the threshold the step routes by is above the cutoff it should estimate) and
    `threshold_rate` (pairs with r >= c_eff per target assignment: what the pure threshold test would route,
    1 = on target); `moe_*` keys average over layers."""
    layers = {unit: _layer_metrics([r for mb in per_mb for r in mb], top_k) for unit, per_mb in logs.items()}
    layers = {unit: row for unit, row in layers.items() if row}
    if not layers:
        return {}
    out: dict = {"moe_layers": layers}
    for key in ("experts_per_token", "zero_expert_share", "drop_rate", "pad_rate", "load_max_over_mean", "aux_loss",
                "threshold_lag", "threshold_lag_abs", "threshold_rate"):
        vals = [row[key] for row in layers.values() if key in row]
        if vals:
            out[f"moe_{key}"] = sum(vals) / len(vals)
    return out


def _layer_metrics(recs: list[dict[str, Tensor]], top_k: int) -> dict:
    if not recs:
        return {}
    tokens = sum(float(r["tokens"]) for r in recs)
    counts = torch.stack([r["counts"].cpu() for r in recs]).sum(0)
    total = float(counts.sum())
    summed = {key: sum(float(r[key]) for r in recs) for key in ("zero", "dropped", "padded")}
    row = {"load": [round(float(c) / tokens, 5) for c in counts], "experts_per_token": total / tokens,
           "zero_expert_share": summed["zero"] / tokens, "drop_rate": summed["dropped"] / (tokens * top_k),
           "pad_rate": summed["padded"] / (tokens * top_k),
           "load_max_over_mean": float(counts.max()) / max(total / len(counts), 1e-9)}
    if "aux" in recs[0]:
        row["aux_loss"] = sum(float(r["aux"]) for r in recs) / len(recs)
    if "lag" in recs[0] and all(float(r["lagged"]) > 0 for r in recs):  # once the EMA has an update
        row["threshold_lag"] = sum(float(r["lag"].mean()) for r in recs) / len(recs)
        row["threshold_lag_abs"] = sum(float(r["lag"].abs().mean()) for r in recs) / len(recs)
        row["threshold_rate"] = sum(float(r["above"]) for r in recs) / (tokens * top_k)
    return row
