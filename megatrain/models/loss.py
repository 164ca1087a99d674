"""Cross-entropy over the LM head computed in sequence chunks, in forward and in backward.

Where it sits: the head unit (units.py) calls `chunked_cross_entropy`; the full (tokens, vocab) logits
tensor never exists. Forward keeps only its inputs; backward recomputes each chunk's logits, so the peak is
one chunk of logits (chunk x vocab, fp32) at any time, unlike the reference MegaTrain whose 128-token chunks
all stay alive until a single backward. With `norm`, the head's final norm runs inside the chunks too (long
sequences: units.py's tiled mode).

The weight gradient is accumulated in fp32 across chunks. On a GPU in bf16/fp16 each chunk's product is a
tensor-core matmul of the low-precision logit gradient and hidden states with fp32 accumulation and output
(`addmm(..., out_dtype=float32)`, or where that torch refuses an fp32 accumulator, `mm(..., out_dtype)` a
vocabulary block at a time), not an fp32 matmul; elsewhere (the CPU, fp32) it is the fp32 `addmm`. Both are
written `torch.addmm/mm(..., out=)`, which FlopCounterMode counts (it counts no `addmm_`), so the trace prices
the head's three matmuls of backward.
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
                norm_weight: Tensor | None, target: str = "cuda") -> Tensor:
        total = torch.zeros((), dtype=_wide(h[:0]).dtype, device=h.device)
        hd = h if norm is None else h.detach()  # NOTE: a view of h here still requires grad, which trips module hooks
        for s in range(0, h.shape[0], chunk):
            with region("loss"):
                logits = _wide(_normed(norm, norm_weight, hd[s : s + chunk]) @ weight.t())
                total = total + F.cross_entropy(logits, targets[s : s + chunk], reduction="sum",
                                                ignore_index=IGNORE_INDEX)
        ctx.save_for_backward(h, weight, targets, *(() if norm is None else (norm_weight,)))
        ctx.chunk, ctx.norm = chunk, norm
        ctx.tensor_cores = low_precision_dw(h, target)
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
            low = dlogits.to(h.dtype)
            dhc = low @ weight
            hn = hc.detach()
            # NOTE: accumulate dW in fp32 in place: no (vocab, d) temporary per chunk.
            if ctx.tensor_cores:
                del dlogits  # the product reads the low-precision copy: free the fp32 one first
                _accumulate_low_precision(dw, low.t(), hn)
            else:
                torch.addmm(dw, dlogits.t(), hn.to(dw.dtype), out=dw)
                del dlogits
            del low, hn
            if ctx.norm is not None:
                dhc, dwc = torch.autograd.grad(hc, (xc, w), dhc)
                dnw = _wide(dwc) if dnw is None else dnw.add_(dwc)
                del dwc  # NOTE: nothing of one chunk may live into the next (ir/scaled.py counts on it)
            dh[s : s + ctx.chunk] = dhc
            del dhc, hc
        return dh, dw.to(weight.dtype), None, None, None, None if dnw is None else dnw.to(nw[0].dtype), None


def low_precision_dw(h: Tensor, target: str = "cuda") -> bool:
    """Whether the weight gradient runs as a bf16/fp16 matmul with fp32 output: on a GPU (or a meta trace for
    one) in a low-precision dtype. The CPU has no such kernel and keeps the fp32 product."""
    on_gpu = h.is_cuda or (h.device.type == "meta" and target == "cuda")
    return on_gpu and h.dtype in (torch.bfloat16, torch.float16)


_FP32_ACCUMULATOR: dict[str, bool] = {}  # by device type: whether addmm(out_dtype=float32) adds an fp32 input


def _accumulate_low_precision(dw: Tensor, a: Tensor, b: Tensor) -> None:
    """dw (fp32) += a @ b for bf16/fp16 a and b, accumulated and written in fp32. A recent torch adds in place
    (`addmm(out_dtype=float32, out=dw)`); one whose addmm.dtype wants the added input in the inputs' dtype
    (it says so in a dtype error, raised before any work) gets `mm(out_dtype=float32)` into a temporary no
    larger than `a` and an fp32 add, a vocabulary block at a time."""
    kind = dw.device.type
    if _FP32_ACCUMULATOR.get(kind, True):
        try:
            torch.addmm(dw, a, b, out_dtype=torch.float32, out=dw)
            _FP32_ACCUMULATOR[kind] = True
            return
        except RuntimeError as e:
            if kind in _FP32_ACCUMULATOR or "dtype" not in str(e):
                raise
            _FP32_ACCUMULATOR[kind] = False
    rows = max(1, a.numel() // (2 * b.shape[1]))  # fp32 (rows, d) temporary: at most a's bytes
    for v in range(0, a.shape[0], rows):
        dw[v : v + rows] += torch.mm(a[v : v + rows], b, out_dtype=torch.float32)


def chunked_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, chunk: int, norm: nn.Module | None = None,
                          target: str = "cuda") -> Tensor:
    """Sum over tokens of cross-entropy(norm(h) @ weight.T, targets), chunk rows at a time, in fp32 (fp64 for
    fp64). `norm` (a module with one `weight`, the head's RMSNorm): applied chunk by chunk, so neither the
    normed (N, d) tensor nor the norm's fp32 temporaries of all rows exist; its backward recomputes it.

    h: (N, d); weight: (V, d); targets: (N,) int64 with -100 for ignored positions; `target`: the device a
    meta trace stands for (the kernel of the weight gradient depends on it).
    """
    if chunk <= 0:
        raise ValueError(f"loss chunk must be a positive number of tokens, got {chunk}")
    return _ChunkedCrossEntropy.apply(h, weight, targets, chunk, norm, None if norm is None else norm.weight,
                                      target)
