"""Parsing `depth_mixing` specs: "residual", "denseformer[:KxP]", "hc[:n]", "hc-dynamic[:n]",
"attnres[:NB]", "depthssd[:N][:chunk=K]". No torch here: the config validator imports it."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("residual", "denseformer", "hc", "hc-dynamic", "attnres", "depthssd")
DEFAULTS = {"hc": 4, "hc-dynamic": 4, "attnres": 8, "depthssd": 8}
RANKS = (1, 2, 4, 8, 16)  # the DepthSSD ranks `--depth-rank auto` chooses among
MAX_RANK = 64
# DepthSSD sub-layers per state read (depthssd.py): 2 reads the state once per block for both of its sub-layers
# (the measured default, docs/RESULTS.md); 1 reads and writes it around every sub-layer. A group cannot span
# blocks: the later block's read coefficients are its own unit's parameters.
CHUNKS = (1, 2)
DEFAULT_CHUNK = 2
FORMS = "residual, denseformer[:KxP], hc[:n], hc-dynamic[:n], attnres[:NB] or depthssd[:N][:chunk=K]"


@dataclass(frozen=True)
class DepthSpec:
    kind: str
    n: int = 1  # DepthSSD rank N, Hyper-Connections streams n, Block AttnRes blocks NB
    dilation: int = 1  # DenseFormer k
    period: int = 1  # DenseFormer p
    chunk: int = DEFAULT_CHUNK  # DepthSSD sub-layers per state read

    def __str__(self) -> str:
        if self.kind == "residual":
            return "residual"
        if self.kind == "denseformer":
            return f"denseformer:{self.dilation}x{self.period}"
        if self.kind == "depthssd" and self.chunk != DEFAULT_CHUNK:
            return f"depthssd:{self.n}:chunk={self.chunk}"
        return f"{self.kind}:{self.n}"

    def n_params(self, n_layers: int, d_model: int) -> int:
        """Parameters the mixing adds to a model of `n_layers` blocks of width `d_model` (0 for residual): the
        count ModelConfig.n_params states without building the mixers (tests hold it to the built ones)."""
        L, n = 2 * n_layers, self.n
        if self.kind == "denseformer":  # one weight per source of each DWA (denseformer.sources, applies)
            return sum(len(range(i % self.dilation, i + 1, self.dilation))
                       for i in range(self.period, n_layers + 1, self.period))
        if self.kind in ("hc", "hc-dynamic"):
            return L * (n * (n + 2) + (d_model * (n + 3) + 2 if self.kind == "hc-dynamic" else 0))
        if self.kind == "attnres":
            return (L + 1) * 2 * d_model
        if self.kind == "depthssd":
            return (2 * n + 1) * L + 2 * n
        return 0


def parse_depth(spec: str) -> DepthSpec:
    """A DepthSpec from its string; ValueError naming the accepted forms otherwise."""
    forms = FORMS
    kind, _, arg = str(spec).strip().lower().partition(":")
    chunk = DEFAULT_CHUNK
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
        if kind == "depthssd" and ":" in arg:
            arg, _, opt = arg.partition(":")
            key, eq, value = opt.partition("=")
            if key != "chunk" or not eq:
                raise ValueError
            chunk = int(value)
        n = int(arg) if arg else DEFAULTS[kind]
    except ValueError:
        raise ValueError(f"malformed depth mixing {spec!r}; use {forms}, e.g. depthssd:8 or denseformer:2x1") from None
    if not 1 <= n <= MAX_RANK:
        raise ValueError(f"depth mixing {spec!r}: the number must be between 1 and {MAX_RANK}, got {n}")
    if chunk not in CHUNKS:
        raise ValueError(f"depth mixing {spec!r}: chunk must be one of {CHUNKS} (sub-layers per state read, "
                         "within one block)")
    return DepthSpec(kind, n=n, chunk=chunk)
