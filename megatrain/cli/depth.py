"""`megatrain depth-matrix`: print DepthSSD's depth-mixing matrix M of a checkpoint or at init
(megatrain/runtime/depth_matrix.py computes it)."""

from __future__ import annotations

import argparse
import json

from megatrain.models import ModelConfig, load_model_config
from megatrain.models.depth import depthssd, parse_depth
from megatrain.runtime.depth_matrix import format_matrix, matrix_from_checkpoint, matrix_from_init


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    d = subparsers.add_parser("depth-matrix", help="print DepthSSD's depth-mixing matrix M (init or trained)",
                              description="Print the DepthSSD mixing matrix M, h_l = sum_i M[l,i] v_i, of a "
                              "checkpoint or of a model at init, with its semiseparable rank.")
    src = d.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="a checkpoint folder, or a --checkpoint-dir (the latest)")
    src.add_argument("--model", help="a preset or config: M at init")
    d.add_argument("--depth-mixing", metavar="SPEC", help="with --model: override its depth mixing (depthssd:N)")
    d.add_argument("--seed", type=int, default=0, help="with --model: the init seed (default 0)")
    d.add_argument("--json", action="store_true", help="print M and its rank as JSON")
    d.set_defaults(func=run_depth_matrix)


def run_depth_matrix(args: argparse.Namespace) -> int:
    if args.checkpoint:
        if args.depth_mixing:
            raise ValueError("--depth-mixing applies to --model; a checkpoint's depth mixing is its own")
        config, m, step = matrix_from_checkpoint(args.checkpoint)
        title = f"{config.name} ({config.depth_mixing}) after step {step}: M[l, i]"
    else:
        if not 0 <= args.seed < 2**63:
            raise ValueError(f"--seed must be an integer in [0, 2**63), got {args.seed}")
        config = load_model_config(args.model)
        if args.depth_mixing:
            config = ModelConfig(**{**config.model_dump(), "depth_mixing": args.depth_mixing})
        m = matrix_from_init(config, args.seed)
        title = f"{config.name} ({config.depth_mixing}) at init, seed {args.seed}: M[l, i]"
    n = parse_depth(config.depth_mixing).n
    if args.json:
        print(json.dumps({"model": config.name, "depth_mixing": config.depth_mixing, "rank_bound": n,
                          "semiseparable_rank": depthssd.semiseparable_rank(m, 1e-6),
                          "rows": ["h_" + str(r + 1) for r in range(m.shape[0] - 2)] + ["h_out"],
                          "matrix": m[1:, :-1].tolist()}))
    else:
        print(format_matrix(m, n, title), end="")
    return 0
