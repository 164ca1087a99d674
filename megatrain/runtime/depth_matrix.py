"""`megatrain depth-matrix`: the DepthSSD mixing matrix M of a model, at init or from a checkpoint.

Where it sits: reads parameters (models/depth/depthssd.py builds M from them, the dual form) and prints M
as a table and a shaded map, with its numerical semiseparable rank, which is at most N. Try it:
`megatrain depth-matrix --model tiny --depth-mixing depthssd:4` or `megatrain depth-matrix --checkpoint DIR`.

M[l, i] is how much sub-layer l's input (row; the last row is the head's input) takes from source i (column;
v_0 is the embedding, v_i sub-layer i's output): h_l = Σ_{i<l} M[l, i] v_i. The residual model's M is all ones.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatrain.models import ModelConfig, init_weights
from megatrain.models.depth import depthssd, parse_depth

SHADES = " .:-=+*#%@"


def _check(config: ModelConfig) -> None:
    if parse_depth(config.depth_mixing).kind != "depthssd":
        raise ValueError(f"{config.name} mixes depth with {config.depth_mixing}; depth-matrix shows DepthSSD's M "
                         "(use a depthssd model, or --depth-mixing depthssd:N with --model)")


def matrix_from_init(config: ModelConfig, seed: int = 0) -> torch.Tensor:
    _check(config)
    return depthssd.model_mixing_matrix(init_weights(config, seed, _mix_names(config)), config.n_layers)


def _mix_names(config: ModelConfig) -> list[str]:
    return ["embed.mix.B", *(f"blocks.{i}.mix.{p}" for i in range(config.n_layers) for p in ("theta", "B", "C")),
            "head.mix.C"]


def matrix_from_checkpoint(path: str | Path) -> tuple[ModelConfig, torch.Tensor, int]:
    """(config, M, step) from a checkpoint folder (or the latest one under a --checkpoint-dir)."""
    from .checkpoint import find_checkpoint, read_manifest
    from .sharded_checkpoint import read_masters

    ckpt = find_checkpoint(path)
    manifest = read_manifest(ckpt)
    config = ModelConfig.model_validate(manifest["model"])
    _check(config)
    named: dict[str, torch.Tensor] = {}
    for unit in manifest["units"]:
        named.update({n: t for n, t in read_masters(ckpt, manifest, unit).items() if ".mix." in n})
    return config, depthssd.model_mixing_matrix(named, config.n_layers), int(manifest["step"])


def format_matrix(m: torch.Tensor, rank_bound: int, title: str) -> str:
    """Rows h_1..h_L, h_out; columns v_0..v_L: values, then a shaded map of |M| (darker = larger)."""
    body = m[1:, :-1]
    L = body.shape[0] - 1
    rows = [f"h_{r + 1}" if r < L else "h_out" for r in range(L + 1)]
    lines = [title, f"semiseparable rank {depthssd.semiseparable_rank(m, 1e-6)} (at most N = {rank_bound})", ""]
    width = 7
    lines.append(" " * 6 + "".join(f"{'v_' + str(i):>{width}}" for i in range(L + 1)))
    for r, name in enumerate(rows):
        cells = [f"{float(body[r, i]):>{width}.3f}" if i <= r else " " * width for i in range(L + 1)]
        lines.append(f"{name:<6}" + "".join(cells))
    top = float(body.abs().max()) or 1.0
    lines += ["", f"|M| shaded ({SHADES[1]} small .. {SHADES[-1]} {top:.3g}):"]
    for r, name in enumerate(rows):
        shade = "".join(SHADES[min(len(SHADES) - 1, round(float(body[r, i].abs()) / top * (len(SHADES) - 1)))]
                        if i <= r else " " for i in range(L + 1))
        lines.append(f"{name:<6}{shade}")
    return "\n".join(lines) + "\n"
