"""The layers of a LLaMA-style decoder and the kernels they choose (docs/DESIGN.md 4.1).

Where it sits: units.py builds the streaming units from these; what a unit reads besides its carry is a
`StepInputs`. Architecture: RMSNorm (fp32 statistics, one rounding), RoPE (rotate-half, as Hugging Face
LLaMA), grouped-query attention through F.scaled_dot_product_attention with a causal mask (K and V not
repeated where the kernel broadcasts them), SwiGLU MLP.

Long sequences (`StepInputs.chunk_tokens`, chosen by the planner's `chunks` pass): attention runs its norm,
projections and RoPE, and the MLP its norm and matmuls, over token chunks (tiled.py; recomputed chunk by
chunk in backward), the attention itself as one fused flash call with grouped k and v unrepeated. Chunk sizes
of at least the sequence length run exactly the untiled code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .replay import attention_scope
from .tiled import tiled
from .unevaluated import unevaluated

Carry = tuple[Tensor, ...]


@dataclass(frozen=True)
class StepInputs:
    """What a unit reads besides its carry: the micro-batch and the resident constants."""

    tokens: Tensor | None = None  # (B, T) int64
    targets: Tensor | None = None  # (B, T) int64, IGNORE_INDEX where no loss
    cos: Tensor | None = None  # (T, head_dim), compute dtype
    sin: Tensor | None = None
    loss_chunk: int = 1024  # tokens per cross-entropy chunk
    target: str = "cuda"  # which fused attention kernel a meta trace stands for: "cuda" or "cpu"
    # Packed micro-batches (several documents per row; `packing(positions)` builds these three):
    positions: Tensor | None = None  # (B, T) int64: each token's position in its document (RoPE)
    segments: tuple[tuple[tuple[int, int], ...], ...] | None = None  # per row, its documents' [start, end)
    cu_seqlens: Tensor | None = None  # (n_docs + 1,) int32 document offsets over the flattened B*T tokens
    # Sequence tiling (tiled.py): a block's token-wise work runs over chunks of this many tokens and the head's
    # final norm inside its loss chunks; None (or at least the sequence length): the whole sequence at once.
    chunk_tokens: int | None = None

    def tiles(self, seq_len: int) -> int | None:
        """The chunk size when this sequence is tiled, else None."""
        c = self.chunk_tokens
        return c if c is not None and c < seq_len else None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)


_FUSED_RMS_NORM = hasattr(torch.ops.aten, "_fused_rms_norm") and hasattr(torch.ops.aten, "_fused_rms_norm_backward")


class _RMSNorm(torch.autograd.Function):
    """x / rms(x) * weight over the last dimension: fp32 statistics, the weight applied in fp32 and one rounding
    into x's dtype, as torch's fused rms_norm computes it (Hugging Face's LlamaRMSNorm rounds x / rms(x) to x's
    dtype before the weight: equal in fp32, at most one bf16 step apart). It saves x and the fp32 1/rms of each
    row, not an fp32 copy of x; on CUDA it is one fused kernel each way (aten._fused_rms_norm), elsewhere a
    few elementwise ones."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if x.is_cuda and _FUSED_RMS_NORM:
            y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        else:
            xf = _stats_dtype(x)
            rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            y = (xf * rstd * weight.to(xf.dtype)).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, rstd = ctx.saved_tensors
        if x.is_cuda and _FUSED_RMS_NORM:
            dx, dw = torch.ops.aten._fused_rms_norm_backward(dy.contiguous(), x, [x.shape[-1]], rstd, weight,
                                                              [ctx.needs_input_grad[0], ctx.needs_input_grad[1]])
            return dx, dw, None
        n = _stats_dtype(x) * rstd
        g = dy.to(n.dtype) * weight.to(n.dtype)
        dx = (rstd * (g - n * (g * n).mean(-1, keepdim=True))).to(x.dtype)
        dw = (dy.to(n.dtype) * n).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
        return dx, dw, None


def _stats_dtype(x: Tensor) -> Tensor:
    """x in the dtype RMSNorm's statistics are taken in: fp32 for bf16/fp16, its own otherwise (fp64 stays)."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def rope_frequencies(config: ModelConfig, device=None) -> Tensor:
    """The (head_dim / 2,) inverse frequencies of RoPE in fp32, with Llama 3.1's scaling when configured
    (as Hugging Face's `_compute_llama3_parameters` computes them)."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))
    r = config.rope_scaling
    if r is None:
        return inv_freq
    low_wavelen, high_wavelen = r.original_max_position / r.low_freq_factor, r.original_max_position / r.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq)
    smooth = (r.original_max_position / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(config: ModelConfig, seq_len: int, dtype: torch.dtype, device=None) -> tuple[Tensor, Tensor]:
    """cos and sin, (seq_len, head_dim), computed in fp32 then cast: resident constants of a step."""
    inv_freq = rope_frequencies(config, device)
    pos = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (x2, x1) over the two halves of the last dimension: one copy (the sign is in the sine)."""
    return x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, H, T, hd). x * cos + rotate_half(x) * sin, Hugging Face's rotate-half RoPE, with the half-swap
    one copy and the sign folded into the (small) sine table: x * cos + swap(x) * [-sin1, sin2], three
    kernels on x where chunk, neg, cat, two products and a sum took six."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return torch.addcmul(x * cos, _rotate_half(x), signed)


def packing(positions: Tensor, device=None) -> dict:
    """StepInputs fields of a packed micro-batch from its (B, T) positions (host int64: 0 where a document
    starts, then 1, 2, ...): `positions` on `device`, each row's document `segments` and the flattened
    `cu_seqlens` (int32, on `device`), so no kernel ever needs to synchronize to find the documents."""
    if positions.dim() != 2 or positions.shape[1] == 0:
        raise ValueError(f"positions must be (batch, seq_len), got shape {tuple(positions.shape)}")
    rows, offsets = [], [0]
    for b, row in enumerate(positions.tolist()):
        starts = [t for t, p in enumerate(row) if p == 0]
        if starts[:1] != [0] or any(row[t] != row[t - 1] + 1 for t in range(1, len(row)) if row[t] != 0):
            raise ValueError(f"row {b} of positions must start at 0 and count up by one within each document")
        bounds = [*starts, len(row)]
        rows.append(tuple(zip(bounds, bounds[1:])))
        offsets += [b * len(row) + e for _, e in rows[-1]]
    cu = torch.tensor(offsets, dtype=torch.int32)
    dev = device if device is not None else positions.device
    return {"positions": positions.to(dev, non_blocking=True), "segments": tuple(rows),
            "cu_seqlens": cu.to(dev, non_blocking=True)}


def packed_attention(q: Tensor, k: Tensor, v: Tensor, inputs: StepInputs) -> Tensor:
    """Causal attention within each document of a packed micro-batch: no token attends across a document
    boundary. q: (B, H, T, hd), k and v (B, H_kv, T, hd) with H a multiple of H_kv. On CUDA in bf16/fp16, one varlen flash-attention
    call covers every document; elsewhere each document runs through the same fused causal kernel as an
    unpacked sequence (one call per document). No (T, T) mask ever exists, and a document's attention equals
    what it would be alone."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and inputs.cu_seqlens is not None:
        # one varlen flash call for every document of the micro-batch (causal: window (-1, 0))
        from torch.nn.attention.varlen import varlen_attn

        B, H, T, hd = q.shape
        if k.shape[1] != H:  # NOTE: the varlen call takes the query's heads: repeat K and V for it
            k, v = k.repeat_interleave(H // k.shape[1], dim=1), v.repeat_interleave(H // v.shape[1], dim=1)
        longest = max(e - s for spans in inputs.segments for s, e in spans)
        flat = [t.transpose(1, 2).reshape(B * T, H, hd) for t in (q, k, v)]
        y = varlen_attn(*flat, inputs.cu_seqlens, inputs.cu_seqlens, longest, longest, window_size=(-1, 0))
        return y.view(B, T, H, hd).transpose(1, 2)
    rows = [torch.cat([causal_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e], inputs.target)
                       for s, e in spans], dim=2) for b, spans in enumerate(inputs.segments)]
    return torch.cat(rows, dim=0)


def native_gqa(q: Tensor, target: str = "cuda") -> bool:
    """Whether the fused attention kernel that runs `q` reads fewer key/value heads than query heads itself
    (SDPA's enable_gqa, no copies): the CPU's flash kernel, and CUDA's flash kernel in bf16/fp16. CUDA in fp32
    runs the memory-efficient kernel, which does not, so K and V are repeated to the query's heads there."""
    kind = target if q.device.type == "meta" else q.device.type
    return kind == "cpu" or q.dtype in (torch.bfloat16, torch.float16)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, target: str = "cuda") -> Tensor:
    """Causal SDPA; k and v may have fewer heads than q (grouped-query attention). On the meta device
    (tracing) it is the fused kernel that SDPA dispatches to on the target (the CPU's flash; CUDA's flash in
    bf16/fp16, its memory-efficient kernel in fp32), so the trace records what that kernel saves for backward
    and never materialises the (T, T) scores, where SDPA's math fallback on meta would."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1 and not native_gqa(q, target):
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        rep = 1
    with attention_scope():  # a unit's attention record or replay (models/replay.py), if one is current
        if q.device.type == "meta":
            if target == "cpu":
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]
            if q.dtype == torch.float32:  # CUDA runs fp32 through memory-efficient attention, not flash
                return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[0]
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=rep > 1)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = c.n_heads, c.kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.d_model, c.n_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.d_model, c.kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.d_model, c.kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.norm_eps)
        self.qk_norm = c.qk_norm

    def forward(self, x: Tensor, inputs: StepInputs) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.project(x, inputs.cos, inputs.sin, inputs.positions)
        y = self.attend(q, k, v, inputs)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))

    def project(self, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor | None,
                values_unread: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, n_heads, T, hd), k and v (B, n_kv, T, hd) of the normed input x, RoPE applied: the token-wise
        half of attention. cos and sin are the rows of x's tokens, or the whole tables with `positions`.
        `values_unread`: only gradients flow back through the results (a tile's recompute): RoPE and the views
        need no values in backward, so the projections are left unevaluated, q's and k's only without qk-norm
        (whose backward reads its input)."""
        B, T, _ = x.shape
        with unevaluated(values_unread and not self.qk_norm):
            q = self.q_proj(x).view(B, T, self.n_heads, self.hd)
            k = self.k_proj(x).view(B, T, self.n_kv, self.hd)
        with unevaluated(values_unread):
            v = self.v_proj(x).view(B, T, self.n_kv, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if positions is not None:  # packed: each document's positions restart at 0
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, inputs: StepInputs) -> Tensor:
        """The fused causal attention (per document when packed) of grouped k and v as they are: the kernels
        broadcast them where they can and repeat them where they cannot (causal_attention, packed_attention)."""
        if inputs.segments is None:
            return causal_attention(q, k, v, inputs.target)
        return packed_attention(q, k, v, inputs)

    def tiled_forward(self, h: Tensor, norm: nn.Module, inputs: StepInputs, chunk: int) -> Tensor:
        """norm -> attention -> o_proj of the block input h with the token-wise parts tiled: the norm, q/k/v
        and RoPE, then the output projection, `chunk` tokens at a time; the attention between them is one fused
        call over the whole sequence, so no (T, T) tensor and no ffn-wide or fp32 (T, d) temporary exists."""
        def qkv(m, x, s, e, unread=False):
            if inputs.positions is not None:
                return self.project(m["norm"](x), inputs.cos, inputs.sin, inputs.positions[:, s:e], unread)
            return self.project(m["norm"](x), inputs.cos[s:e], inputs.sin[s:e], None, unread)

        def out(m, y, s, e, unread=False):
            B, _, n, _ = y.shape
            with unevaluated(unread):
                return (m["o_proj"](y.transpose(1, 2).reshape(B, n, self.n_heads * self.hd)),)

        mods = {"norm": norm, **{n: getattr(self, n) for n in ("q_proj", "k_proj", "v_proj")}}
        if self.qk_norm:
            mods.update(q_norm=self.q_norm, k_norm=self.k_norm)
        # a tile's recompute in backward reads no value of its outputs: the projections go unevaluated
        q, k, v = tiled(qkv, mods, h, chunk, in_dim=1, out_dims=(2, 2, 2), recompute_fn=_unread(qkv))
        y = self.attend(q, k, v, inputs)
        return tiled(out, {"o_proj": self.o_proj}, y, chunk, in_dim=2, out_dims=(1,), recompute_fn=_unread(out))[0]


def _unread(piece):
    """A tiled piece as its backward recomputes it: with `unread=True` (no value of its outputs is read)."""
    return lambda m, x, s, e: piece(m, x, s, e, unread=True)


def _mlp_piece(m, x, s, e, unread=False):
    return (m["mlp"](m["norm"](x), value_unused=unread),)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.d_model, c.ffn_dim, bias=False)
        self.up_proj = nn.Linear(c.d_model, c.ffn_dim, bias=False)
        self.down_proj = nn.Linear(c.ffn_dim, c.d_model, bias=False)

    def forward(self, x: Tensor, value_unused: bool = False) -> Tensor:
        """`value_unused`: the caller reads no value of the result, only back-propagates through it (a
        recompute): the down projection is recorded for autograd but not computed (unevaluated.py)."""
        h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        with unevaluated(value_unused):
            return self.down_proj(h)

    def tiled_forward(self, h: Tensor, norm: nn.Module, chunk: int, recompute: bool = False) -> Tensor:
        """norm -> MLP of the block input h, `chunk` tokens at a time, each tile recomputed in backward.
        `recompute`: the caller reads no value of the result (a block's recompute), and the tiles are
        recomputed in backward anyway: nothing is computed here then."""
        return tiled(_mlp_piece, {"norm": norm, "mlp": self}, h, chunk, recompute_fn=_unread(_mlp_piece),
                     unevaluated=recompute)[0]
