"""JSON Lines input and output with line-numbered errors, and the durable append used by resumable runs.

Where it sits: tasks.py, judges.py (score files), agreement.py (human labels) and runner.py (results)
read through `read_models`; runner.py appends through `append_line`. A pydantic validation error is
turned into a VabError that names the file, the line and the field.

Try it: `python -c "from megatrain.vab.jsonl import iter_json_lines; print(list(iter_json_lines('x.jsonl')))"`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TypeVar

from pydantic import BaseModel, ValidationError

from megatrain.files import atomic_open, json_lines

from .errors import VabError

MAX_JSONL_BYTES = 1 << 30  # a task, score, label or results file past 1 GiB is not one a person made

M = TypeVar("M", bound=BaseModel)


def iter_json_lines(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a missing file or bad JSON is a VabError."""
    path = Path(path)
    if not path.exists():
        raise VabError(f"{path}: no such file; check the path")
    for lineno, obj in json_lines(path, "a JSON Lines file", VabError, MAX_JSONL_BYTES):
        if not isinstance(obj, dict):
            raise VabError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}; "
                           "write one JSON object per line")
        yield lineno, obj


def describe_validation_error(exc: ValidationError) -> str:
    """The first problem of a pydantic error as `field 'x': message` (just the message for a whole-record check)."""
    err = exc.errors()[0]
    where = ".".join(str(part) for part in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    extra = f" ({len(exc.errors()) - 1} more problems)" if len(exc.errors()) > 1 else ""
    return f"field '{where}': {msg}{extra}" if where else f"{msg}{extra}"


def validate_line(model: type[M], obj: dict, path: str | Path, lineno: int, fix: str) -> M:
    """`model` built from one line's object; a validation failure names the file, line, field and fix."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise VabError(f"{path}:{lineno}: {describe_validation_error(exc)}; {fix}") from None


def read_models(path: str | Path, model: type[M], fix: str) -> list[tuple[int, M]]:
    """Every line of `path` validated as `model`, with its line number."""
    return [(lineno, validate_line(model, obj, path, lineno, fix)) for lineno, obj in iter_json_lines(path)]


def write_models(path: str | Path, values: list[BaseModel]) -> None:
    """Write `values` as JSON Lines, replacing the file atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "w") as fh:  # a failure leaves the previous file whole
        for value in values:
            fh.write(value.model_dump_json(exclude_none=True) + "\n")


def append_line(fh: IO[str], value: BaseModel, fsync: bool = True) -> None:
    """Append one JSON line and make it durable: a kill after this returns cannot lose the line."""
    fh.write(value.model_dump_json() + "\n")
    fh.flush()
    if fsync:
        os.fsync(fh.fileno())
