"""Sequence-tiled pieces of a unit: token-wise work run over chunks of the sequence, in forward and backward.

Where it sits: layers.py runs the token-wise parts of a block through `tiled` when
`StepInputs.chunk_tokens` is shorter than the sequence: the input norm with the q/k/v projections and RoPE,
the output projection, and the post-attention norm with the MLP (the attention core between them is one
fused flash call over the whole sequence). The planner's `chunks` pass picks the chunk size
(planner/chunking.py); ir/trace.py measures a tiled unit. Try it: `pytest tests/models/test_tiled.py -q`.

How (ALST's TiledMLP, generalised to several outputs and to explicit parameters): forward runs the piece
chunk by chunk without autograd, writes each chunk's outputs into full-length outputs and keeps only its
input; backward recomputes each chunk with autograd, back-propagates that chunk's slice of the output
gradients, writes the chunk's input gradient and adds its parameter gradients into accumulators (fp32 for
low-precision parameters, like the chunked loss's dW). So a chunk's intermediates (the MLP's ffn-wide
activations, the norms' fp32 temporaries) exist only while that chunk runs.

Parameters are explicit inputs of the autograd Function (so torch.autograd.grad with respect to a unit's
bound parameters reaches them, as the runtime needs): the pieces' modules are re-bound to them with
functional_call in both passes, which works for a template bound to a slot and for the eager model alike.

Exactness: a chunk's rows are computed by the same kernels on fewer rows, and parameter gradients are sums
over chunks, so a tiled piece equals the untiled one to fp32 round-off (forward values are usually bit-equal
on CPU; the weight-gradient sums associate differently). The same tiling on the same shapes is bit-exact run
to run, so streamed and eager training with the same chunk size agree bit for bit.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.func import functional_call

from .unevaluated import uninitialised

_REGION = threading.local()


@contextmanager
def region(name: str | None):
    """Mark the ops dispatched inside as one iteration of a loop named `name` ("tile", "loss"; None: not
    part of one): the tracer counts ops per iteration, so that a trace at a short sequence can extrapolate a
    long one's op count (ir/scaled.py)."""
    outer = getattr(_REGION, "name", None)
    _REGION.name = name
    if name is not None:
        iterations()[name] += 1
    try:
        yield
    finally:
        _REGION.name = outer


def current_region() -> str | None:
    return getattr(_REGION, "name", None)


def iterations() -> Counter:
    """Iterations of each named loop run on this thread so far."""
    if not hasattr(_REGION, "iterations"):
        _REGION.iterations = Counter()
    return _REGION.iterations


class _Piece(nn.Module):
    """The modules one tiled piece uses, under names local to the piece; `fn(mods, x, start, end)`."""

    def __init__(self, fn: Callable, modules: dict[str, nn.Module]):
        super().__init__()
        self.fn = fn
        self.mods = nn.ModuleDict(modules)

    def forward(self, x: Tensor, start: int, end: int):
        return self.fn(self.mods, x, start, end)


def _with(shape, dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


def _wide(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, piece: _Piece, again: _Piece, skip: bool, names: tuple[str, ...], chunk: int, in_dim: int,
                out_dims: tuple[int, ...], x: Tensor, *params: Tensor):
        bound = dict(zip(names, params))
        xd = x.detach()  # NOTE: a view of x made here would still require grad (and trip module hooks)
        T = x.shape[in_dim]
        outs: list[Tensor] | None = None
        if skip:  # nothing computed: the outputs' shapes from an empty chunk, their values left uninitialised
            ys = functional_call(piece, bound, (xd.narrow(in_dim, 0, 0), 0, 0), strict=True)
            outs = [uninitialised(y, _with(y.shape, d, T)) for y, d in zip(ys, out_dims)]
            del ys
        for s in range(0, 0 if skip else T, chunk):
            n = min(chunk, T - s)
            with region("tile"):
                ys = functional_call(piece, bound, (xd.narrow(in_dim, s, n), s, s + n), strict=True)
                if outs is None:  # full-length outputs, written chunk by chunk (no list of chunks to concatenate)
                    with region(None):
                        outs = [torch.empty(_with(y.shape, d, T), dtype=y.dtype, device=y.device)
                                for y, d in zip(ys, out_dims)]
                for o, y, d in zip(outs, ys, out_dims):
                    o.narrow(d, s, n).copy_(y)
                del ys
        ctx.piece, ctx.names, ctx.chunk, ctx.in_dim, ctx.out_dims = again, names, chunk, in_dim, out_dims
        ctx.save_for_backward(x, *params)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        x, *params = ctx.saved_tensors
        need_x, need_p = ctx.needs_input_grad[7], ctx.needs_input_grad[8:]
        d, T = ctx.in_dim, x.shape[ctx.in_dim]
        dx = torch.empty_like(x) if need_x else None
        acc: list[Tensor | None] = [None] * len(params)
        for s in range(0, T, ctx.chunk):
            n = min(ctx.chunk, T - s)
            xc = x.narrow(d, s, n).detach().requires_grad_(need_x)
            pc = [p.detach().requires_grad_(w) for p, w in zip(params, need_p)]
            with torch.enable_grad():
                ys = functional_call(ctx.piece, dict(zip(ctx.names, pc)), (xc, s, s + n), strict=True)
            pairs = [(y, g.narrow(od, s, n)) for y, g, od in zip(ys, grads, ctx.out_dims)
                     if g is not None and y.requires_grad]
            wrt = ([xc] if need_x else []) + [p for p, w in zip(pc, need_p) if w]
            got = list(torch.autograd.grad([y for y, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True))
            del ys, pairs
            if need_x:
                dxc = got.pop(0)
                if dxc is None:
                    dx.narrow(d, s, n).zero_()
                else:
                    dx.narrow(d, s, n).copy_(dxc)
                del dxc
            for i in (i for i, w in enumerate(need_p) if w):
                g = got.pop(0)
                if g is not None:
                    acc[i] = _wide(g) if acc[i] is None else acc[i].add_(g)
                del g
            # NOTE: nothing of one chunk may live into the next, so every chunk's peak is the same (ir/scaled.py)
            del got, xc, pc
        pgrads = [None if a is None else a.to(p.dtype) for a, p in zip(acc, params)]
        return (None, None, None, None, None, None, None, dx, *pgrads)


def tiled(fn: Callable, modules: dict[str, nn.Module], x: Tensor, chunk: int, in_dim: int = 1,
          out_dims: tuple[int, ...] = (1,), recompute_fn: Callable | None = None,
          unevaluated: bool = False) -> tuple[Tensor, ...]:
    """`fn(mods, x_chunk, start, end)` over chunks of `chunk` tokens of `x` along `in_dim`, returning tuples of
    outputs whose token dimension is `out_dims[i]`; the outputs of the whole sequence, with autograd through
    the tiling (a chunk is recomputed in backward). `modules` are the modules `fn` uses (as `mods[key]`), with
    the parameters they are bound to now.

    `recompute_fn`: the piece as backward recomputes a chunk, where no value of its outputs is read, only
    their gradients (so it may leave a final matmul unevaluated, models/unevaluated.py); default `fn`; it must
    record the same autograd graph. `unevaluated`: the caller reads no value of the outputs either (a block's
    recompute, whose backward recomputes each chunk anyway): the forward computes nothing and returns
    uninitialised outputs of the right shapes, which backward differentiates as if they had been computed."""
    if chunk <= 0:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    piece = _Piece(fn, modules)
    again = piece if recompute_fn is None else _Piece(recompute_fn, modules)
    names, params = zip(*piece.named_parameters()) if any(True for _ in piece.parameters()) else ((), ())
    return _Tiled.apply(piece, again, unevaluated, tuple(names), chunk, in_dim, tuple(out_dims), x, *params)
