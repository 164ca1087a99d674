"""Shared test fixtures. Tests are CPU-only unless marked `cuda`; slow ones are marked `slow`."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    import os

    from cuda_gate import cuda_run_without_a_gpu

    reason = cuda_run_without_a_gpu(config.getoption("markexpr") or "", dict(os.environ))
    if reason:
        raise pytest.UsageError(reason)
