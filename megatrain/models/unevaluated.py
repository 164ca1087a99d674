"""Matrix products whose values nobody reads: recorded for autograd, never computed.

Where it sits: a block's backward recomputes its forward from the checkpoint only for what autograd saves
(runtime/engine.py). The last matmul of a residual block, the MLP's down projection, saves its input and
its weight; its output only feeds the residual add, whose backward needs no values, and the block's output,
which the recompute throws away (the next unit has its own checkpoint). So that recompute runs the down
projection inside `unevaluated()`: autograd records the very node it records in the forward (MmBackward
with the same saved tensors, so the backward runs the same kernels on the same values and the gradients are
the same bits), while the product itself is an uninitialised tensor of its shape. That saves
d_model x ffn_dim x 2 FLOPs per token of every recomputed dense block, about a fifth of a Llama block's
forward, which per-layer activation checkpointing (Hugging Face's, torch.utils.checkpoint) spends again.
Tiled blocks (tiled.py) recompute each tile in backward with its projections unevaluated, and a tiled
residual block's recompute runs no MLP tile at all (layers.py).

The mode intercepts only matrix products (`mm`, `addmm`, `bmm`) below autograd; views and every other op
run as usual. The output buffer is allocated through the dispatcher like the product's would be, so a mode
underneath that follows allocations (ir/scaled.py LiveBytes) counts the same bytes, and one that counts
FLOPs (ir/scaled.py FlopCount) counts none for it: the trace prices what the recompute runs.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class _Unevaluated(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.mm.default, aten.bmm.default):
            a, b = args[0], args[1]
            return _like(a, (*a.shape[:-1], b.shape[-1]))
        if func is aten.addmm.default:
            a, b = args[1], args[2]
            return _like(a, (a.shape[0], b.shape[1]))
        return func(*args, **kwargs)


def uninitialised(like: torch.Tensor, shape) -> torch.Tensor:
    """A tensor standing for a result nobody reads: `like`'s dtype and device, `shape`, no values."""
    return _like(like, tuple(shape))


def _like(a: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    # through the dispatcher (this mode is off inside its own handler), so modes below see the allocation
    return torch.empty(shape, dtype=a.dtype, device=a.device)


def unevaluated(on: bool = True):
    """A context inside which matrix products return uninitialised tensors of their result's shape, autograd
    recording them as usual (`on=False`: a context that changes nothing). Only for results whose values no op
    reads and whose backward needs none."""
    return _Unevaluated() if on else contextlib.nullcontext()
