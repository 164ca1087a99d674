"""A LLaMA-style decoder split into streaming units (docs/DESIGN.md 4.1).

Where it sits: `templates(config)` gives the stateless unit templates (built on the meta device, one per
distinct structure) that tracing (ir/trace.py) and the runtime run with `run_unit`, bound to views of flat
parameter buffers (ir/layout.py); eager.py assembles the same units into one nn.Module.

Units and their carries: `embed` () -> (h,); `blocks.{i}` (h,) -> (h,); `head` (h,) -> (loss_sum,).
h is (B, T, d) in the compute dtype. A unit's parameter named `p` is `"{unit}.{p}"` in the eager model. The
head is the final RMSNorm, the LM head and a chunked cross-entropy (loss.py) returning the *sum* of token
losses in fp32; tiled, it runs its final norm inside the loss's chunks.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call

from . import depth
from .config import ModelConfig
from .layers import MLP, Attention, Carry, RMSNorm, StepInputs
from .loss import chunked_cross_entropy
from .moe import MoEFFN


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
                return self.mlp.tiled_forward(h, self.post_attention_layernorm, chunk, recompute)
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


def run_unit(template: nn.Module, params: dict[str, Tensor], carry: Carry, inputs: StepInputs,
             buffers: dict[str, Tensor] | None = None, **mode) -> Carry:
    """Run a template with bound parameters (and buffers) through torch.func.functional_call. `mode` goes to
    the template's forward (a depth mixing's record/side/rebuild, models/depth/depthssd.py)."""
    bound = params if not buffers else {**params, **buffers}
    return functional_call(template, bound, (carry, inputs), mode, strict=True)
