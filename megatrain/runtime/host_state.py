"""The host optimizer step under each host policy (planner/host_policy.py), in one implementation.

Where it sits: the host store (store.py) calls `adamw_step` on views of its flat buffers; the eager reference
(reference.py `PolicyAdamW`) calls it on a model's parameters. Both sides run the same function on the same
values, so streamed training under a policy equals eager training under it bit for bit
(tests/runtime/test_host_policy.py); `exact` is also bit-identical to torch.optim.AdamW(fused=True) after
torch.nn.utils.clip_grad_norm_ (tests/runtime/test_exactness.py).

How a step moves each byte once (HostPolicy.traffic): where host_kernel.available() (a C compiler, torch
vectorised for AVX2 / AVX-512, and host_kernel.self_check passed on this machine), each parameter's update is one
loop in C (host_kernel.c) that reads each stored byte once, expands it, performs the fused kernel's fp32
operations and rounds back, the clip factor applied as clip_grad_norm_ does. Otherwise the same update runs as
torch ops, per policy (host_adamw.py says how each rounds).

The NaN/inf verdict is not taken here: the store reads it from the gradient norms the device computed (a
non-finite norm is a non-finite or overflowing gradient) and skips the whole update; `update_bound` lets it
refuse, before any weight changes, an update that could overflow fp32 (an absurd learning rate), with no pass
over the weights (verdict.py `overflow`).
"""

from __future__ import annotations

import math

import torch

from megatrain.planner.host_policy import HostPolicy, resolve
from megatrain.planner.train import TrainSpec

from . import cast_kernel, cpus, host_adamw, host_kernel, host_memory
from .host_adamw import OMP_SETTLE_S, Moments, grad_dtype, new_moments


def adamw_step(policy: HostPolicy | str, params: list[torch.Tensor], grads: list[torch.Tensor],
               moments: list[Moments], steps: list[torch.Tensor], cfg: TrainSpec, lr: float,
               decay: list[bool] | None = None, clip: torch.Tensor | None = None,
               copies: list[torch.Tensor] | None = None) -> None:
    """One AdamW update in place of fp32 `params` from `grads` (the policy's gradient dtype) and `moments`,
    with the clip factor `clip` (clip_grad_norm_'s clamped coefficient; None: no clipping). `decay[i]`: whether
    parameter i takes the weight decay (default: all do); `steps` are AdamW's fp32 step counts. `copies`: bf16
    tensors the updated weights are cast into (the "copy" placement of the compute-dtype cast, planner/cast.py),
    in the kernel's pass where it runs, else by a cast after the update: the same bits."""
    _step(policy, params, grads, moments, steps, cfg, lr, decay, clip, host_kernel.available(), copies)


def _step(policy, params, grads, moments, steps, cfg, lr, decay, clip, one_pass: bool, copies=None) -> None:
    """adamw_step through host_kernel.c (`one_pass`) or through torch ops: the same bits either way."""
    policy = resolve(policy)
    if one_pass:  # NOTE: also exact unclipped, where torch's fused kernel alone is slower
        host_kernel.adamw(params, grads, moments, steps, cfg, lr, decay, clip, copies)
        return
    host_adamw.adamw(policy, params, grads, moments, steps, cfg, lr, decay, clip)
    for p, c in zip(params, copies or ()):
        cast_kernel.cast(p.view(-1), c.view(-1))


def update_bound(cfg: TrainSpec, step: int, exact: bool = True) -> float:
    """An upper bound on |m_hat / (sqrt(v_hat) + eps)| at AdamW step `step` (1-based) for any gradients, so
    every weight obeys |w_new| <= |w| |1 - lr wd| + lr * bound. By Cauchy-Schwarz, |m_t| <= (1 - b1) /
    sqrt(1 - b2) * sqrt(v_t) * sqrt(sum_{k<t} (b1^2 / b2)^k), and the bias corrections scale it by
    sqrt(1 - b2^t) / (1 - b1^t) (at t = 1 it is exactly 1: the update is sign(g)). Times 2 for the fused
    kernel's rounding, and 8 for rounded (bf16, fp8) moments, whose quotient rounding can push past it."""
    b1, b2 = cfg.betas
    r = b1 * b1 / b2 if b2 > 0 else math.inf
    if r == math.inf:
        return math.inf
    geo = step if r == 1 else (1 - r**step) / (1 - r)
    core = (1 - b1) / math.sqrt(1 - b2) * math.sqrt(geo) * math.sqrt(1 - b2**step) / (1 - b1**step)
    return core * (2.0 if exact else 8.0)


def block_unit(policy: HostPolicy | str, numel: int) -> tuple[list, list, list, list]:
    """(params, grads, moments, steps) of a block-like unit of `numel` parameters (two matrices and a norm
    vector), its buffers on huge pages as the host store's are: what `step_rate` and
    benchmarks/bench_host_optimizer.py step."""
    policy = resolve(policy)
    big = max(1, (numel - 4096) // 2)
    shapes = [(big,), (big,), (4096,)]
    params = [host_memory.empty(s, torch.float32).copy_(torch.randn(s) * 0.02) for s in shapes]
    grads = [host_memory.empty(s, grad_dtype(policy)).copy_(torch.randn(s) * 1e-3) for s in shapes]
    return params, grads, [new_moments(policy, s) for s in shapes], [torch.zeros(()) for _ in shapes]


def step_rate(policy: HostPolicy | str, numel: int, repeats: int = 5, clip: bool = False) -> float:
    """Parameters per second of one policy's step on a `block_unit` of `numel` parameters (decayed and not),
    unclipped or with a clip factor < 1 (the path a clipped step takes), the best of `repeats` (`megatrain
    probe`). Each timed step finds the cache as training leaves it: its own state cold (a read-only sweep of
    twice the last-level cache evicts it) and a unit of the same size and policy stepped just before, whose
    written lines are dirty in the cache and cost the timed step their write-back, as the previous unit's do in
    a run."""
    import time

    cfg = TrainSpec(micro_batch=1, seq_len=1)
    clip_factor = torch.tensor(0.5) if clip else None

    def step(unit) -> None:
        adamw_step(policy, *unit, cfg, 1e-4, [True, True, False], clip_factor)

    timed, before = block_unit(policy, numel), block_unit(policy, numel)
    # NOTE: the sweep only reads. A sweep that wrote (x += 1, as before) left the cache full of its own dirty
    # lines, whose write-back the timed step paid on top of its traffic: the probed rates came out slower than
    # steps interleaved with other units (docs/RESULTS.md, "Host optimizer throughput").
    flush = torch.ones(max(32 * 2**20, 2 * (cpus.largest_cache_bytes() or 0) // 4))
    best = float("inf")
    for _ in range(repeats + 1):  # the first round warms up
        flush.sum()
        step(before)
        time.sleep(OMP_SETTLE_S)  # a run's steps follow steps, not a torch op's spinning threads
        t = time.perf_counter()
        step(timed)
        best = min(best, time.perf_counter() - t)
    return sum(p.numel() for p in timed[0]) / best
