"""Byte sizes as people write them: `parse_bytes("80GiB")`, `format_bytes(85899345920)`.

Where it sits: the CLI's `--gpu-mem`/`--host-mem` flags and every printed plan go through here.
Try it: `python -c "from megatrain.planner import parse_bytes; print(parse_bytes('1.5TiB'))"`.
"""

from __future__ import annotations

import re

from megatrain.ir.display import format_bytes  # noqa: F401 - one byte formatter for the project

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_BARE = {"k": 10, "m": 20, "g": 30, "t": 40}  # a bare letter could mean either: refused, naming both
_FORM = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
MAX_BYTES, MAX_BYTES_TEXT = 2**60, "1 EiB"  # sizes past this are typos, and would overflow the arithmetic
ACCEPTED = "a number with an optional unit: B, KB/MB/GB/TB (powers of 10) or KiB/MiB/GiB/TiB (powers of 2), e.g. 80GiB"


def parse_bytes(text: str | int) -> int:
    """`"80GiB"` -> 85899345920. Errors name the bad text and the accepted forms."""
    if isinstance(text, int) and not isinstance(text, bool):
        if not 0 <= text <= MAX_BYTES:
            raise ValueError(f"byte size must be in [0, {MAX_BYTES_TEXT}], got {text}")
        return text
    m = _FORM.match(str(text)) if len(str(text)) <= 64 else None
    unit = m.group(2).lower() if m else None
    if unit in _BARE:  # 40G: a GPU's "40 GB" is GiB, a disk's is GB; the difference is 7%, so ask
        number, letter = m.group(1), m.group(2).upper()
        raise ValueError(f"byte size {str(text).strip()!r} is ambiguous: write {number}{letter}iB (powers of 2, "
                         f"{number} x 2^{_BARE[unit]}) or {number}{letter}B (powers of 10, {number} x "
                         f"10^{_BARE[unit] // 10 * 3})")
    if not m or unit not in _UNITS:
        raise ValueError(f"cannot read {str(text)[:40]!r} as a byte size; use {ACCEPTED}")
    value = float(m.group(1)) * _UNITS[unit]
    if not value <= MAX_BYTES:
        raise ValueError(f"byte size {str(text)[:40]!r} is more than {MAX_BYTES_TEXT}, more memory than any "
                         "machine has; check the value")
    return int(round(value))

