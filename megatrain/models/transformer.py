"""A LLaMA-style decoder split into streaming units, and its eager twin (docs/DESIGN.md 4.1).

Where it sits: `templates(config)` gives the stateless unit templates (built on the meta device, one per
distinct structure) that tracing (ir/trace.py) and the runtime run through `bind()`; `build_eager(config)`
gives a plain nn.Module with the same math and parameter names: the ground truth of every exactness test.

Architecture: RMSNorm (fp32 statistics, one rounding), RoPE (rotate-half, as Hugging Face LLaMA), grouped-query
attention through F.scaled_dot_product_attention with a causal mask (K and V not repeated where the kernel
broadcasts them), SwiGLU MLP; the head is the final RMSNorm, the
LM head and a chunked cross-entropy (loss.py) returning the *sum* of token losses in fp32.

Long sequences (`StepInputs.chunk_tokens`, chosen by the planner's `chunks` pass): a block runs its norms,
projections, RoPE and MLP over token chunks (tiled.py; recomputed chunk by chunk in backward), its attention
as one fused flash call with grouped k and v unrepeated, and the head runs its final norm inside the loss's
chunks. Chunk sizes of at least the sequence length run exactly today's untiled code.

Units and their carries: `embed` () -> (h,); `blocks.{i}` (h,) -> (h,); `head` (h,) -> (loss_sum,).
h is (B, T, d) in the compute dtype. A unit's parameter named `p` is `"{unit}.{p}"` in the eager model.
"""

from __future__ import annotations

import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import depth
from .config import ModelConfig
from .loss import IGNORE_INDEX, chunked_cross_entropy
from .moe import MoEFFN, reset_buffers
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


class EmbedUnit(nn.Module):
    kind = "embed"

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)

        mixer = depth.embed_mixer(c)
        if mixer is not None:
            self.mix = mixer

    def forward(self, carry: Carry, inputs: StepInputs) -> Carry:
        v0 = self.embed_tokens(inputs.tokens)
        return self.mix(v0) if hasattr(self, "mix") else (v0,)


def make_ffn(c: ModelConfig, layer: int) -> nn.Module:
    """The feed-forward sub-layer of block `layer`: the dense MLP, or an MoE (moe.py) when `c.moe` is set."""
    return MoEFFN(c) if c.moe is not None and layer in c.moe.layers(c.n_layers) else MLP(c)


def ffn_key(c: ModelConfig, layer: int) -> str:
    """Template-key suffix for block `layer`'s feed-forward structure ("" for the dense MLP and for the MoE
    blocks of an MoE model, ".dense" for its dense first block)."""
    return ".dense" if c.moe is not None and layer not in c.moe.layers(c.n_layers) else ""


def ffn_init_param(c: ModelConfig, name: str, shape: tuple[int, ...], g: torch.Generator) -> Tensor | None:
    """The initial value of a feed-forward parameter that the default rule does not cover, else None: an MoE
    router is N(0, d^-1/2), as the ET paper's."""
    if c.moe is not None and name.endswith(".mlp.router.weight"):
        return torch.randn(shape, generator=g) * c.d_model**-0.5
    return None


class BlockUnit(nn.Module):
    """Two sub-layers, attention then feed-forward, each pre-normed. How their inputs are read from and
    their outputs written to the depth state (the carry) is the depth mixing's business (models/depth/);
    without one (`residual`) it is h += f(h)."""

    kind = "block"

    def __init__(self, c: ModelConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(c.d_model, c.norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.d_model, c.norm_eps)
        self.mlp = make_ffn(c, layer)
        mixer = depth.block_mixer(c, layer)
        if mixer is not None:
            self.mix = mixer

    @property
    def can_rebuild(self) -> bool:
        """Whether the backward can rebuild the carry-in from the carry-out (forward `record=True` returns
        what it needs; `rebuild=` maps back; `side=` recomputes with the recorded inputs)."""
        return getattr(getattr(self, "mix", None), "rebuildable", False)

    def sublayers(self, inputs: StepInputs, recompute: bool = False):
        """The two sub-layers as functions of their input (B, T, d); tiled when `inputs` asks for chunks
        shorter than the sequence (an MoE feed-forward routes over the whole micro-batch: never tiled).
        `recompute`: the feed-forward's output is only added to the residual stream and the block's output
        is not read (a backward's recompute of a residual block), so a dense MLP leaves its last matmul
        unevaluated, and a tiled one computes nothing (its tiles are recomputed in backward). Tiles recompute
        in backward without their final projections, recompute or not (models/unevaluated.py)."""
        def attn(h: Tensor) -> Tensor:
            chunk = inputs.tiles(h.shape[1])
            if chunk is not None:
                return self.self_attn.tiled_forward(h, self.input_layernorm, inputs, chunk)
            return self.self_attn(self.input_layernorm(h), inputs)

        def ffn(h: Tensor) -> Tensor:
            chunk = inputs.tiles(h.shape[1])
            if chunk is not None and isinstance(self.mlp, MLP):
                # a block's recompute reads no value of it, and its tiles are recomputed in backward anyway:
                # nothing computed here then
                mods = {"norm": self.post_attention_layernorm, "mlp": self.mlp}
                return tiled(_mlp_piece, mods, h, chunk, recompute_fn=_unread(_mlp_piece), unevaluated=recompute)[0]
            if recompute and isinstance(self.mlp, MLP):
                return self.mlp(self.post_attention_layernorm(h), value_unused=True)
            return self.mlp(self.post_attention_layernorm(h))

        return attn, ffn

    def forward(self, carry: Carry, inputs: StepInputs, recompute: bool = False, **mode) -> Carry:
        """`recompute`: the caller back-propagates through the output but reads none of its values (the
        backward's recompute from a checkpoint, runtime/engine.py); a residual block then skips work whose
        value no gradient needs, and its output holds garbage. Gradients are the same bits either way."""
        if hasattr(self, "mix"):  # a depth mixing weighs the sub-layers' outputs: their values are needed
            return self.mix(carry, self.sublayers(inputs), **mode)
        attn, ffn = self.sublayers(inputs, recompute)
        (h,) = carry
        h = h + attn(h)
        return (h + ffn(h),)


class HeadUnit(nn.Module):
    kind = "head"

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(c.d_model, c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        mixer = depth.head_mixer(c)
        if mixer is not None:
            self.mix = mixer

    def final(self, carry: Carry) -> Tensor:
        """The input of the final norm: the depth state read out."""
        return self.mix(carry) if hasattr(self, "mix") else carry[0]

    def forward(self, carry: Carry, inputs: StepInputs) -> Carry:
        x = self.final(carry)
        targets = inputs.targets.reshape(-1)
        if inputs.tiles(x.shape[-2]) is not None:  # tiled: the final norm runs inside the loss's chunks
            x = x.reshape(-1, x.shape[-1])
            return (chunked_cross_entropy(x, self.lm_head.weight, targets, inputs.loss_chunk, norm=self.norm,
                                          target=inputs.target),)
        x = self.norm(x)
        x = x.reshape(-1, x.shape[-1])
        return (chunked_cross_entropy(x, self.lm_head.weight, targets, inputs.loss_chunk, target=inputs.target),)


def recompute_mode(kind: str) -> dict:
    """The forward mode of a unit of `kind` recomputed for its backward (its output's values unread): a
    block's `recompute=True`; the embedding and the head have none."""
    return {"recompute": True} if kind == "block" else {}


def unit_names(config: ModelConfig) -> list[str]:
    return ["embed", *(f"blocks.{i}" for i in range(config.n_layers)), "head"]


def template_key(config: ModelConfig, unit: str) -> str:
    """Units sharing a structure share a template: all blocks of a plain dense model run one template;
    depth mixings whose state grows with depth, and a dense first block of an MoE, make more."""
    if unit in ("embed", "head"):
        return unit
    layer = int(unit.split(".")[1])
    return "block" + depth.block_key(config, layer) + ffn_key(config, layer)


def templates(config: ModelConfig) -> dict[str, nn.Module]:
    """One stateless template per distinct unit structure, on the meta device (no weight memory)."""
    out: dict[str, nn.Module] = {}
    with torch.device("meta"):
        out["embed"] = EmbedUnit(config)
        for layer in range(config.n_layers):
            key = template_key(config, f"blocks.{layer}")
            if key not in out:
                out[key] = BlockUnit(config, layer)
        out["head"] = HeadUnit(config)
    return out


def tied_params(config: ModelConfig, unit: str) -> dict[str, str]:
    """Parameters of `unit` that are stored in another unit (name -> 'unit.param')."""
    if config.tie_embeddings and unit == "head":
        return {"lm_head.weight": "embed.embed_tokens.weight"}
    return {}


class EagerModel(nn.Module):
    """The whole model as one nn.Module; forward returns the summed token loss (fp32)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = EmbedUnit(config)
        self.blocks = nn.ModuleList(BlockUnit(config, i) for i in range(config.n_layers))
        self.head = HeadUnit(config)
        if config.tie_embeddings:
            self.head.lm_head.weight = self.embed.embed_tokens.weight

    def forward(self, tokens: Tensor, targets: Tensor, positions: Tensor | None = None) -> Tensor:
        # NOTE: full logits and F.cross_entropy on purpose: an independent check of the chunked loss.
        logits = self.logits(tokens, positions).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum",
                               ignore_index=IGNORE_INDEX)

    def logits(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """(B, T, vocab) next-token logits in the model's dtype; `positions` (B, T) for a packed batch."""
        dtype = self.embed.embed_tokens.weight.dtype
        cos, sin = rope_tables(self.config, tokens.shape[1], dtype, tokens.device)
        packed = packing(positions.cpu(), tokens.device) if positions is not None else {}
        inputs = StepInputs(tokens=tokens, cos=cos, sin=sin, **packed)
        carry = self.embed((), inputs)
        for block in self.blocks:
            carry = block(carry, inputs)
        return self.head.lm_head(self.head.norm(self.head.final(carry)))


def decays(name: str, shape: tuple[int, ...]) -> bool:
    """Whether AdamW's weight decay applies to the parameter `name` (eager name) of `shape`: weight matrices
    do (projections, embeddings, the LM head, experts, routers); norms, biases and depth-mixing coefficients
    (`<unit>.mix.*`, whatever their shape) do not. The usual convention of fine-tuning recipes."""
    return len(shape) >= 2 and ".mix." not in name


def init_weights(config: ModelConfig, seed: int = 0, names: list[str] | None = None) -> dict[str, Tensor]:
    """fp32 initial weights by eager parameter name, each drawn from its own generator.

    Each tensor depends only on (seed, name), so the host store can initialise unit by unit without building
    the model, and get exactly what build_eager(config, seed) holds. Normal(0, init_std) for matrices,
    output projections scaled by 1/sqrt(2 * n_layers) (GPT-2), ones for norms, zeros for biases.
    """
    shapes = param_shapes(config)
    return {name: _draw(config, seed, name, shapes[name]) for name in (names if names is not None else shapes)}


def init_into(config: ModelConfig, seed: int, dests: dict[str, Tensor], threads: int | None = None) -> None:
    """init_weights(config, seed)'s values written into `dests` (eager name -> a contiguous fp32 tensor of the
    parameter's numel, e.g. a view of the host store's masters), drawn in place on `threads` threads (default:
    the CPUs this process may run on). Each tensor has its own generator, so the bits do not depend on the
    threads; a 7B model draws in seconds on a server's cores instead of minutes on one."""
    shapes = param_shapes(config)
    for name, dst in dests.items():
        if dst.dtype != torch.float32 or not dst.is_contiguous() or dst.numel() != math.prod(shapes[name]):
            raise ValueError(f"{name}: needs a contiguous fp32 tensor of {math.prod(shapes[name])} elements")
    threads = threads or len(os.sched_getaffinity(0))
    work = sorted(dests, key=lambda n: -dests[n].numel())  # the largest first, so the threads end together
    if threads <= 1 or len(work) <= 1:
        for name in work:
            _draw(config, seed, name, shapes[name], dests[name])
        return
    with ThreadPoolExecutor(min(threads, len(work)), thread_name_prefix="init") as pool:
        for f in [pool.submit(_draw, config, seed, n, shapes[n], dests[n]) for n in work]:
            f.result()


def _draw(config: ModelConfig, seed: int, name: str, shape: tuple[int, ...], out: Tensor | None = None) -> Tensor:
    """One parameter's initial value (into `out`, reshaped, when given)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    dst = None if out is None else out.view(shape)
    custom = depth.init_param(config, name, shape, g)
    if custom is None:
        custom = ffn_init_param(config, name, shape, g)
    if custom is not None:
        value = custom
    elif name.endswith("norm.weight"):
        value = torch.ones(shape)
    elif name.endswith(".bias"):
        value = torch.zeros(shape)
    else:
        std = config.init_std
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std /= (2 * config.n_layers) ** 0.5
        # in place: the same bits as randn(...) * std, one pass and no temporary of the tensor's size
        return torch.randn(shape, generator=g, out=dst).mul_(std)
    return value if dst is None else dst.copy_(value)


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape by eager name (a tied LM head is listed once, under the embedding)."""
    with torch.device("meta"):
        model = EagerModel(config)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def build_eager(config: ModelConfig | str, seed: int = 0, dtype: torch.dtype = torch.float32) -> EagerModel:
    """The plain nn.Module, initialised as `init_weights(config, seed)`; `config` may be a preset name or a
    config file, as everywhere."""
    if not isinstance(config, ModelConfig):
        from .presets import load_model_config

        config = load_model_config(config)
    with torch.device("meta"):
        model = EagerModel(config)
    model = model.to_empty(device="cpu")
    if config.tie_embeddings:  # to_empty breaks the tie: restore it
        model.head.lm_head.weight = model.embed.embed_tokens.weight
    # drawn in place, in parallel, into the parameters' storage (a tied head's weight is the embedding's)
    init_into(config, seed, {n: model.get_parameter(n).detach().view(-1) for n in param_shapes(config)})
    return reset_buffers(model.to(dtype))  # routing buffers: to_empty left them unset, to() would cast them
