"""The host optimizer step under each host policy (planner/host_policy.py) as torch ops, and each policy's state.

Where it sits: host_state.adamw_step runs `adamw` where host_kernel.c is not available, and host_kernel.py checks
its one-pass loop against `adamw` before using it (`self_check`); both give the same bits. This module imports
neither kernel, so the two can compare against it. Per policy:
- exact: torch's fused CPU AdamW over fp32 master, gradient and moments. With the clip factor c < 1 the
  gradient is multiplied by c into a cache-sized scratch chunk by chunk (g * c, the rounding clip_grad_norm_'s
  in-place multiply has) and the fused kernel runs on the chunk: no extra pass over the gradients. With c = 1
  (clip_grad_norm_ then multiplies by exactly 1.0) nothing is multiplied. NOTE: torch's `grad_scale` input
  divides (g / s), which rounds differently from g * c, so no policy folds the factor there; measured in
  tests/runtime/test_host_policy.py.
- compressed policies: per parameter, in STEP_CHUNK-element chunks that stay in cache: the chunk's gradient
  (upcast from bf16 if held so; times c, as exact multiplies, when clipped) and moments are expanded to fp32
  scratch, the fused kernel updates master and scratch, and the moments are rounded back: bf16 by
  stochastic rounding (stochastic_round.py: unbiased, so that v's small steps at beta2 near 1 add up; the
  bits a function of the parameter's key, the step and the element's index in its parameter); fp8 as
  float8_e4m3fn per FP8_BLOCK-element block (blocks start at each parameter's first element) with an fp32
  scale = block amax / 448, rounded as x times 448 / amax (`_quantiser`: a multiply, not a division per
  element), to fp16 at a scale of 1 / 256 first, then to e4m3 (host_kernel.c FP8_CODES: two roundings, so
  that the vector loop converts with vcvtps2ph). A dequantised second moment is
  floored at its block's least positive step (scale x 2^-9), so a value that underflowed to 0 never divides a
  non-zero first moment by eps alone; an all-zero block keeps scale 0. Under fp8 the fused kernel updates
  only the moments; the weights take `_fp8_update`, whose denominator multiplies by 1 / sqrt(bc2) where
  torch's divides by sqrt(bc2) and whose denominator and weight are fused multiply-adds: one division per
  element instead of two and two operations fewer, for the one-pass loop's speed (host_kernel.c FP8_UPDATE).
  Results do not depend on the chunk size (elementwise math, blocks inside chunks), only on the values.
`device_adamw` runs the exact policy's step on a device-resident unit's tensors (runtime/resident.py): the scratch
on their device, and a device-side `found_inf` flag that skips the update (step counts included) unread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.optim.adamw import adamw as functional_adamw

from megatrain.planner.host_policy import FP8_BLOCK, HostPolicy, resolve
from megatrain.planner.residency import STEP_CHUNK as RESIDENT_STEP_CHUNK
from megatrain.planner.train import TrainSpec

from . import host_memory, stochastic_round

# NOTE: with several threads a torch op's OpenMP team spins on its cores for a while after it (libgomp's wait
# policy) and takes them from a host step or cast timed right after. Timed steps and casts wait this long first.
OMP_SETTLE_S = 0.01
FMA_SLICE = 1 << 15  # elements per slice of _fma32
STEP_CHUNK = RESIDENT_STEP_CHUNK  # elements per in-cache pass (4 MiB of fp32 per scratch), a multiple of FP8_BLOCK
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_TINY = 2.0**-9  # the least positive float8_e4m3fn (a subnormal)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": FP8}


@dataclass
class Moments:
    """One parameter's AdamW moments under a policy (scales: fp8 only, one per block)."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    avg_scale: torch.Tensor | None = None
    sq_scale: torch.Tensor | None = None
    # bf16 moments' stochastic rounding (stochastic_round.py): the parameter's key, and where these tensors start
    # in it (a data-parallel shard's slice), so that every holder of an element draws the same bits for it
    key: int = 0
    origin: int = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        """By checkpoint kind: exp_avg, exp_avg_sq in their stored dtype, then the fp8 scales."""
        out = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.avg_scale is not None:
            out.update(exp_avg_scale=self.avg_scale, exp_avg_sq_scale=self.sq_scale)
        return out


def moment_dtype(policy: HostPolicy | str) -> torch.dtype:
    return DTYPES[resolve(policy).moments]


def grad_dtype(policy: HostPolicy | str) -> torch.dtype:
    return DTYPES[resolve(policy).grads]


def n_blocks(numel: int) -> int:
    return math.ceil(numel / FP8_BLOCK)


def new_moments(policy: HostPolicy | str, shape: tuple[int, ...], name: str = "") -> Moments:
    """Zero moments for one parameter of `shape` (the eager reference's state), on huge pages where Linux
    gives them (host_memory.advise_huge_pages), as the host store's are; `name`: its eager name, which keys
    its stochastic rounding (stochastic_round.param_key)."""
    policy, numel = resolve(policy), math.prod(shape)
    dtype = moment_dtype(policy)
    m = Moments(host_memory.empty(shape, dtype).zero_(), host_memory.empty(shape, dtype).zero_(),
                key=stochastic_round.param_key(name))
    if policy.moments == "fp8":
        m.avg_scale, m.sq_scale = torch.zeros(n_blocks(numel)), torch.zeros(n_blocks(numel))
    return m


def _fused(params, grads, exp_avgs, exp_avg_sqs, steps, cfg: TrainSpec, lr: float, wd: float, found_inf=None):
    functional_adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, fused=True, amsgrad=False,
                     beta1=cfg.betas[0], beta2=cfg.betas[1], lr=lr, weight_decay=wd, eps=cfg.eps,
                     maximize=False, found_inf=found_inf)


class _Scratch:
    """fp32 chunk buffers for one step call, sized to its largest chunk (fp8: and an index buffer)."""

    def __init__(self, numel: int, fp8: bool = False, device=None):
        n = min(STEP_CHUNK, numel)  # on `device`: a device-resident unit's step (runtime/resident.py)
        self.g, self.m, self.v = (torch.empty(n, device=device) for _ in range(3))
        self.index = torch.empty(n, dtype=torch.int32) if fp8 else None
        self.work = torch.empty(n) if fp8 else None
        self.p, self.den = (torch.zeros(n), torch.empty(n)) if fp8 else (None, None)


# every float8_e4m3fn value by its bit pattern: a table lookup expands fp8 to fp32 faster than torch's own
# element-wise conversion on CPU, to the same values (the conversion is exact either way)
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8).float()


def _chunks(numel: int):
    for a in range(0, numel, STEP_CHUNK):
        yield a, min(numel, a + STEP_CHUNK)


def unclipped(clip: torch.Tensor | None) -> torch.Tensor | None:
    """The clip factor a step multiplies by: None where it is exactly 1.0 (clip_grad_norm_'s multiply by 1.0
    changes nothing)."""
    return None if clip is not None and float(clip) == 1.0 else clip


def groups(params: list, grads: list, moments: list, steps: list, cfg: TrainSpec, decay: list[bool] | None,
           copies: list | None = None):
    """adamw_step's arguments by weight decay, decayed first, empty groups left out: (weight decay, (params,
    grads, moments, steps), copies or None) each; `decay[i]`: whether parameter i takes cfg.weight_decay
    (None: all do)."""
    decay = decay if decay is not None else [True] * len(params)
    for wd in (True, False):
        idx = [i for i, d in enumerate(decay) if d == wd]
        if not idx:
            continue
        group = ([params[i] for i in idx], [grads[i] for i in idx], [moments[i] for i in idx],
                 [steps[i] for i in idx])
        yield (cfg.weight_decay if wd else 0.0), group, ([copies[i] for i in idx] if copies is not None else None)


def adamw(policy: HostPolicy | str, params: list[torch.Tensor], grads: list[torch.Tensor], moments: list[Moments],
          steps: list[torch.Tensor], cfg: TrainSpec, lr: float, decay: list[bool] | None = None,
          clip: torch.Tensor | None = None) -> None:
    """host_state.adamw_step's update (its arguments' meaning) as torch ops; the bf16 copies are the caller's."""
    policy, clip = resolve(policy), unclipped(clip)
    for wd, group, _ in groups(params, grads, moments, steps, cfg, decay):
        if policy.moments == "float32" and policy.grads == "float32":
            _exact(*group, cfg, lr, wd, clip)
        else:
            _compressed(policy, *group, cfg, lr, wd, clip)


def _exact(params, grads, moments, steps, cfg, lr, wd, clip, found_inf=None) -> None:
    avgs, sqs = [m.exp_avg for m in moments], [m.exp_avg_sq for m in moments]
    if clip is None:
        _fused(params, grads, avgs, sqs, steps, cfg, lr, wd, found_inf)
        return
    scratch = _Scratch(max(p.numel() for p in params), device=params[0].device)
    for p, g, m, v, step in zip(params, grads, avgs, sqs, steps):
        p, g, m, v = p.view(-1), g.view(-1), m.view(-1), v.view(-1)
        for a, b in _chunks(p.numel()):
            scaled = torch.mul(g[a:b], clip, out=scratch.g[: b - a])
            _fused([p[a:b]], [scaled], [m[a:b]], [v[a:b]], [step.clone()], cfg, lr, wd, found_inf)
        step.add_(1)
        if found_inf is not None:  # a skipped step: the count stays (the fused kernel undid its clones')
            step.sub_(found_inf)


def device_adamw(policy: HostPolicy | str, params: list[torch.Tensor], grads: list[torch.Tensor],
                 moments: list[Moments], steps: list[torch.Tensor], cfg: TrainSpec, lr: float,
                 decay: list[bool] | None, clip: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
    """`adamw` on a device-resident unit's tensors (runtime/resident.py), under the exact policy (the
    compressed ones read their step count on the host, a device sync): the same torch ops, so the same bits as
    the host's step; `found_inf` (an fp32 flag on the device, or None) skips the whole update, step counts
    included, with no host read of it."""
    policy, clip = resolve(policy), unclipped(clip)
    if policy.name != "exact":
        raise ValueError(f"a device-resident unit steps under the exact host policy only, not {policy.name}; "
                         "plan with host_policy exact or resident='none'")
    for wd, group, _ in groups(params, grads, moments, steps, cfg, decay):
        _exact(*group, cfg, lr, wd, clip, found_inf)


def _compressed(policy: HostPolicy, params, grads, moments, steps, cfg, lr, wd, clip) -> None:
    fp8 = policy.moments == "fp8"
    scratch = _Scratch(max(p.numel() for p in params), fp8)
    sr_work = None if fp8 else stochastic_round.workspace(scratch.m.numel(), params[0].device)
    for p, g, mom, step in zip(params, grads, moments, steps):
        p, g = p.view(-1), g.view(-1)
        m, v = mom.exp_avg.view(-1), mom.exp_avg_sq.view(-1)
        for a, b in _chunks(p.numel()):
            n = b - a
            if g.dtype == torch.float32 and clip is None:
                gc = g[a:b]
            else:
                gc = scratch.g[:n]
                gc.copy_(g[a:b])  # fp32, then times the factor in fp32 (exact's rounding)
                if clip is not None:
                    gc.mul_(clip)
            mc, vc = scratch.m[:n], scratch.v[:n]
            if fp8:
                blocks = slice(a // FP8_BLOCK, (b + FP8_BLOCK - 1) // FP8_BLOCK)
                _dequant(m[a:b], mom.avg_scale[blocks], mc, scratch.index[:n], floor=False)
                _dequant(v[a:b], mom.sq_scale[blocks], vc, scratch.index[:n], floor=True)
            else:
                mc.copy_(m[a:b])
                vc.copy_(v[a:b])
            if fp8:  # the moments as the fused kernel updates them; the weights by _fp8_update
                _fused([scratch.p[:n]], [gc], [mc], [vc], [step.clone()], cfg, lr, wd)
                _fp8_update(p[a:b], mc, vc, scratch.den[:n], scratch.work[:n], cfg, lr, wd, float(step) + 1)
                _quant(mc, m[a:b], mom.avg_scale[blocks], scratch.work)
                _quant(vc, v[a:b], mom.sq_scale[blocks], scratch.work)
            else:
                _fused([p[a:b]], [gc], [mc], [vc], [step.clone()], cfg, lr, wd)
                seed = stochastic_round.step_seed(mom.key, int(step) + 1)
                stochastic_round.round_moments(mc, vc, m[a:b], v[a:b], seed, mom.origin + a, sr_work)
        step.add_(1)


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def _fp8_update(p, m, v, den, upd, cfg: TrainSpec, lr: float, wd: float, step: float) -> None:
    """The fp8 policy's weight update from the updated moments m, v (host_kernel.c FP8_UPDATE): den = fma(sqrt(v),
    1 / sqrt(bc2), eps), u = ((-lr / bc1) m) / den, p = fma(p, 1 - lr wd, u) (p + u without weight decay), each
    operation rounded to fp32 once. Torch's kernel divides sqrt(v) by sqrt(bc2) and rounds the products and sums
    apart: its weights differ from these by an ulp or so, which the policy's quality measurement covers
    (docs/RESULTS.md). The coefficients are host_kernel.c `coefficients`' in double, cast to fp32."""
    b1, b2 = cfg.betas
    d = den.numpy()
    with np.errstate(invalid="ignore"):  # a negative v (a corrupt state) gives NaN, as the fused kernel's
        np.sqrt(v.numpy(), out=d)  # NOTE: torch.sqrt is MKL's on CPU, not correctly rounded (numpy's is)
    _fma32(d, _f32(1 / math.sqrt(1 - b2**step)), _f32(cfg.eps), d)
    torch.mul(m, _f32(-(lr / (1 - b1**step))), out=upd).div_(den)
    if wd != 0:
        _fma32(p.numpy(), _f32(1 - lr * wd), upd.numpy(), p.numpy())
    else:
        p.add_(upd)


def _fma32(a: np.ndarray, b: float, c: np.ndarray | float, out: np.ndarray) -> None:
    """out = a b + c for fp32 a (and c), rounded once to fp32, as a fused multiply-add (numpy has none). The
    product is exact in fp64 and the sum s rounds there first; s then rounds to the same fp32 as the exact sum
    unless it landed on an fp32 rounding midpoint (its low 29 mantissa bits 1 followed by zeros) or lies below
    fp32's normal range. Those few are rounded to odd in fp64 (TwoSum's exact error says which way), and rounding
    to odd at 53 bits then to nearest at 24 is rounding to nearest at 24. In slices whose fp64 temporaries stay
    in L2 (a whole 1M-element chunk at once took twice as long)."""
    if a.size > FMA_SLICE:
        for i in range(0, a.size, FMA_SLICE):
            j = slice(i, i + FMA_SLICE)
            _fma32(a[j], b, c if np.ndim(c) == 0 else c[j], out[j])
        return
    prod = a.astype(np.float64)
    prod *= b
    s = prod + c
    bits = s.view(np.int64)
    risky = np.flatnonzero(((bits & 0x1FFFFFFF) == 0x10000000) | ((bits >> 52 & 0x7FF) < 1023 - 126))
    if risky.size:
        p, cs, sr = prod[risky], np.broadcast_to(np.asarray(c, dtype=np.float64), s.shape)[risky], s[risky]
        back = sr - p
        err = (p - (sr - back)) + (cs - back)
        inexact = err != 0
        toward_zero = inexact & (np.signbit(err) != np.signbit(sr))
        bits[risky] = (sr.view(np.int64) - toward_zero) | inexact
    out[...] = s


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(full blocks as rows, the partial last block) of a flat chunk starting on a block boundary."""
    full = x.numel() // FP8_BLOCK * FP8_BLOCK
    rows = x[:full].view(-1, FP8_BLOCK) if full else None
    return rows, (x[full:].view(1, -1) if full < x.numel() else None)


def _dequant(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, index: torch.Tensor | None = None,
             floor: bool = False) -> None:
    """fp32 `out` = fp8 `q` x its block's scale (with `floor`: at least the block's least positive step)."""
    index = index if index is not None else torch.empty(q.numel(), dtype=torch.int32)
    index.copy_(q.view(torch.uint8))
    torch.index_select(_FP8_VALUES, 0, index, out=out)
    for k, part in enumerate(_blocks(out)):
        if part is None:
            continue
        s = scale[: part.shape[0], None] if k == 0 else scale[-1:, None]
        part.mul_(s)
        if floor:
            torch.maximum(part, s * FP8_TINY, out=part)


def _quant(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, work: torch.Tensor | None = None) -> None:
    """Round fp32 `x` (overwritten) into fp8 `q` and the per-block `scale` = block amax / 448; each block is
    x times its quantiser (`_quantiser`) clamped to +-448, then rounded to fp16 at a scale of 1 / 256 and that to
    float8_e4m3fn (two roundings: host_kernel.c FP8_CODES); `work`: a scratch of x's size for |x| (allocated if
    not given)."""
    work = (work if work is not None else torch.empty_like(x))[: x.numel()]
    for k, (part, mag) in enumerate(zip(_blocks(x), _blocks(work))):
        if part is None:
            continue
        s = scale[: part.shape[0]] if k == 0 else scale[-1:]
        torch.amax(torch.abs(part, out=mag), dim=1, out=s)  # NOTE: far faster than vector_norm(inf, dim=1)
        r = _quantiser(s)
        s.div_(FP8_MAX)
        part.mul_(r[:, None]).clamp_(-FP8_MAX, FP8_MAX)
    half = torch.empty(x.numel(), dtype=torch.float16)  # rounded to fp16 first (host_kernel.c FP8_CODES)
    half.copy_(x.mul_(2.0**-8))
    q.copy_(x.copy_(half).mul_(256))  # NOTE: fp16 -> fp8 directly converts slower than through fp32


def _quantiser(amax: torch.Tensor) -> torch.Tensor:
    """What a block's values are multiplied by before rounding to fp8: 448 / amax, at most FLT_MAX (an all-zero
    block's zeros stay zeros). A block holding an inf or a NaN keeps the division it had: by its scale
    amax / 448 where that is > 0, else by 1 (times 1 / that: the same values). host_kernel.c block_quantiser.
    One multiply where x / scale divided; x r differs from x / scale by at most an ulp before the rounding."""
    scale = amax / FP8_MAX
    r = torch.div(FP8_MAX, amax).clamp_(max=torch.finfo(torch.float32).max)
    return torch.where(torch.isfinite(amax), r, 1 / torch.where(scale > 0, scale, 1.0))
