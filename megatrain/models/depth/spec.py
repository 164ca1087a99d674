"""Parsing `depth_mixing` specs: "residual", "denseformer[:KxP]", "hc[:n]", "hc-dynamic[:n]",
"attnres[:NB]", "depthssd[:N]". No torch here: the config validator imports it."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("residual", "denseformer", "hc", "hc-dynamic", "attnres", "depthssd")
DEFAULTS = {"hc": 4, "hc-dynamic": 4, "attnres": 8, "depthssd": 8}
RANKS = (1, 2, 4, 8, 16)  # the DepthSSD ranks `--depth-rank auto` chooses among
MAX_RANK = 64


@dataclass(frozen=True)
class DepthSpec:
    kind: str
    n: int = 1  # DepthSSD rank N, Hyper-Connections streams n, Block AttnRes blocks NB
    dilation: int = 1  # DenseFormer k
    period: int = 1  # DenseFormer p

    def __str__(self) -> str:
        if self.kind == "residual":
            return "residual"
        if self.kind == "denseformer":
            return f"denseformer:{self.dilation}x{self.period}"
        return f"{self.kind}:{self.n}"


def parse_depth(spec: str) -> DepthSpec:
    """A DepthSpec from its string; ValueError naming the accepted forms otherwise."""
    forms = "residual, denseformer[:KxP], hc[:n], hc-dynamic[:n], attnres[:NB] or depthssd[:N]"
    kind, _, arg = str(spec).strip().lower().partition(":")
    if kind not in KINDS:
        raise ValueError(f"unknown depth mixing {spec!r}; use {forms}")
    try:
        if kind == "residual":
            if arg:
                raise ValueError
            return DepthSpec("residual")
        if kind == "denseformer":
            k, _, p = (arg or "1x1").partition("x")
            out = DepthSpec("denseformer", dilation=int(k), period=int(p or 1))
            if out.dilation < 1 or out.period < 1:
                raise ValueError
            return out
        n = int(arg) if arg else DEFAULTS[kind]
    except ValueError:
        raise ValueError(f"malformed depth mixing {spec!r}; use {forms}, e.g. depthssd:8 or denseformer:2x1") from None
    if not 1 <= n <= MAX_RANK:
        raise ValueError(f"depth mixing {spec!r}: the number must be between 1 and {MAX_RANK}, got {n}")
    return DepthSpec(kind, n=n)
