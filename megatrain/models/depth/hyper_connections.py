"""Hyper-Connections (Zhu et al., ICLR 2025): n residual streams per token, static or dynamic
(reference/depth_mixing.md §1.3; lucidrains/hyper-connections for the dynamic parametrisation).

State H (n, B, T, d) in the compute dtype, n copies of the embedding at the start. For each sub-layer:

    x  = A_mᵀ H                      width connection: the sub-layer's input
    y  = f(x)
    H' = A_rᵀ H + B ⊗ y              depth connection

Static: A_m (n), A_r (n x n), B (n) are learned, init A_m = e_{k mod n}, A_r = I, B = 1: every stream is then
the residual stream, bit for bit. Dynamic adds, per token, s_α·tanh(norm(H) W_α) to [A_m | A_r] and
s_β·tanh(norm(H) W_β) to B, with W zero-initialised and s = 0.01: n(n+2) + d(n+3) + 2 parameters per sub-layer.

The head reads the mean of the streams. The paper sums them before the final norm; the norm makes the two
equal up to its epsilon, and the mean keeps the init exactly the residual model.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

SCALE_INIT = 1e-2


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class EmbedMixer(nn.Module):
    def __init__(self, config, spec):
        super().__init__()
        self.n = spec.n

    def forward(self, v0: Tensor):
        return (v0.unsqueeze(0).expand(self.n, *v0.shape).contiguous(),)


class _Connection(nn.Module):
    """The (n+1) x (n+1) hyper-connection matrix of one sub-layer."""

    def __init__(self, n: int, d: int, dynamic: bool, eps: float):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(n, n + 1))  # [:, 0] = A_m, [:, 1:] = A_r
        self.beta = nn.Parameter(torch.ones(n))
        self.dynamic, self.eps = dynamic, eps
        if dynamic:
            self.norm = nn.Parameter(torch.ones(d))
            self.w_alpha = nn.Parameter(torch.zeros(d, n + 1))
            self.w_beta = nn.Parameter(torch.zeros(d))
            self.s_alpha = nn.Parameter(torch.full((), SCALE_INIT))
            self.s_beta = nn.Parameter(torch.full((), SCALE_INIT))

    def forward(self, h: Tensor, f) -> Tensor:
        if self.dynamic:
            hn = _rms(h, self.norm, self.eps)  # (n, B, T, d)
            alpha = self.alpha[:, None, None, :] + self.s_alpha * torch.tanh(hn @ self.w_alpha)  # (n, B, T, n+1)
            beta = self.beta[:, None, None] + self.s_beta * torch.tanh(hn @ self.w_beta)  # (n, B, T)
            x = torch.einsum("nbt,nbtd->btd", alpha[..., 0], h)
            mixed = torch.einsum("nbtm,nbtd->mbtd", alpha[..., 1:], h)
            # NOTE: einsum returns a permuted view; a carry must be contiguous (the runtime may copy it)
            return (mixed + beta[..., None] * f(x)).contiguous()
        x = torch.tensordot(self.alpha[:, 0], h, dims=([0], [0]))
        mixed = torch.tensordot(self.alpha[:, 1:], h, dims=([0], [0]))
        return mixed + self.beta.view(-1, 1, 1, 1) * f(x)


class BlockMixer(nn.Module):
    def __init__(self, config, spec, layer: int):
        super().__init__()
        dynamic = spec.kind == "hc-dynamic"
        self.attn = _Connection(spec.n, config.d_model, dynamic, config.norm_eps)
        self.ffn = _Connection(spec.n, config.d_model, dynamic, config.norm_eps)

    def forward(self, carry, subs):
        (h,) = carry
        h = self.attn(h, subs[0])
        return (self.ffn(h, subs[1]),)


class HeadMixer(nn.Module):
    def __init__(self, config, spec):
        super().__init__()
        self.n = spec.n

    def forward(self, carry) -> Tensor:
        h = carry[0]
        return _tree_sum(list(h.unbind(0))) * (1.0 / self.n)


def _tree_sum(xs: list[Tensor]) -> Tensor:
    """Pairwise sum: n equal values sum exactly when n is a power of two."""
    while len(xs) > 1:
        xs = [xs[i] + xs[i + 1] if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


def block_key(config, spec, layer: int) -> str:
    return ""


def init_param(config, spec, name: str, shape, g) -> Tensor:
    """alpha = [e_{k mod n} | I] for sub-layer k (0-based over the model), beta = 1, norm = 1, W = 0,
    scales 0.01."""
    leaf = name.rsplit(".", 1)[1]
    if leaf == "alpha":
        n = shape[0]
        layer = int(name.split(".")[1])  # blocks.<layer>.mix.<attn|ffn>.alpha
        k = 2 * layer + (0 if ".mix.attn." in name else 1)
        out = torch.zeros(shape)
        out[k % n, 0] = 1.0
        out[:, 1:] = torch.eye(n)
        return out
    if leaf in ("beta", "norm"):
        return torch.ones(shape)
    if leaf in ("s_alpha", "s_beta"):
        return torch.full(shape, SCALE_INIT)
    return torch.zeros(shape)
