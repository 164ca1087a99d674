"""Numbers for people: byte and count formats, and rich renderables as text.

Where it sits: below every table the project prints: the ModelIR's (model_ir.py), the planner's, codegen's.
"""

from __future__ import annotations

import io

from rich.console import Console


def format_bytes(n: int | float) -> str:
    """Binary units with three significant digits: `80.0 GiB`, `512 MiB`, `17 B`."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            v = n / scale
            return f"{sign}{v:.0f} {unit}" if v >= 100 else f"{sign}{v:.3g} {unit}"
    return f"{sign}{int(n)} B"


def fmt_count(n: float) -> str:
    """1_234_567 -> '1.23M' (decimal units, for parameters and FLOPs)."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def render(renderable, width: int = 120) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=False, color_system=None).print(renderable)
    return buf.getvalue()
