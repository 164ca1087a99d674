"""Depth mixing: how each sub-layer's input is read from, and its output written to, the depth state that
the units carry (docs/DESIGN.md 4.1). Selected by `ModelConfig.depth_mixing` (spec.py).

- residual (no mixer): h += f(h). The state is h.
- denseformer.py: DenseFormer's depth-weighted averages over block outputs (with dilation and period).
- hyper_connections.py: n streams with static or dynamic width/depth connections.
- attnres.py: Block AttnRes, a pseudo-query softmax over RMS-normed block summaries.
- depthssd.py: DepthSSD-N, a rank-N state per token with scalar decay (recurrent in the units; the dual
  form builds the mixing matrix M).

Each variant gives an embed mixer (v0 -> carry), a block mixer (carry, (attn, ffn) -> carry) and a head
mixer (carry -> the final norm's input); `block_key` names how a block's structure differs from others
(it picks the block's template).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor, nn

from .spec import RANKS, DepthSpec, parse_depth

if TYPE_CHECKING:
    from megatrain.models.config import ModelConfig


def _module(spec: DepthSpec):
    if spec.kind == "denseformer":
        from . import denseformer as m
    elif spec.kind in ("hc", "hc-dynamic"):
        from . import hyper_connections as m
    elif spec.kind == "attnres":
        from . import attnres as m
    elif spec.kind == "depthssd":
        from . import depthssd as m
    else:
        return None
    return m


def spec_of(config: ModelConfig) -> DepthSpec:
    return parse_depth(config.depth_mixing)


def embed_mixer(config: ModelConfig) -> nn.Module | None:
    m = _module(spec_of(config))
    return None if m is None else m.EmbedMixer(config, spec_of(config))


def block_mixer(config: ModelConfig, layer: int) -> nn.Module | None:
    m = _module(spec_of(config))
    return None if m is None else m.BlockMixer(config, spec_of(config), layer)


def head_mixer(config: ModelConfig) -> nn.Module | None:
    m = _module(spec_of(config))
    return None if m is None else m.HeadMixer(config, spec_of(config))


def block_key(config: ModelConfig, layer: int) -> str:
    m = _module(spec_of(config))
    return "" if m is None else m.block_key(config, spec_of(config), layer)


def init_param(config: ModelConfig, name: str, shape: tuple[int, ...], g) -> Tensor | None:
    """The initial value of a depth-mixing parameter (eager name `<unit>.mix.<path>`), else None."""
    m = _module(spec_of(config))
    if m is None or ".mix." not in name:
        return None
    return m.init_param(config, spec_of(config), name, shape, g)


__all__ = ["RANKS", "DepthSpec", "block_key", "block_mixer", "embed_mixer", "head_mixer", "init_param", "parse_depth", "spec_of"]
