"""Run files: `megatrain train --config run.toml` holds a run's settings; flags on the command line win.

Where it sits: `megatrain train` (cli/train.py) reads the file into settings with `read_run_file`, lays the
flags given on the command line over them and builds the RunConfig (config.py) with `from_settings`. What the
run prints at start (`settings: ...`) and every checkpoint's manifest stores is `RunConfig.settings()`: the
same names and values, so the manifest's settings written as TOML are a run file of the same run. Run its
tests: `.venv/bin/pytest tests/runtime/test_runfile.py`.

A key is a setting's name, the train flag without its dashes (`gpu-mem` or `gpu_mem`); tables only group
keys and are not part of their names, so these two files mean the same:

    model = "llama3-8b-instruct/"          model = "llama3-8b-instruct/"
    gpu-mem = "40GiB"                      [budget]
    lr = 1e-5                              gpu_mem = "40GiB"
                                           [optimizer]
                                           lr = 1e-5

Values are TOML's: strings, numbers, booleans (`pack = false` is `--no-pack`), and lists where a setting
holds several values (`betas = [0.9, 0.95]`). An unknown key, a table inside a table, a value of the wrong
type, or a file that is not a small regular TOML file is refused in one line naming the file and key; the
ranges are RunConfig's to check.

Paths in a run file (data, checkpoint-dir, a model folder or config file, a hardware profile, ...) are the
file's: a relative one is taken from the run file's folder, not from wherever the command runs, and `~` is
the home folder, as in a shell.
"""

from __future__ import annotations

import math
import tomllib
import types
import typing
from pathlib import Path

from megatrain.files import read_regular

from .config import PATHS, SIZES, schema, setting

MAX_BYTES = 1 << 20


def read_run_file(path: str | Path) -> dict:
    """The settings run file `path` holds, by underscored name, each value of its setting's type."""
    path = Path(path)
    raw = read_regular(path, MAX_BYTES, "a run file (TOML)")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"--config {path}: not valid TOML ({' '.join(str(e).split())[:160]})") from None
    known = schema()
    out: dict = {}
    for key, value in data.items():
        items = value.items() if isinstance(value, dict) else [(key, value)]
        for k, v in items:
            if isinstance(v, dict):
                raise ValueError(f"--config {path}: [{key}.{k}] nests a table in a table; tables only group "
                                 "settings, one level deep")
            name = k.replace("-", "_")
            if name not in known:
                raise ValueError(f"--config {path}: unknown setting {setting(name)!r}; valid settings: "
                                 f"{', '.join(setting(n) for n in known)}")
            if name in out:
                raise ValueError(f"--config {path}: {k} is set twice")
            out[name] = _value(v, name, known[name], f"--config {path}: {setting(name)}")
            if name in (*PATHS, "model", "hardware") and isinstance(out[name], str):
                out[name] = _path(out[name], name, path.parent)
    return out


def _path(value: str, name: str, folder: Path) -> str:
    """A path of the run file in `folder`: `~` expanded, a relative one taken from `folder`. A model or
    hardware preset's name (tiny, h100-sxm, auto) is a name, not a path, and so is a word naming no file."""
    expanded = Path(value).expanduser()
    if name in ("model", "hardware") and (value in _presets(name) or not (
            "/" in value or value.startswith("~") or expanded.suffix.lower() in (".json", ".toml")
            or (folder / expanded).exists())):
        return value  # a preset's name, or what no file is: load_model_config / resolve_hardware say so
    return str(expanded if expanded.is_absolute() else folder / expanded)


def _presets(name: str):
    if name == "model":
        from megatrain.models.presets import PRESETS
    else:
        from megatrain.planner.hardware import PRESETS
    return (*PRESETS, "auto")


def _value(value, name: str, annotation, where: str):
    """`value` checked against its setting's type (a bool, an integer, a number, one of some choices, a list
    of numbers, a size or a string) and converted where TOML spells it otherwise (a number in a string)."""
    kinds = [a for a in typing.get_args(annotation) if a is not type(None)] if _union(annotation) else [annotation]
    kind = kinds[0]
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false (a TOML boolean, unquoted), got {value!r}")
        return value
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{where}: expected a {'number' if kind in (int, float) else 'string'}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: {value} is not a finite number")
    if value == "":
        raise ValueError(f"{where}: an empty value; remove the key to use the default")
    if typing.get_origin(kind) is tuple:
        if isinstance(value, str):
            value = value.split(",")
        if not isinstance(value, list) or not all(isinstance(v, str | int | float) and not isinstance(v, bool)
                                                  for v in value):
            raise ValueError(f"{where}: a list must hold numbers, e.g. [0.9, 0.95]")
        try:
            return tuple(float(v) for v in value)
        except ValueError:
            raise ValueError(f"{where}: {value!r} is not a list of numbers") from None
    if isinstance(value, list):
        raise ValueError(f"{where}: expected one value, not a list")
    if typing.get_origin(kind) is typing.Literal:
        if value not in typing.get_args(kind) and name != "dtype":  # dtype also takes bf16, fp32: TrainSpec's
            raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(str, typing.get_args(kind)))}")
        return value
    if name in SIZES:
        return value
    if kind in (int, float):
        if isinstance(value, str) and not (value.isascii() and "_" not in value):
            raise ValueError(f"{where}: {value!r} is not a valid {kind.__name__}; write it in the digits 0-9")
        try:
            return kind(str(value))  # int("2.5") is refused, int(2.5) would not be
        except ValueError:
            raise ValueError(f"{where}: {value!r} is not a valid {kind.__name__}") from None
    return str(value)


def _union(annotation) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)
