"""DenseFormer (Pagliardini et al., ICML 2024): a depth-weighted average (DWA) after each block
(reference/depth_mixing.md §1.2, epfml/DenseFormer).

Per transformer block, with the block's own residuals inside: X_0 = embedding, X_i = Block_i(Y_{i-1}),
Y_i = Σ_j α_{i,j} X_j over j ≤ i with j ≡ i (mod k) (dilation k), applied only when p | i (period p; otherwise
Y_i = X_i). The head reads Y_D. Init α_{i,i} = 1 and the rest 0: the residual model, bit for bit.
Block i (1-based) owns (i + k) // k weights when p | i: D(D+3)/2 in all for 1x1.

The carry is the stack of block outputs that a later DWA still reads, each once (the official code's in-place
accumulators keep every X_j for the same reason), then the current Y_i when it is not X_i itself. The DWA is
a running sum of α_j · X_j: no stacked copy.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor, nn


def applies(spec, i: int) -> bool:
    """Whether block i (1-based; 0 is the embedding) ends with a DWA."""
    return i > 0 and i % spec.period == 0


def sources(spec, i: int) -> list[int]:
    """The X_j that block i's DWA averages."""
    return list(range(i % spec.dilation, i + 1, spec.dilation))


def needed(spec, n_layers: int, i: int) -> list[int]:
    """The X_j (j <= i) that a DWA after block i still reads."""
    later = [m for m in range(i + 1, n_layers + 1) if applies(spec, m)]
    return [j for j in range(i + 1) if any(j in sources(spec, m) for m in later)]


def layout(spec, n_layers: int, i: int) -> tuple[list[int], bool]:
    """The carry after block i: the needed X_j, and whether Y_i follows them as its own tensor."""
    keep = needed(spec, n_layers, i)
    return keep, applies(spec, i) or i not in keep


DWA_WEIGHT = re.compile(r"blocks\.\d+\.mix\.alpha")


def decayed(name: str) -> bool:
    """Whether AdamW decays the parameter `name` (eager name): the DWA weights, as the official code does
    (epfml/DenseFormer holds them in nn.Linear modules, which its optimizer groups decay)."""
    return DWA_WEIGHT.fullmatch(name) is not None


def dwa(alpha: Tensor, xs: list[Tensor]) -> Tensor:
    """Σ_j α_j · X_j as a running sum: no stacked copy of the sources (benchmarks/depth_throughput.py times it
    against a stack-then-reduce)."""
    y = None
    for w, x in zip(alpha, xs):
        y = w * x if y is None else y + w * x
    return y


class EmbedMixer(nn.Module):
    def __init__(self, config, spec):
        super().__init__()
        self.spec, self.n_layers = spec, config.n_layers

    def forward(self, v0: Tensor):
        keep, extra = layout(self.spec, self.n_layers, 0)
        return tuple(v0 for _ in keep) + ((v0,) if extra else ())


class BlockMixer(nn.Module):
    def __init__(self, config, spec, layer: int):
        super().__init__()
        self.spec, self.n_layers, self.i = spec, config.n_layers, layer + 1
        if applies(spec, self.i):
            self.alpha = nn.Parameter(torch.zeros(len(sources(spec, self.i))))

    def forward(self, carry, subs):
        spec, i = self.spec, self.i
        prev_keep, _ = layout(spec, self.n_layers, i - 1)
        xs = dict(zip(prev_keep, carry))
        h = carry[-1]
        h = h + subs[0](h)
        x = h + subs[1](h)
        xs[i] = x
        y = x
        if applies(spec, i):
            y = dwa(self.alpha, [xs[j] for j in sources(spec, i)])
        keep, extra = layout(spec, self.n_layers, i)
        return tuple(xs[j] for j in keep) + ((y,) if extra else ())


class HeadMixer(nn.Module):
    def __init__(self, config, spec):
        super().__init__()

    def forward(self, carry) -> Tensor:
        return carry[-1]


def block_key(config, spec, layer: int) -> str:
    return f"@{layer}"


def init_param(config, spec, name: str, shape, g) -> Tensor:
    out = torch.zeros(shape)
    out[-1] = 1.0  # α_{i,i}: the newest source is the last
    return out
