"""Run files: `megatrain train --config run.toml` holds every train setting; flags on the command line win.

Where it sits: the CLI (megatrain/cli/__init__.py) calls `expand` before parsing, which turns the file into
the flags it stands for, placed before the user's own (argparse keeps the last value of a flag, so a flag
given on the command line overrides the file). After parsing, `effective_settings(args)` is what the run
actually uses: `megatrain train` prints it at start, as TOML a run file can hold, and every checkpoint's
manifest saves it. Run its tests: `.venv/bin/pytest tests/runtime/test_runfile.py`.

A key is a train flag without its dashes (`gpu-mem` or `gpu_mem`); tables only group keys and are not
part of their names, so these two files mean the same:

    model = "llama3-8b-instruct/"          model = "llama3-8b-instruct/"
    gpu-mem = "40GiB"                      [budget]
    lr = 1e-5                              gpu_mem = "40GiB"
                                           [optimizer]
                                           lr = 1e-5

Values are TOML's: strings, numbers, booleans (`pack = false` is `--no-pack`), and lists for flags that
take a comma-separated list (`betas = [0.9, 0.95]`). An unknown key, a table inside a table, a value of the
wrong type, or a file that is not a small regular TOML file is refused in one line naming the file and key.
"""

from __future__ import annotations

import argparse
import math
import tomllib
from pathlib import Path

from megatrain.files import read_regular

MAX_BYTES = 1 << 20
_NOT_SETTINGS = {"func", "debug", "command", "config", "help"}


def _read(path: Path) -> dict:
    raw = read_regular(path, MAX_BYTES, "a run file (TOML)")
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"--config {path}: not valid TOML ({' '.join(str(e).split())[:160]})") from None


def _flatten(data: dict, path: Path) -> dict:
    flat: dict = {}
    for key, value in data.items():
        items = value.items() if isinstance(value, dict) else [(key, value)]
        for k, v in items:
            if isinstance(v, dict):
                raise ValueError(f"--config {path}: [{key}.{k}] nests a table in a table; tables only group "
                                 "settings, one level deep")
            name = k.replace("_", "-")
            if name in flat:
                raise ValueError(f"--config {path}: {k} is set twice")
            flat[name] = v
    return flat


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s[2:]: a for a in parser._actions for s in a.option_strings if s.startswith("--")}


def expand(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` (after the subcommand) with `--config FILE` replaced by the flags the file sets, placed first."""
    rest, path = [], None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg.startswith("--config="):
            if path is not None:
                raise ValueError("--config is given twice; pass one run file")
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else None)
            if not value:
                raise ValueError("--config needs a run file, e.g. --config run.toml")
            path = Path(value)
            i += 1 if "=" in arg else 2
            continue
        rest.append(arg)
        i += 1
    if path is None:
        return argv
    options = _options(parser)
    flags: list[str] = []
    for name, value in _flatten(_read(path), path).items():
        action = options.get(name)
        if action is None or name in _NOT_SETTINGS:
            valid = ", ".join(n for n in options if n not in _NOT_SETTINGS and not n.startswith("no-"))
            raise ValueError(f"--config {path}: unknown setting {name!r}; valid settings: {valid}")
        flags += _flag(name, value, action, path)
    return flags + rest


def _flag(name: str, value, action: argparse.Action, path: Path) -> list[str]:
    where = f"--config {path}: {name}"
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false (a TOML boolean, unquoted), got {value!r}")
        return [f"--{name}" if value else f"--no-{name}"]
    if action.nargs == 0:  # store_true
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false (a TOML boolean, unquoted), got {value!r}")
        return [f"--{name}"] if value else []
    if isinstance(value, list):
        if not value or not all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in value):
            raise ValueError(f"{where}: a list must hold numbers or strings, e.g. [0.9, 0.95]")
        text = ",".join(str(v) for v in value)
    elif isinstance(value, bool) or isinstance(value, dict) or value is None:
        raise ValueError(f"{where}: expected a {'number' if action.type in (int, float) else 'string'}, got {value!r}")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: {value} is not a finite number")
    else:
        text = str(value)
    if text == "":
        raise ValueError(f"{where}: an empty value; remove the key to use the default")
    if action.type is not None:
        try:
            action.type(text)
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            kind = getattr(action.type, "__name__", "value")
            raise ValueError(f"{where}: {value!r} is not a valid {kind}") from None
    if action.choices is not None and text not in action.choices:
        raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return [f"--{name}", text]


def effective_settings(args: argparse.Namespace) -> dict:
    """The settings a parsed train command runs with, by flag name (unset optional values left out)."""
    return {k.replace("_", "-"): v for k, v in vars(args).items() if k not in _NOT_SETTINGS and v is not None}

