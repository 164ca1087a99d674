"""The command line's conventions, shared by `megatrain` and `megatrain-vab`: a parser whose usage errors are
one line, and `run`, which turns every error a user can cause into `error: <one line>` and exit code 2."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import re
import sys
import traceback
from collections.abc import Callable


class Parser(argparse.ArgumentParser):
    """No prefix matching (argparse would take `--step 5` as `--steps 5`, and a flag added later would silently
    change what an old command means); an unknown flag or verb gets the nearest known ones."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.register("type", int, integer)  # type=int and type=float read ASCII numbers only
        self.register("type", float, number)

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:  # the verb's parser knows its flags; the top parser, which reports them, does not
            parser = self._chosen(ns)
            unknown = [a.split("=", 1)[0] for a in extras if a.startswith("-")]
            hint = did_you_mean(unknown[0], parser._option_string_actions) if unknown else ""
            parser.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return ns

    def _chosen(self, ns) -> argparse.ArgumentParser:
        """The innermost parser `ns` went through (a verb's), or this one."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                sub = action.choices.get(getattr(ns, action.dest, None) or "")
                if sub is not None:
                    return sub._chosen(ns) if isinstance(sub, Parser) else sub
        return self

    def error(self, message: str):  # one line, exit 2 (argparse prints usage + message by default)
        choice = re.match(r"argument \S+: invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:
            message += did_you_mean(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")


_INTEGER = re.compile(r"[+-]?[0-9]+")
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[+-]?(inf|infinity|nan)", re.IGNORECASE)


def integer(text: str) -> int:
    """An integer flag's value in the digits 0-9: int() also reads other scripts' digits ("５" is 5) and 1_000."""
    if not _INTEGER.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; write it in the digits 0-9, e.g. 20")
    return int(text)


def number(text: str) -> float:
    """A number flag's value in ASCII (digits 0-9, a point, an exponent), as integer()."""
    if not _NUMBER.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; write it in the digits 0-9, e.g. 3e-4 or 0.1")
    return float(text)


def did_you_mean(word: str, choices) -> str:
    """"; did you mean X?" naming the known spellings nearest `word` (difflib), or "" when none is near."""
    near = difflib.get_close_matches(word, list(choices), n=2, cutoff=0.75)
    return f"; did you mean {' or '.join(near)}?" if near else ""


class UsageError(ValueError):
    pass


def _is_user_error(e: BaseException) -> bool:
    """Errors a user can cause and fix: bad input (ValueError, OSError) and device failures such as
    running out of device memory under a budget that is too small."""
    device = sys.modules.get("megatrain.runtime.stream_device")
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
    return _suggest(str(e).splitlines()[0]) if str(e) else type(e).__name__


# the stages' messages for a name that is not a preset, and where the known names are: the nearest is suggested
NAMED = ((r"unknown model preset '([^']*)'", "megatrain.models.presets"),
         (r"unknown hardware '([^']*)'", "megatrain.planner.hardware"))


def _suggest(line: str) -> str:
    """`line` with "(did you mean X?)" after an unknown preset's name, when a preset's name is near it."""
    import importlib

    for pattern, module in NAMED:
        m = re.search(pattern, line)
        if m:
            hint = did_you_mean(m.group(1), importlib.import_module(module).PRESETS)
            if hint:
                return f"{line[:m.end()]} ({hint.removeprefix('; ')}){line[m.end():]}"
    return line


def run(build: Callable[[], argparse.ArgumentParser], argv: list[str]) -> int:
    """Parse `argv` with the parser `build` makes and run its verb, with the error convention above."""
    debug = "--debug" in argv
    try:
        parser = build()
        args = parser.parse_args(argv)
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
