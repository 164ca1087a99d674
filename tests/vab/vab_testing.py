"""Helpers shared by the VAB tests (imported by name; tests/vab is on sys.path under pytest's default mode)."""

from __future__ import annotations

import json
from pathlib import Path


def write_lines(path: Path, rows: list) -> Path:
    """Write rows (dicts as JSON, strings verbatim) one per line."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path
