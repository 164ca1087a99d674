"""Fixtures for the VAB evaluation tests (tests/vab mirrors megatrain/vab/).

Task sets are generated (megatrain.vab.synth); no images are opened. Run: `pytest tests/vab -q`.
"""

from __future__ import annotations

import pytest

from megatrain.vab.synth import generate_tasks
from megatrain.vab.tasks import Task


@pytest.fixture
def small_tasks() -> list[Task]:
    """Twelve tasks of sizes 2, 3 and 4 across the three domains."""
    return generate_tasks(12, sizes=(2, 3, 4), seed=7)

