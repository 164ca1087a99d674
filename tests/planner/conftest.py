"""Fixtures for the planner tests (tests/planner/ mirrors planner/, import name megatrain.planner).

Run: `.venv/bin/pytest tests/planner -q`. Real-model tests trace presets once per session (ir.trace runs
on the meta device: seconds for 70B); synthetic ModelIRs come from megatrain.planner.synthetic.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from planner_testing import traced

from megatrain.ir.model_ir import ModelIR

settings.register_profile("planner", deadline=None, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("planner")


@pytest.fixture(scope="session")
def ir70() -> ModelIR:
    return traced("llama3-70b", 1, 8192)


@pytest.fixture
def cached_traces(monkeypatch):
    """Make the CLI and tune() reuse this session's traces instead of tracing again."""
    from megatrain.planner import loading

    def trace_model(model, micro_batch, seq_len, dtype, target="cuda"):
        return traced(model, micro_batch, seq_len, dtype, target)  # a name, or a (hashable) ModelConfig

    monkeypatch.setattr(loading, "trace_model", trace_model)
