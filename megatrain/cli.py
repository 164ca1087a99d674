"""The `megatrain` command line: one subcommand per verb of the pipeline.

Where it sits: the front door. `megatrain --help` lists the verbs. Every error a user can cause (a bad flag,
an unknown preset, an impossible budget) is a ValueError with a one-line message naming the cause and the
fix; it is printed as `error: ...` with exit code 2 and no traceback (`--debug` shows it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback

from megatrain import __version__


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage + message by default)
        raise _UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")


class _UsageError(ValueError):
    pass


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="trace a model and print its per-unit table",
                       description="Trace a model on the meta device (no weight memory) and print per unit: "
                                   "parameters, FLOPs per token, bytes saved for backward, carry bytes.")
    p.add_argument("--model", required=True, help="preset name (e.g. tiny, llama3-70b) or a .json/.toml config")
    p.add_argument("--seq-len", type=_positive_int, default=None, help="tokens per sequence (default: 2048 "
                   "or the model's max_seq_len, whichever is smaller)")
    p.add_argument("--micro-batch", type=_positive_int, default=1, help="sequences per micro-batch")
    p.add_argument("--dtype", default="bf16", help="compute dtype: bf16 or fp32")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--depth-mixing", metavar="SPEC", help="override the model's depth mixing: residual, "
                   "denseformer[:KxP], hc[:n], hc-dynamic[:n], attnres[:NB] or depthssd[:N]")
    p.set_defaults(func=_cmd_inspect)


def _cmd_inspect(args) -> int:
    from megatrain.ir.display import format_model_ir
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="megatrain", description="Train language models far larger than GPU memory on one GPU: "
                     "trace, plan, compile and run a streamed training step.")
    parser.add_argument("--version", action="version", version=f"megatrain {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_inspect(sub)
    for module in COMMAND_MODULES:
        module.add_parser(sub)
    return parser


def _command_modules() -> list:
    import importlib

    names = ["megatrain.planner.cli", "megatrain.runtime.cli", "megatrain.runtime.report", "megatrain.evals.cli"]
    mods = []
    for name in names:
        try:
            mods.append(importlib.import_module(name))
        except ModuleNotFoundError as e:
            if e.name != name:  # a real import error inside the module: surface it
                raise
    return mods


COMMAND_MODULES = _command_modules()


def _is_user_error(e: BaseException) -> bool:
    """Errors a user can cause and fix: bad input (ValueError, OSError) and device failures such as
    running out of device memory under a budget that is too small."""
    device = sys.modules.get("megatrain.runtime.device")
    device_errors = (device.DeviceError, device.DeviceOutOfMemory) if device else ()
    dist = sys.modules.get("megatrain.runtime.distributed")
    peer_errors = (dist.PeerFailure,) if dist else ()  # another rank failed: this one names it and stops
    return isinstance(e, (ValueError, OSError, *device_errors, *peer_errors))


def _message(e: BaseException) -> str:
    """One line for a user error. A pydantic ValidationError's own first line only counts its errors: name the
    value, the field and what it accepts instead."""
    errors = getattr(e, "errors", None)
    if callable(errors) and type(e).__name__ == "ValidationError" and errors():
        first = errors()[0]
        field = ".".join(str(x) for x in first.get("loc", ()))
        got = repr(first["input"])[:60] if "input" in first and not isinstance(first["input"], dict) else None
        return (f"{getattr(e, 'title', 'value')}: {field + ': ' if field else ''}"
                f"{first['msg'].removeprefix('Value error, ')}" + (f" (got {got})" if got else ""))
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _run_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`megatrain train --config run.toml ...`: the run file's settings as flags before the user's own."""
    cmd = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if cmd is None or argv[cmd] != "train" or not any(a == "--config" or a.startswith("--config=") for a in argv):
        return argv
    from megatrain.runtime.runfile import expand

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    return [*argv[:cmd + 1], *expand(argv[cmd + 1:], sub)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        parser = build_parser()
        args = parser.parse_args(_run_file(parser, argv))
        if not getattr(args, "func", None):
            build_parser().print_help()
            return 0
        return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader of our output went away (`| head`): nothing left to say, as cat does
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141
    except Exception as e:
        if not _is_user_error(e):
            raise
        if debug:
            traceback.print_exc()
        print(f"error: {_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
