"""Shared test fixtures. Tests are CPU-only unless marked `cuda`; slow ones are marked `slow`."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


REQUIRE_CUDA_ENV = "MEGATRAIN_REQUIRE_CUDA"


def cuda_run_without_a_gpu(markexpr: str, env: dict) -> str | None:
    """Why a run that asked for the CUDA tests must fail here (None: it may go on): `-m cuda` or
    MEGATRAIN_REQUIRE_CUDA=1 on a machine where torch sees no GPU would otherwise pass with all of them skipped."""
    asked = markexpr.strip() == "cuda" or env.get(REQUIRE_CUDA_ENV, "") == "1"
    if not asked or torch.cuda.is_available():
        return None
    return (f"the CUDA tests were asked for (-m {markexpr.strip() or '...'}, {REQUIRE_CUDA_ENV}="
            f"{env.get(REQUIRE_CUDA_ENV, '')!r}) but torch sees no GPU (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda}): every one would be skipped")


def pytest_configure(config):
    import os

    reason = cuda_run_without_a_gpu(config.getoption("markexpr") or "", dict(os.environ))
    if reason:
        raise pytest.UsageError(reason)
