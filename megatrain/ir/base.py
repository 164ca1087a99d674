"""Base class of every IR value: frozen, strict pydantic models that round-trip through JSON.

Where it sits: ir/ is the contract between tracing (ir/trace.py), the planner (planner/) and codegen.
Changes go through `replace()`, which re-validates; pydantic's `model_copy(update=...)` does not.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

T = TypeVar("T", bound="IRModel")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1, "bool": 1}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named as in torch (`float32`, `bfloat16`, ...)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}") from None


class IRModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def replace(self: T, **changes: Any) -> T:
        """A copy with `changes` applied, validated like a freshly built value."""
        data = {name: getattr(self, name) for name in type(self).model_fields}
        data.update(changes)
        return type(self).model_validate(data)

    def to_json(self, indent: int | None = None) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls: type[T], text: str | bytes) -> T:
        return cls.model_validate_json(text)
