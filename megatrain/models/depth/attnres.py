"""Block AttnRes (Kimi Team, arXiv 2603.15031): each sub-layer's input is a softmax-weighted sum of block
summaries, scored by a learned pseudo-query against their RMS-normed values (reference/depth_mixing.md §1.5).

The L = 2·n_layers sub-layers form NB blocks of S = L / NB. The sources are b_0 = the embedding, the sums
b_1..b_{n-1} of the completed blocks' outputs, and the partial sum of the current block (from its second
sub-layer on). Sub-layer l reads h_l = Σ_j softmax_j(w_lᵀ RMSNorm_l(V_j)) V_j; the head reads the same over all
NB + 1 sources with its own query. Parameters per sub-layer: w_l (init 0: a uniform average at init, as the
paper prescribes) and the norm weight (init 1).

The carry is (b_0, .., b_{n-1}[, partial]) in the compute dtype: at most NB + 1 tensors of T x d.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def block_size(config, spec) -> int:
    L = 2 * config.n_layers
    if L % spec.n:
        divisors = [k for k in range(1, L + 1) if L % k == 0]
        raise ValueError(f"attnres:{spec.n}: {spec.n} blocks must divide the {L} sub-layers (2 x n_layers); "
                         f"use one of {divisors}")
    return L // spec.n


class _Query(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(d))
        self.norm = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, sources: list[Tensor]) -> Tensor:
        w = (self.query * self.norm).float()
        logits = torch.stack([(v.float() * torch.rsqrt(v.float().pow(2).mean(-1, keepdim=True) + self.eps)) @ w
                              for v in sources])  # (n_src, B, T)
        p = torch.softmax(logits, dim=0)
        h = None
        for pj, v in zip(p, sources):
            term = pj[..., None] * v.float()
            h = term if h is None else h + term
        return h.to(sources[0].dtype)


class EmbedMixer(nn.Module):
    def __init__(self, config, spec):
        super().__init__()
        block_size(config, spec)

    def forward(self, v0: Tensor):
        return (v0,)


class BlockMixer(nn.Module):
    def __init__(self, config, spec, layer: int):
        super().__init__()
        self.S = block_size(config, spec)
        self.first = 2 * layer  # 0-based index of the block's first sub-layer
        self.attn = _Query(config.d_model, config.norm_eps)
        self.ffn = _Query(config.d_model, config.norm_eps)

    def forward(self, carry, subs):
        pos = self.first % self.S
        blocks = list(carry[:-1]) if pos else list(carry)
        partial = carry[-1] if pos else None
        for j, (q, f) in enumerate(zip((self.attn, self.ffn), subs)):
            p = (self.first + j) % self.S
            v = f(q(blocks if p == 0 else [*blocks, partial]))
            partial = v if p == 0 else partial + v
            if p == self.S - 1:
                blocks.append(partial)
                partial = None
        return (*blocks, partial) if partial is not None else tuple(blocks)


class HeadMixer(nn.Module):
    def __init__(self, config, spec):
        super().__init__()
        self.out = _Query(config.d_model, config.norm_eps)

    def forward(self, carry) -> Tensor:
        return self.out(list(carry))


def block_key(config, spec, layer: int) -> str:
    return f"@{(2 * layer) % block_size(config, spec)}"


def init_param(config, spec, name: str, shape, g) -> Tensor:
    return torch.ones(shape) if name.endswith(".norm") else torch.zeros(shape)
