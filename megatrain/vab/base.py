"""Shared pieces of megatrain.vab: the frozen pydantic base model, the protocol names, letter labels.

Where it sits: imported by every other module of the VAB evaluation (docs/VAB.md). Values are frozen,
strict pydantic models that round-trip through JSON, like the IR of the training stack, but this package
does not import the training stack.

Try it: `python -c "from megatrain.vab.base import letters; print(letters(4))"`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from .errors import VabError

Protocol = Literal["pick_best", "pick_worst", "pick_best_and_worst"]

# How text answers are read and scored (prompts.parse_answer, metrics.build_report; docs/VAB.md):
# "official" as the official evaluator (comparable with published numbers), "strict" the stricter reading.
ParseMode = Literal["strict", "official"]
PARSE_MODES: tuple[ParseMode, ...] = ("official", "strict")
DEFAULT_PARSE: ParseMode = "official"

# Canonical order: pick_best runs first so that 2-image best+worst trials can be derived from it.
PROTOCOLS: tuple[Protocol, ...] = ("pick_best", "pick_worst", "pick_best_and_worst")

NUM_TRIALS = 3
MAX_IMAGES = 26


class VabModel(BaseModel):
    """Base of every VAB value: immutable, unknown fields rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def letters(n: int) -> tuple[str, ...]:
    """The presentation labels of `n` candidates: A, B, C, ..."""
    if not 1 <= n <= MAX_IMAGES:
        raise ValueError(f"cannot label {n} candidates; a set holds 1 to {MAX_IMAGES}")
    return tuple(chr(ord("A") + i) for i in range(n))


def parse_protocols(text: str) -> tuple[Protocol, ...]:
    """Protocols named in a comma list (`all` for the three), returned in canonical order."""
    names = {p.strip() for p in text.split(",") if p.strip()}
    if names == {"all"}:
        return PROTOCOLS
    unknown = sorted(names - set(PROTOCOLS))
    if unknown or not names:
        raise VabError(f"unknown protocol(s) {unknown or [text]}; use `all` or a comma list of {', '.join(PROTOCOLS)}")
    return tuple(p for p in PROTOCOLS if p in names)
