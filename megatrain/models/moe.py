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
  unit streams a few large tensors; each expert runs on exactly its own tokens (exact FLOPs): grouped matmuls
  over device offsets (torch._grouped_mm) where the counts are only on the device, so a training forward
  reads nothing back (routing.py, "Host syncs"); a loop over the experts where the counts are static, and
  as the named fallback (one host read of the counts) where torch._grouped_mm cannot run the operands.
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

    def forward(self, x: Tensor, sel: routing.Selection) -> Tensor:
        """x: (R, d), the selection's rows (grouped by expert); the padding rows (sel.rows) come out 0."""
        up, down = self.up_proj.weight, self.down_proj.weight
        gate = self.gate_proj.weight if hasattr(self, "gate_proj") else None
        if sel.counts is None and grouped_mm_runs(x, up, down):
            return _grouped_experts(x, sel, up, down, gate, lambda a, b, offs: torch._grouped_mm(a, b, offs=offs))
        if x.device.type == "meta":  # the tracer: the grouped matmuls' FLOPs and saved tensors, in a loop

            def traced(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
                return _TracedGrouped.apply(a, b, offs, sel.counts)

            return _grouped_experts(x, sel, up, down, gate, traced)
        # the loop: static counts, or the named fallback (one host read) where torch._grouped_mm cannot run
        counts = sel.counts if sel.counts is not None else routing.read_counts(sel.counts_t)
        return _looped_experts(x, counts, up, down, gate)


def grouped_mm_runs(x: Tensor, *weights: Tensor) -> bool:
    """torch._grouped_mm runs these operands with no host read of its offsets: torch has it (2.8 on), and on
    the CPU (a loop over the groups it reads in place) the rows of x and of each weight are 16-byte aligned,
    or on CUDA the bf16 kernel (compute capability 9 or 10) takes them; CUDA's fallback for other dtypes and
    GPUs copies the offsets to the host. Not on meta: its meta function takes bf16 only (the tracer prices it
    with _TracedGrouped)."""
    if not hasattr(torch, "_grouped_mm") or any(w.dtype != x.dtype for w in weights):
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] not in (9, 10):
            return False
    elif x.device.type != "cpu" or not x.dtype.is_floating_point:
        return False
    align = 16 // x.element_size()
    return x.stride(-1) == 1 and x.stride(0) % align == 0 and all(
        w.is_contiguous() and w.shape[-1] % align == 0 and w.shape[-2] % align == 0 for w in weights)


def _grouped_experts(x: Tensor, sel: routing.Selection, up: Tensor, down: Tensor, gate: Tensor | None, mm) -> Tensor:
    """The experts as grouped matmuls `mm(a, b, offs)` over the device offsets: static shapes, no host read.
    Rows past the last offset (padding) are in no group, so the matmuls leave them (and their input gradients)
    unwritten: the two `where`s keep them out of the output and out of x's gradient, exactly (a select, never
    a product)."""
    offs = sel.offsets()
    if sel.rows is not None:
        x = torch.where(sel.rows[:, None], x, 0)
    h = mm(x, up.transpose(-2, -1), offs)
    h = F.silu(mm(x, gate.transpose(-2, -1), offs)) * h if gate is not None else F.relu(h).square()
    y = mm(h, down.transpose(-2, -1), offs)
    return y if sel.rows is None else torch.where(sel.rows[:, None], y, 0)


class _TracedGrouped(torch.autograd.Function):
    """torch._grouped_mm as the tracer (meta tensors) prices it, whose meta function takes bf16 only: the same
    products as a loop over the groups' static `sizes`, saving what torch._grouped_mm saves (a, b, offs), so a
    plan's FLOPs and saved bytes bound the run's."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, offs: Tensor, sizes: list[int]) -> Tensor:
        ctx.save_for_backward(a, b, offs)
        ctx.sizes = sizes
        return torch.cat([ai @ bi for ai, bi in zip(a.split(sizes), b.unbind(0))])

    @staticmethod
    def backward(ctx, grad: Tensor):
        a, b, _ = ctx.saved_tensors
        a_parts, g_parts = a.split(ctx.sizes), grad.split(ctx.sizes)
        grad_a = torch.cat([gi @ bi.transpose(-2, -1) for gi, bi in zip(g_parts, b.unbind(0))])
        grad_b = torch.stack([ai.transpose(-2, -1) @ gi for ai, gi in zip(a_parts, g_parts)])
        return grad_a, grad_b, None, None


def _looped_experts(x: Tensor, counts: list[int], up: Tensor, down: Tensor, gate: Tensor | None) -> Tensor:
    """One expert_mlp per expert on its counts[e] rows (host ints); rows past them (padding) come out 0."""
    gates = gate.unbind(0) if gate is not None else [None] * len(counts)
    pairs = sum(counts)
    parts = (x[:pairs] if pairs < x.shape[0] else x).split(counts)
    ys = [expert_mlp(xe, u, dn, g) for xe, u, dn, g in zip(parts, up.unbind(0), down.unbind(0), gates)]
    if pairs < x.shape[0]:
        ys.append(x.new_zeros((x.shape[0] - pairs, down.shape[1])))
    return torch.cat(ys)


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
        y = self.experts(x[sel.token_idx], sel)
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
