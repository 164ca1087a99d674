"""The `megatrain` command line: one subcommand per verb of the pipeline, a module per verb group.

Where it sits: the front door, on top of every stage. `megatrain --help` lists the verbs; each module of this
package registers its verbs (`add_parser(subparsers)`): inspect.py, plan.py (plan, tune, probe), train.py
(train, compile, export), data.py (prepare), report.py (report), depth.py (depth-matrix); common.py holds
the flags they share. The VAB protocol has its own command, `megatrain-vab` (vab.py), outside this help.

Every error a user can cause (a bad flag, an unknown preset, an impossible budget) is a ValueError with a
one-line message naming the cause and the fix; `run` (app.py) prints it as `error: ...` with exit code 2 and no
traceback (`--debug` shows it). This module imports no stage at import time, so `megatrain-vab` and
`--help` stay light.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megatrain import __version__

from .app import Parser, run

VERBS = ("inspect", "plan", "train", "data", "report", "depth")  # the modules that register verbs, help order


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="megatrain", description="Train language models far larger than GPU memory on one GPU: "
                    "trace, plan, compile and run a streamed training step.")
    parser.add_argument("--version", action="version", version=f"megatrain {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in VERBS:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verb = next((a for a in argv if not a.startswith("-")), None)
    if verb == "vab":  # its former spelling: still runs, and says where it went
        print("megatrain: `megatrain vab ...` is now its own command, `megatrain-vab ...`", file=sys.stderr)
        from .vab import main as vab_main

        at = argv.index(verb)
        return vab_main(argv[:at] + argv[at + 1:])
    return run(build_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
