"""Mixture-of-experts feed-forward: the expert MLPs and the MoE layer (docs/DESIGN.md 4.1).

Where it sits: `ModelConfig.moe` (a MoEConfig, config.py) makes the feed-forward of every block, except the first with
`dense_first`, an `MoEFFN` (units.make_ffn); routing.py decides which tokens each expert takes and
owns the routing state. Try it: `megatrain train --model moe-tiny --device sim --gpu-mem 8MiB --steps 20
--seq-len 128`. Run its tests: `.venv/bin/pytest tests/models/test_moe.py`.

The layer, as in the Expert Threshold paper (arXiv 2603.11535, §3):
  y_t = shared(x_t) + sum_i z_ti * gate(r_ti) * E_i(x_t),   r_t = W_r x_t in fp32
- gate: sigmoid(r_ti) (default) or softmax over the experts; no renormalisation over the selected experts;
  the weighted sum is accumulated in fp32 (index_add). z comes from the router (routing.py).
- experts: ReLU² (default) or SwiGLU MLPs of width `expert_dim`, no biases, weights stacked (E, out, in) so a
  unit streams a few large tensors; each expert runs on exactly its own tokens (a loop: exact FLOPs).
- shared expert: one always-on MLP of the same type and width (optional). First block dense (optional): the
  model's own SwiGLU MLP of width ffn_dim.
- names: `mlp.router.weight` (E, d), `mlp.experts.{gate,up,down}_proj.weight` (E, out, in),
  `mlp.shared.{gate,up,down}_proj.weight`; buffers `mlp.threshold` and `mlp.updates` (et, ec), `mlp.bias` (tc
  bias).
- init: router N(0, d^-1/2) as the paper; experts like the dense MLP (N(0, init_std), down projections / sqrt(2L)).

The aux loss (tc, balance="aux") and the carry contract. Units carry only the depth state and the head
returns the summed token loss, which the runtime scales by 1 / the step's target tokens. The layer adds
aux x N (N: the micro-batch's tokens) to that summed loss through the gradient: an identity on its output
whose backward also gives aux the step's loss scale (routing.step_context), exactly what adding it to the
loss would give. Forward values, carries and the reported loss (the LM loss, comparable across routers) are
unchanged; the gradient is that of LM loss + the token-weighted mean of aux over the step's micro-batches.
A second carry element would change the carry of every depth mixing and the head; a straight-through
`aux - aux.detach()` added to the carry would be scaled by the incoming gradient, not by the loss scale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import routing

if TYPE_CHECKING:
    from .config import ModelConfig

def active_params(config: ModelConfig) -> int:
    """Parameters a token uses on average: all but the routed experts it does not take (top_k of E)."""
    m = config.moe
    if m is None:
        return config.n_params()
    idle = (m.n_experts - m.top_k) * m.expert_params(config.d_model)
    return config.n_params() - len(m.layers(config.n_layers)) * idle


# -- modules -----------------------------------------------------------------------------------------------
def expert_mlp(x: Tensor, up: Tensor, down: Tensor, gate: Tensor | None = None) -> Tensor:
    """down(relu(up x)^2), or down(silu(gate x) * up x) when `gate` is given."""
    h = F.linear(x, up)
    h = F.silu(F.linear(x, gate)) * h if gate is not None else F.relu(h).square()
    return F.linear(h, down)


class SharedExpert(nn.Module):
    def __init__(self, d: int, width: int, kind: str):
        super().__init__()
        if kind == "swiglu":
            self.gate_proj = nn.Linear(d, width, bias=False)
        self.up_proj = nn.Linear(d, width, bias=False)
        self.down_proj = nn.Linear(width, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate_proj.weight if hasattr(self, "gate_proj") else None
        return expert_mlp(x, self.up_proj.weight, self.down_proj.weight, gate)


class Stacked(nn.Module):
    """One weight per expert, stacked: (E, out, in)."""

    def __init__(self, n: int, d_out: int, d_in: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, d_out, d_in))


class Experts(nn.Module):
    def __init__(self, n: int, d: int, width: int, kind: str):
        super().__init__()
        if kind == "swiglu":
            self.gate_proj = Stacked(n, width, d)
        self.up_proj = Stacked(n, width, d)
        self.down_proj = Stacked(n, d, width)

    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        """x: (R, d), rows grouped by expert, counts[e] rows for expert e."""
        ups, downs = self.up_proj.weight.unbind(0), self.down_proj.weight.unbind(0)
        gates = self.gate_proj.weight.unbind(0) if hasattr(self, "gate_proj") else [None] * len(ups)
        parts = x.split(counts)
        return torch.cat([expert_mlp(xe, up, down, gate) for xe, up, down, gate in zip(parts, ups, downs, gates)])


class _AuxGrad(torch.autograd.Function):
    """Identity on `y`; its backward also gives `aux` the gradient `scale`, as if aux were in the loss."""

    @staticmethod
    def forward(ctx, y: Tensor, aux: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, grad.new_full((), ctx.scale, dtype=torch.float32), None


class MoEFFN(nn.Module):
    """Router + routed experts + shared expert, on (..., d) inputs; every token of the input is one pool."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        m = c.moe
        self.moe = m
        self.router = nn.Linear(c.d_model, m.n_experts, bias=False)
        self.experts = Experts(m.n_experts, c.d_model, m.width(c.d_model), m.expert_mlp)
        if m.shared_expert:
            self.shared = SharedExpert(c.d_model, m.width(c.d_model), m.expert_mlp)
        for name, shape in routing.buffer_shapes(m, m.n_experts):
            self.register_buffer(name, torch.zeros(shape))

    def routing_buffers(self) -> dict[str, Tensor]:
        return {name: getattr(self, name) for name, _ in routing.buffer_shapes(self.moe, self.moe.n_experts)}

    def forward(self, x: Tensor) -> Tensor:
        m, shape = self.moe, x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x).float()
        with torch.no_grad():
            sel = routing.select(m, logits, self.routing_buffers(), self.training)
        ctx = routing.current() if self.training else None
        with_aux = ctx is not None and m.balance == "aux"
        probs = torch.softmax(logits, dim=-1) if m.gate == "softmax" or with_aux else None
        pair = (sel.token_idx, sel.expert_idx)
        gate = probs[pair] if m.gate == "softmax" else torch.sigmoid(logits[pair])
        y = self.experts(x[sel.token_idx], sel.counts)
        out = self.shared(x).float() if hasattr(self, "shared") else x.new_zeros(x.shape, dtype=torch.float32)
        out = out.index_add(0, sel.token_idx, y.float() * gate[:, None])
        if ctx is not None:
            out = self._account(out, sel, probs if with_aux else None, ctx)
        return out.to(x.dtype).view(shape)

    def _account(self, out: Tensor, sel: routing.Selection, probs: Tensor | None,
                 ctx: routing.StepContext) -> Tensor:
        """In a training step: add the aux loss's gradient, and record the statistics (first forward only)."""
        n, e = out.shape[0], self.moe.n_experts
        stats = {}
        if probs is not None:
            f = sel.counts_t.float() / (n * self.moe.top_k)  # on the device: no copy from the host
            aux = self.moe.aux_loss_coef * e * (f * probs.mean(0)).sum()
            out = _AuxGrad.apply(out, aux * n, ctx.loss_scale)
            stats["aux"] = aux.detach()
        if ctx.log is not None and out.device.type != "meta":
            ctx.log.records.append({**routing.record_stats(sel, n, e), **stats})
        return out


def moe_layers(module: nn.Module) -> list[tuple[str, MoEFFN]]:
    """The MoE layers inside a unit (or a model), with their module paths, in module order."""
    return [(path, mod) for path, mod in module.named_modules() if isinstance(mod, MoEFFN)]


def update_buffers(module: nn.Module, buffers: dict[str, Tensor], logs: list[list[dict[str, Tensor]]]) -> None:
    """After an optimizer step: update the routing buffers of `module`'s MoE layers in place.

    `buffers` by name relative to `module` (`mlp.threshold`, ...); `logs` one list per micro-batch of the
    step, in micro-batch order, holding one record per MoE layer in module order (RoutingLog.records)."""
    for j, (path, layer) in enumerate(moe_layers(module)):
        mine = {name: buffers[f"{path}.{name}"] for name, _ in routing.buffer_shapes(layer.moe, layer.moe.n_experts)}
        routing.update_layer(layer.moe, mine, [records[j] for records in logs if len(records) > j])


def reset_buffers(model: nn.Module) -> nn.Module:
    """Set every routing buffer to its initial value (0, fp32), whatever dtype or storage the model got."""
    for _, layer in moe_layers(model):
        device = layer.router.weight.device
        for name, shape in routing.buffer_shapes(layer.moe, layer.moe.n_experts):
            layer.register_buffer(name, torch.zeros(shape, device=device))
    return model
