"""Cross-entropy over the LM head computed in sequence chunks, in forward and in backward.

Where it sits: the head unit (transformer.py) calls `chunked_cross_entropy`; the full (tokens, vocab) logits
tensor never exists. Forward keeps only its inputs; backward recomputes each chunk's logits, so the peak is
one chunk of logits (chunk x vocab, fp32) at any time, unlike the reference MegaTrain whose 128-token chunks
all stay alive until a single backward. With `norm`, the head's final norm runs inside the chunks too (long
sequences: transformer.py's tiled mode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from .tiled import region

IGNORE_INDEX = -100


def _wide(x: Tensor) -> Tensor:
    """Low-precision logits are upcast to fp32; fp32 and fp64 stay as they are."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def _normed(norm: nn.Module | None, norm_weight: Tensor | None, x: Tensor) -> Tensor:
    return x if norm is None else functional_call(norm, {"weight": norm_weight}, (x,), strict=True)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor, chunk: int, norm: nn.Module | None,
                norm_weight: Tensor | None) -> Tensor:
        total = torch.zeros((), dtype=_wide(h[:0]).dtype, device=h.device)
        hd = h if norm is None else h.detach()  # NOTE: a view of h here still requires grad, which trips module hooks
        for s in range(0, h.shape[0], chunk):
            with region("loss"):
                logits = _wide(_normed(norm, norm_weight, hd[s : s + chunk]) @ weight.t())
                total = total + F.cross_entropy(logits, targets[s : s + chunk], reduction="sum",
                                                ignore_index=IGNORE_INDEX)
        ctx.save_for_backward(h, weight, targets, *(() if norm is None else (norm_weight,)))
        ctx.chunk, ctx.norm = chunk, norm
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):
        h, weight, targets, *nw = ctx.saved_tensors
        dh = torch.empty_like(h)
        dw = torch.zeros(weight.shape, dtype=_wide(weight).dtype, device=weight.device)
        dnw = None
        for s in range(0, h.shape[0], ctx.chunk):
            xc, tc = h[s : s + ctx.chunk], targets[s : s + ctx.chunk]
            if ctx.norm is not None:  # recompute this chunk's final norm, with autograd for its backward
                xc = xc.detach().requires_grad_()
                w = nw[0].detach().requires_grad_()
                with torch.enable_grad():
                    hc = _normed(ctx.norm, w, xc)
            else:
                hc = xc
            dlogits = torch.softmax(_wide(hc.detach() @ weight.t()), dim=-1)
            valid = tc != IGNORE_INDEX
            rows = torch.arange(tc.shape[0], device=tc.device)
            dlogits[rows, tc.clamp(min=0)] -= 1.0
            dlogits *= (valid.unsqueeze(1) * grad).to(dlogits.dtype)
            dhc = dlogits.to(h.dtype) @ weight
            # NOTE: accumulate dW in fp32 in place: no (vocab, d) temporary per chunk.
            dw.addmm_(dlogits.t(), hc.detach().to(dw.dtype))
            if ctx.norm is not None:
                dhc, dwc = torch.autograd.grad(hc, (xc, w), dhc)
                dnw = _wide(dwc) if dnw is None else dnw.add_(dwc)
                del dwc  # NOTE: nothing of one chunk may live into the next (ir/scaled.py counts on it)
            dh[s : s + ctx.chunk] = dhc
            del dlogits, dhc, hc
        return dh, dw.to(weight.dtype), None, None, None, None if dnw is None else dnw.to(nw[0].dtype)


def chunked_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, chunk: int, norm: nn.Module | None = None) -> Tensor:
    """Sum over tokens of cross-entropy(norm(h) @ weight.T, targets), chunk rows at a time, in fp32 (fp64 for
    fp64). `norm` (a module with one `weight`, the head's RMSNorm): applied chunk by chunk, so neither the
    normed (N, d) tensor nor the norm's fp32 temporaries of all rows exist; its backward recomputes it.

    h: (N, d); weight: (V, d); targets: (N,) int64 with -100 for ignored positions.
    """
    if chunk <= 0:
        raise ValueError(f"loss chunk must be a positive number of tokens, got {chunk}")
    return _ChunkedCrossEntropy.apply(h, weight, targets, chunk, norm, None if norm is None else norm.weight)
