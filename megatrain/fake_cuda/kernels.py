"""CPU equivalents of the GPU-only kernels megatrain calls, for the fake CUDA backend."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, **_):
    """torch.nn.attention.varlen.varlen_attn on the CPU: (total, heads, head_dim) rows of packed documents,
    each document attended alone through SDPA (causal for window (-1, 0)); the bounds are read on the host,
    which the real kernel does not need (it is recorded as a synchronisation of the fake device)."""
    if return_aux is not None:
        raise NotImplementedError("fake varlen_attn: return_aux is not supported")
    if window_size not in ((-1, -1), (-1, 0)):
        raise NotImplementedError(f"fake varlen_attn: window_size {window_size} is not supported")
    bounds = cu_seq_q.tolist()
    if cu_seq_k is not None and cu_seq_k.tolist() != bounds:
        raise NotImplementedError("fake varlen_attn: different query and key bounds are not supported")
    outs = []
    for s, e in zip(bounds, bounds[1:]):
        q, k, v = (t[s:e].transpose(0, 1)[None] for t in (query, key, value))
        outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=window_size == (-1, 0), scale=scale,
                                                   enable_gqa=enable_gqa)[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


def fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask):
    """aten._fused_rms_norm_backward (CUDA only): fp32 statistics, as the CUDA kernel accumulates."""
    dims = tuple(range(input.dim() - len(normalized_shape), input.dim()))
    n = input.float() * rstd
    g = grad_out.float() * (weight.float() if weight is not None else 1.0)
    dx = (rstd * (g - n * (g * n).mean(dims, keepdim=True))).to(input.dtype) if output_mask[0] else None
    dw = None
    if weight is not None and output_mask[1]:
        dw = (grad_out.float() * n).reshape(-1, *normalized_shape).sum(0).to(weight.dtype)
    return dx, dw


def mm_out_dtype(a, b, out_dtype, *, out=None):
    """mm(out_dtype=float32) of bf16/fp16 operands (a GPU's fp32-accumulating GEMM): the products of the same
    bf16 values, summed in fp32."""
    res = (a.float() @ b.float()).to(out_dtype)
    return res if out is None else out.copy_(res)


def addmm_out_dtype(input, a, b, out_dtype, *, beta=1, alpha=1, out=None):
    res = (beta * input.float() + alpha * (a.float() @ b.float())).to(out_dtype)
    return res if out is None else out.copy_(res)


def gpu_only_kernels() -> dict:
    """{torch op: its CPU equivalent} for the ops the mode must not hand to a CPU kernel that does not exist."""
    op = torch.ops.aten._fused_rms_norm_backward
    return {op: fused_rms_norm_backward, op.default: fused_rms_norm_backward}


def with_out_dtype() -> dict:
    """{torch function: its CPU equivalent} when called with out_dtype (GPU-only overloads)."""
    return {torch.mm: mm_out_dtype, torch.addmm: addmm_out_dtype}


# -- CUDA's fused attention kernels on the CPU ------------------------------------------------------------------
# SDPA on a GPU runs flash (bf16/fp16) or memory-efficient attention (fp32); their outputs, and so what
# autograd saves, differ from the CPU flash kernel's (RNG state, a log-sum-exp padded to 32 rows). The fake
# routes device SDPA to CUDA's own aten ops, given CPU kernels here, so a step saves what it saves on a GPU.
_LIB = None


def _cpu_flash(q, k, v, is_causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)


def _flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    out, lse = _cpu_flash(query, key, value, is_causal, scale)
    T = query.shape[2]
    return (out, lse, torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32), T, key.shape[2],
            torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64),
            torch.empty(0, dtype=query.dtype))


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                    is_causal, philox_seed, philox_offset, *, scale=None):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, is_causal, scale=scale)


def _efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    if attn_bias is not None:
        raise NotImplementedError("fake efficient attention: attn_bias is not supported")
    out, lse = _cpu_flash(query, key, value, is_causal, scale)
    T = query.shape[2]
    rows = -(-T // 32) * 32 if compute_log_sumexp else 0
    padded = torch.zeros((*lse.shape[:2], rows), dtype=torch.float32)
    padded[..., : min(T, rows)] = lse[..., : rows]
    return out, padded, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)


def _efficient_backward(grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
                        dropout_p, grad_input_mask, is_causal=False, *, scale=None):
    T = query.shape[2]
    gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out_, query, key, value, out, logsumexp[..., :T].contiguous(), 0.0, is_causal, scale=scale)
    return gq, gk, gv, torch.empty(0, dtype=query.dtype)


def register_attention() -> None:
    """CPU kernels for CUDA's flash and efficient attention ops (once per process)."""
    global _LIB
    if _LIB is not None:
        return
    import warnings

    _LIB = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": there is none on CPU
        for name, fn in (("_scaled_dot_product_flash_attention", _flash),
                         ("_scaled_dot_product_flash_attention_backward", _flash_backward),
                         ("_scaled_dot_product_efficient_attention", _efficient),
                         ("_scaled_dot_product_efficient_attention_backward", _efficient_backward)):
            _LIB.impl(name, fn, "CPU")


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention as a GPU dispatches it: flash for bf16/fp16 (grouped-query heads read
    natively), memory-efficient attention for fp32 (key and value repeated to the query's heads)."""
    if attn_mask is not None or dropout_p:
        raise NotImplementedError("fake SDPA: attn_mask and dropout are not supported")
    if query.dtype in (torch.bfloat16, torch.float16):
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, is_causal,
                                                                  scale=scale)[0]
    rep = query.shape[1] // key.shape[1]
    if rep > 1:
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, None, True, 0.0, is_causal,
                                                                  scale=scale)[0]
