"""DepthSSD-N: depth mixing through a rank-N state with scalar decay (reconstruction of the DepthSSD
design, reference/depth_mixing.md §3).

The depth state is S in R^{N x d} per token, N x B x T x d in fp32, carried by every unit:

    S_0 = B_0 ⊗ v_0                         (embed; v_0 the token embedding)
    h_l = C_lᵀ S_{l-1}                      (read, cast to the compute dtype)
    v_l = f_l(h_l)                          (attention or MLP sub-layer, pre-normed)
    S_l = a_l · S_{l-1} + B_l ⊗ v_l         (write)
    h_out = C_{L+1}ᵀ S_L                    (head, before the final norm)

Parameters: a scalar decay a_l = 1 - (1 - A_MIN) · sigmoid(theta_l) in [A_MIN, 1] and vectors B_l, C_l in
R^N per sub-layer, plus B_0 and C_{L+1}: (2N+1)·L + 2N in all. theta = -inf gives a = 1 exactly, so N = 1 with
a = B = C = 1 is the residual model bit for bit. The init is a ≈ 1 - 1e-3 and B = C = e_1 + 0.01·noise: the
residual plus symmetry-breaking noise (with exactly e_1, state dims 2..N would get zero gradient).

The decay is bounded below by A_MIN so a unit can *rebuild* its carry-in from its carry-out in backward,
S_{l-1} = (S_l - B_l ⊗ v_l) / a_l, with v_l recomputed from the sub-layer input h_l that the forward
recorded (`record=True`): a checkpoint of 2·T·d in the compute dtype instead of N·T·d in fp32. The backward
recompute then reads the recorded h_l (`side=`) so it sees exactly the forward's activations.

**Chunked read** (`depthssd:N:chunk=2`, the default): a block reads the state once for both sub-layers, as
Block AttnRes's phase 1 scores all of a block's queries in one pass. With S the carry-in, a_1, a_2 the decays:

    (r_1, r_2) = (C_1, C_2)ᵀ S                        one pass over S
    h_1 = r_1,  h_2 = a_1 · r_2 + (C_2 · B_1) · v_1   T x d work only
    S'  = (a_1 a_2) · S + (a_2 B_1) ⊗ v_1 + B_2 ⊗ v_2  one write (BlockWrite)

the same recurrence reassociated, so equal to `chunk=1` up to fp32 round-off, in a third fewer passes over the
N x T x d state in forward and half in backward, and without the mid-block state that autograd kept.

`mixing_matrix` is the dual (quadratic) form: the (L+1) x (L+1) lower-triangular M with h_l = Σ_{i<l} M[l,i] v_i.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

A_MIN = 0.1  # the smallest decay: rebuilding divides by a_l, so it must stay away from 0
THETA_INIT = -math.log(0.9 / 1e-3 - 1)  # a = 1 - 1e-3 at init
NOISE = 0.01


def decay(theta: Tensor) -> Tensor:
    return 1 - (1 - A_MIN) * torch.sigmoid(theta.float())


def _read(c: Tensor, s: Tensor, dtype: torch.dtype) -> Tensor:
    """C^T S for S (N, B, T, d) fp32: (B, T, d) in `dtype`."""
    return torch.tensordot(c.float(), s, dims=([0], [0])).to(dtype)


def _outer(b: Tensor, v: Tensor) -> Tensor:
    return b.float().view(-1, *([1] * v.dim())) * v.float()


class StateWrite(torch.autograd.Function):
    """S' = a · S + B ⊗ v, with the backward written out: dS = a·dS', da = <dS', S>, dB = dS'·v, dv = Bᵀ dS'.
    Autograd of the same expression makes an N x T x d temporary per product and reduces it again; these are
    single passes (a dot product and two matrix-vector products), which is most of DepthSSD's cost at small d."""

    @staticmethod
    def forward(ctx, s: Tensor, a: Tensor, b: Tensor, v: Tensor) -> Tensor:
        ctx.save_for_backward(s, a, b, v)
        out = s * a
        return out.addcmul_(b.view(-1, *([1] * v.dim())), v)

    @staticmethod
    def backward(ctx, g: Tensor):
        s, a, b, v = ctx.saved_tensors
        g2 = g.reshape(b.shape[0], -1)
        ds = g * a if ctx.needs_input_grad[0] else None
        da = torch.dot(g.reshape(-1), s.reshape(-1)).reshape(a.shape) if ctx.needs_input_grad[1] else None
        db = g2 @ v.reshape(-1) if ctx.needs_input_grad[2] else None
        dv = (b @ g2).view(v.shape) if ctx.needs_input_grad[3] else None
        return ds, da, db, dv


class BlockWrite(torch.autograd.Function):
    """S' = p · S + Σ_j b_j ⊗ v_j, summed in that order (so p = b = 1 is the residual's (S + v_1) + v_2 bit
    for bit), for the K sub-layers of one block. The backward reads dS' once per product: dS = p·dS',
    dp = <dS', S>, db = dS' Vᵀ and dV = b dS' as single matrix products over the stacked v_j."""

    @staticmethod
    def forward(ctx, s: Tensor, p: Tensor, b: Tensor, *vs: Tensor) -> Tensor:
        ctx.save_for_backward(s, p, b, *vs)
        out = s * p
        for j, v in enumerate(vs):  # v in its own dtype: addcmul_ promotes each element exactly
            out.addcmul_(b[j].view(-1, *([1] * v.dim())), v)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        s, p, b, *vs = ctx.saved_tensors
        need = ctx.needs_input_grad
        g2 = g.reshape(s.shape[0], -1)
        ds = g * p if need[0] else None
        dp = torch.dot(g.reshape(-1), s.reshape(-1)).reshape(p.shape) if need[1] else None
        db = torch.stack([v.reshape(-1).to(g.dtype) for v in vs]) @ g2.t() if need[2] else None
        dv = (b @ g2).unbind(0) if any(need[3:]) else (None,) * len(vs)
        return (ds, dp, db, *(None if d is None else d.view(v.shape).to(v.dtype) for d, v in zip(dv, vs)))


class EmbedMixer(nn.Module):
    def __init__(self, config, spec):
        super().__init__()
        self.B = nn.Parameter(torch.ones(spec.n))

    def forward(self, v0: Tensor):
        return (_outer(self.B, v0),)


class BlockMixer(nn.Module):
    """Two sub-layers (attention, MLP) of the recurrence. Modes: `record=True` also returns the sub-layer
    inputs (h_1, h_2); `side=(h_1, h_2)` recomputes with those inputs; `rebuild=(h_1, h_2)` maps the
    carry-out back to the carry-in without autograd."""

    rebuildable = True

    def __init__(self, config, spec, layer: int):
        super().__init__()
        self.chunked = spec.chunk > 1
        self.theta = nn.Parameter(torch.zeros(2))
        self.B = nn.Parameter(torch.ones(2, spec.n))
        self.C = nn.Parameter(torch.ones(2, spec.n))

    def forward(self, carry, subs, record: bool = False, side=None, rebuild=None):
        if rebuild is not None:
            return self._rebuild(carry, subs, rebuild)
        if self.chunked:
            return self._chunked(carry, subs, record, side)
        (s,) = carry
        a = decay(self.theta)
        hs = []
        for j, f in enumerate(subs):
            h = _read(self.C[j], s, self.C.dtype)
            if side is not None:  # the recorded value, with the gradient of the recomputed one
                h = side[j] + (h - h.detach())
            hs.append(h)
            s = StateWrite.apply(s, a[j], self.B[j].float(), f(h).float())
        return ((s,), tuple(hs)) if record else (s,)

    def _chunked(self, carry, subs, record: bool, side):
        (s,) = carry
        a = decay(self.theta)
        dtype = self.C.dtype
        c, b = self.C.float(), self.B.float()
        r = torch.mm(c, s.reshape(s.shape[0], -1)).view(len(subs), *s.shape[1:])  # every read in one pass
        hs, vs = [], []
        for j, f in enumerate(subs):
            h = r[j]
            for i in range(j):  # Horner over what this block's earlier sub-layers wrote since S
                h = h * a[i] + (c[j] @ b[i]) * vs[i].float()
            h = h.to(dtype)
            if side is not None:  # the recorded value, with the gradient of the recomputed one
                h = side[j] + (h - h.detach())
            hs.append(h)
            vs.append(f(h))
        s = BlockWrite.apply(s, *_block_coefficients(a, b), *vs)
        if record:  # an fp32 h may be a view of both reads: the record must not keep the other alive
            return (s,), tuple(h if h._base is None else h.clone() for h in hs)
        return (s,)

    @torch.no_grad()
    def _rebuild(self, carry, subs, side):
        (s,) = carry
        a = decay(self.theta)
        if self.chunked:
            p, b = _block_coefficients(a, self.B.float())
            for j in reversed(range(len(subs))):
                s = s - _outer(b[j], subs[j](side[j]))
            return (s / p,)
        for j in reversed(range(len(subs))):
            s = (s - _outer(self.B[j], subs[j](side[j]))) / a[j]
        return (s,)


def _block_coefficients(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """A block's write as one decay of its carry-in plus one term a sub-layer: p = Π_j a_j and
    b_i' = b_i · Π_{k>i} a_k (the last sub-layer's b unscaled)."""
    return a.prod(), torch.stack([b[i] * a[i + 1:].prod() if i + 1 < a.shape[0] else b[i] for i in range(b.shape[0])])


class HeadMixer(nn.Module):
    def __init__(self, config, spec):
        super().__init__()
        self.C = nn.Parameter(torch.ones(spec.n))

    def forward(self, carry):
        return _read(self.C, carry[0], self.C.dtype)


def block_key(config, spec, layer: int) -> str:
    return ""


def init_param(config, spec, name: str, shape, g) -> Tensor:
    if name.endswith(".theta"):
        return torch.full(shape, THETA_INIT)
    e1 = torch.zeros(shape)
    e1[..., 0] = 1.0
    return e1 + NOISE * torch.randn(shape, generator=g)


def mixing_matrix(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """The dual form: M[l, i] = (C_l · B_i) · prod_{k=i+1}^{l-1} a_k for 0 <= i < l <= L+1.

    a: (L,) decays of sub-layers 1..L; b: (L+1, N) for sources 0..L; c: (L+1, N) for readers 1..L+1.
    Returns the (L+2) x (L+2) strictly lower-triangular matrix (row 0 and column L+1 are zero), in fp64.
    """
    a, b, c = a.double(), b.double(), c.double()
    n = a.shape[0] + 2
    loga = torch.zeros(n, dtype=torch.float64)
    loga[1 : n - 1] = torch.log(a)
    cum = torch.cumsum(loga, 0)  # cum[k] = sum_{m<=k} log a_m
    m = torch.zeros(n, n, dtype=torch.float64)
    for row in range(1, n):
        for i in range(row):
            m[row, i] = (c[row - 1] @ b[i]) * torch.exp(cum[row - 1] - cum[i])
    return m


def model_mixing_matrix(named: dict[str, Tensor], n_layers: int) -> Tensor:
    """M of a model from its parameters by eager name (`embed.mix.B`, `blocks.i.mix.*`, `head.mix.C`)."""
    thetas = [named[f"blocks.{i}.mix.theta"] for i in range(n_layers)]
    a = decay(torch.cat([t.reshape(-1) for t in thetas]))
    b = torch.cat([named["embed.mix.B"].reshape(1, -1), *(named[f"blocks.{i}.mix.B"] for i in range(n_layers))])
    c = torch.cat([*(named[f"blocks.{i}.mix.C"] for i in range(n_layers)), named["head.mix.C"].reshape(1, -1)])
    return mixing_matrix(a, b.float(), c.float())


def semiseparable_rank(m: Tensor, tol: float = 1e-9) -> int:
    """The largest numerical rank of the submatrices M[k:, :k] that lie in the strictly lower part."""
    m = m.double()
    n = m.shape[0]
    best = 0
    for k in range(1, n):
        sub = m[k:, :k]
        s = torch.linalg.svdvals(sub)
        best = max(best, int((s > tol * max(float(s.max()), 1e-300)).sum()))
    return best
