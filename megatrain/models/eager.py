"""The eager model: the units of units.py as one plain nn.Module, its initial weights and which of them
weight decay applies to (docs/DESIGN.md 4.1).

Where it sits: `build_eager(config)` gives an nn.Module with the same math and parameter names as the
streamed units: the ground truth of every exactness test. `init_weights` / `init_into` give the same values
parameter by parameter, so the host store initialises without building the model.
"""

from __future__ import annotations

import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import depth
from .config import ModelConfig
from .depth import denseformer
from .layers import StepInputs, packing, rope_tables
from .loss import IGNORE_INDEX
from .moe import reset_buffers
from .units import BlockUnit, EmbedUnit, HeadUnit, ffn_init_param


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
    (`<unit>.mix.*`, whatever their shape) do not, the usual convention of fine-tuning recipes, except
    DenseFormer's DWA weights, which its official code decays (models/depth/denseformer.py `decayed`)."""
    if denseformer.decayed(name):
        return True
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
