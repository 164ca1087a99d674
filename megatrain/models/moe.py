"""Mixture-of-experts feed-forward: its config, the expert MLPs and the MoE layer (docs/DESIGN.md 4.1).

Where it sits: `ModelConfig.moe` (a MoEConfig) makes the feed-forward of every block, except the first with
`dense_first`, an `MoEFFN` (transformer.make_ffn); routing.py decides which tokens each expert takes and
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

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import Tensor, nn

from . import routing

if TYPE_CHECKING:
    from .config import ModelConfig

ROUTERS = ("et", "tc", "ec")
GATES = ("sigmoid", "softmax")
MLPS = ("relu2", "swiglu")
BALANCES = ("aux", "bias", "none")
EC_EVALS = ("threshold", "topk")


class MoEConfig(BaseModel):
    """Routed experts in every block's feed-forward (but the first, with dense_first). Defaults: the ET paper's."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    router: str = Field("et", description="et (expert threshold), tc (token choice top-k) or ec (expert "
                        "choice top-k over the micro-batch in training; see ec_eval for inference)")
    n_experts: int = Field(16, description="routed experts E")
    top_k: int = Field(1, description="routed experts per token: exactly for tc, on average for et and ec "
                       "(each expert takes k = ceil(tokens x top_k / E) tokens)")
    expert_dim: int | None = Field(None, description="hidden width of each expert (default 2 x d_model)")
    expert_mlp: str = Field("relu2", description="expert MLP: relu2 (ReLU squared) or swiglu")
    shared_expert: bool = Field(True, description="one always-on expert of the same type and width")
    dense_first: bool = Field(True, description="block 0 keeps the dense SwiGLU MLP of width ffn_dim")
    gate: str = Field("sigmoid", description="expert weight: sigmoid of its logit, or softmax over the experts")
    balance: str = Field("none", description="tc only: aux (Switch loss), bias (DeepSeek loss-free bias) or none")
    aux_loss_coef: float = Field(1e-3, description="tc aux: alpha in alpha * E * sum_i f_i P_i")
    bias_rate: float = Field(5e-3, description="tc bias: u in b_i += u * sign(mean load - load_i) per step")
    momentum: float = Field(0.999, description="et and ec: EMA momentum beta of the per-step cutoffs")
    warmup_steps: int = Field(4000, description="et: optimizer steps routed by expert choice before thresholds")
    capacity_factor: float = Field(0.5, description="et training: each expert takes between (1-C)k and (1+C)k "
                                   "tokens")
    ec_eval: str = Field("threshold", description="ec at inference: threshold (r >= its own EMA cutoff, "
                         "causal, as the ET paper evaluates EC) or topk (top-k over the micro-batch: non-causal)")

    @field_validator("router", "gate", "expert_mlp", "balance", "ec_eval")
    @classmethod
    def _choice(cls, v: str, info: Any) -> str:
        valid = {"router": ROUTERS, "gate": GATES, "expert_mlp": MLPS, "balance": BALANCES,
                 "ec_eval": EC_EVALS}[info.field_name]
        if v not in valid:
            raise ValueError(f"{info.field_name} {v!r} is not one of {', '.join(valid)}; pick one of them")
        return v

    @field_validator("n_experts", "top_k")
    @classmethod
    def _at_least_one(cls, v: int, info: Any) -> int:
        if v < 1:
            raise ValueError(f"{info.field_name} must be >= 1, got {v}; use at least one")
        return v

    @field_validator("expert_dim")
    @classmethod
    def _width(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"expert_dim must be a positive integer or omitted (= 2 x d_model), got {v}")
        return v

    @field_validator("capacity_factor", "aux_loss_coef", "bias_rate", "warmup_steps")
    @classmethod
    def _non_negative(cls, v: float, info: Any) -> float:
        if v < 0:
            raise ValueError(f"{info.field_name} must be >= 0, got {v}; use 0 to turn it off")
        return v

    @field_validator("momentum")
    @classmethod
    def _momentum(cls, v: float) -> float:
        if not 0 <= v < 1:
            raise ValueError(f"momentum must be in [0, 1), got {v}; the paper uses 0.999")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> MoEConfig:
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} exceeds n_experts={self.n_experts}; lower top_k or add experts")
        if self.balance != "none" and self.router != "tc":
            raise ValueError(f"balance={self.balance!r} applies to router 'tc' only; set balance to 'none' for "
                             f"router {self.router!r}")
        return self

    # -- sizes ---------------------------------------------------------------------------------------------
    def width(self, d_model: int) -> int:
        return self.expert_dim if self.expert_dim is not None else 2 * d_model

    def expert_params(self, d_model: int) -> int:
        return (3 if self.expert_mlp == "swiglu" else 2) * d_model * self.width(d_model)

    def ffn_params(self, d_model: int) -> int:
        """Parameters of one MoE feed-forward: router, routed experts, shared expert."""
        return d_model * self.n_experts + (self.n_experts + self.shared_expert) * self.expert_params(d_model)

    def layers(self, n_layers: int) -> range:
        """The blocks whose feed-forward is an MoE."""
        return range(1 if self.dense_first else 0, n_layers)


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
