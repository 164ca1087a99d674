"""The `megatrain` command line: one subcommand per verb of the pipeline, a module per verb group.

Where it sits: the front door, on top of every stage. `megatrain --help` lists the verbs; each module of this
package registers its verbs (`add_parser(subparsers)`): inspect.py, plan.py (plan, tune, probe), train.py
(train, compile, export), data.py (prepare), report.py (report), depth.py (depth-matrix); common.py holds
the flags they share. The VAB protocol has its own command, `megatrain-vab` (vab.py), outside this help.

Every error a user can cause (a bad flag, an unknown preset, an impossible budget) is a ValueError with a
one-line message naming the cause and the fix; `run` prints it as `error: ...` with exit code 2 and no
traceback (`--debug` shows it). This module imports no stage at import time, so `megatrain-vab` and
`--help` stay light.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import traceback
from collections.abc import Callable

from megatrain import __version__

VERBS = ("inspect", "plan", "train", "data", "report", "depth")  # the modules that register verbs, help order


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage + message by default)
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")


class UsageError(ValueError):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="megatrain", description="Train language models far larger than GPU memory on one GPU: "
                    "trace, plan, compile and run a streamed training step.")
    parser.add_argument("--version", action="version", version=f"megatrain {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in VERBS:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    return parser


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


def run(build: Callable[[], argparse.ArgumentParser], argv: list[str],
        expand: Callable[[argparse.ArgumentParser, list[str]], list[str]] | None = None) -> int:
    """Parse `argv` with the parser `build` makes and run its verb, with the error convention above."""
    debug = "--debug" in argv
    try:
        parser = build()
        args = parser.parse_args(expand(parser, argv) if expand else argv)
        if not getattr(args, "func", None):
            parser.print_help()
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verb = next((a for a in argv if not a.startswith("-")), None)
    if verb == "vab":  # its former spelling: still runs, and says where it went
        print("megatrain: `megatrain vab ...` is now its own command, `megatrain-vab ...`", file=sys.stderr)
        from .vab import main as vab_main

        at = argv.index(verb)
        return vab_main(argv[:at] + argv[at + 1:])
    return run(build_parser, argv, _run_file)


if __name__ == "__main__":
    sys.exit(main())
