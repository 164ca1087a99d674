"""Shared test fixtures. Tests are CPU-only unless marked `cuda`; slow ones are marked `slow`."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_cached_profiles(tmp_path_factory, monkeypatch):
    """`train --hardware auto` plans with a cached probe of this machine when one exists (planner/profile.py):
    tests see an empty profile cache of their own, never the user's."""
    monkeypatch.setenv("MEGATRAIN_PROFILES", str(tmp_path_factory.getbasetemp() / "profiles"))
    yield
