"""`megatrain inspect`: trace a model on the meta device and print its per-unit table."""

from __future__ import annotations

import argparse
import json

from megatrain.models.depth.spec import FORMS


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="trace a model and print its per-unit table",
                       description="Trace a model on the meta device (no weight memory) and print per unit: "
                                   "parameters, FLOPs per token, bytes saved for backward, carry bytes.")
    p.add_argument("--model", required=True, help="preset name (e.g. tiny, llama3-70b) or a .json/.toml config")
    p.add_argument("--seq-len", type=_positive_int, default=None, help="tokens per sequence (default: 2048 "
                   "or the model's max_seq_len, whichever is smaller)")
    p.add_argument("--micro-batch", type=_positive_int, default=1, help="sequences per micro-batch")
    p.add_argument("--dtype", default="bf16", help="compute dtype: bf16 or fp32")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--depth-mixing", metavar="SPEC", help="override the model's depth mixing: " + FORMS)
    p.set_defaults(func=_cmd_inspect)


def _cmd_inspect(args) -> int:
    from megatrain.ir.model_ir import format_model_ir
    from megatrain.ir.trace import trace
    from megatrain.models import load_model_config

    config = load_model_config(args.model)
    if args.depth_mixing:
        from megatrain.planner.depth_rank import with_depth

        config = with_depth(config, args.depth_mixing)
    seq = args.seq_len or min(2048, config.max_seq_len)
    ir = trace(config, args.micro_batch, seq, args.dtype)
    if args.json:
        print(json.dumps(inspect_json(ir)))
    else:
        print(format_model_ir(ir), end="")
    return 0


def inspect_json(ir) -> dict:
    return {
        "model": ir.model, "params_total": ir.params_total, "micro_batch": ir.micro_batch,
        "seq_len": ir.seq_len, "dtype": ir.dtype, "depth_mixing": ir.config.get("depth_mixing", "residual"),
        "traced_seq_len": ir.traced_seq_len, "chunk_tokens": ir.chunk_tokens,
        "flops_fwd": sum(u.flops_fwd for u in ir.units), "flops_bwd": sum(u.flops_bwd for u in ir.units),
        "units": [
            {"name": u.name, "params": u.n_params, "param_bytes": u.param_bytes(ir.dtype),
             "flops_fwd": u.flops_fwd, "flops_bwd": u.flops_bwd, "saved_bytes": u.saved_bytes,
             "carry_in_bytes": u.carry_in_bytes, "carry_out_bytes": u.carry_out_bytes,
             "rebuild_bytes": u.rebuild_bytes,
             "peak_fwd_bytes": u.peak_fwd_bytes, "peak_bwd_bytes": u.peak_bwd_bytes,
             "attn_flops_fwd": u.attn_flops_fwd, "chunk_options": [o.model_dump() for o in u.chunk_options]}
            for u in ir.units
        ],
    }
