"""Shared test fixtures. Tests are CPU-only unless marked `cuda`; slow ones are marked `slow`."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _unevaluated_products_are_nan(monkeypatch):
    """A product a recompute leaves unevaluated (megatrain/models/unevaluated.py) holds NaN in every test, not memory the
    allocator hands back (which may hold the very values a previous identical product left): any gradient
    that read one would come out NaN, so every streamed-equals-eager test checks that none is read."""
    from megatrain.models import unevaluated

    monkeypatch.setattr(unevaluated, "_like", lambda a, shape: torch.full(shape, float("nan"), dtype=a.dtype,
                                                                            device=a.device))


def pytest_configure(config):
    import os

    from cuda_gate import cuda_run_without_a_gpu

    reason = cuda_run_without_a_gpu(config.getoption("markexpr") or "", dict(os.environ))
    if reason:
        raise pytest.UsageError(reason)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """The default corpus and cached probes live under $MEGATRAIN_CACHE (default ~/.cache/megatrain): tests get
    one cache folder of their own per session (the corpus is built once), never the user's, and write nothing
    outside their temp folders; `train --hardware auto` never sees a probe of the user's."""
    monkeypatch.delenv("MEGATRAIN_PROFILES", raising=False)
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "megatrain-cache"))
    yield


@pytest.fixture(autouse=True)
def _fake_cuda_protocol():
    """On the fake CUDA backend (`make test-cuda-fake`), a test also fails when device memory was freed while
    another stream may still have used it (found when torch frees it, so not raised where it happened)."""
    from megatrain import fake_cuda

    if not fake_cuda.installed():
        yield
        return
    state = fake_cuda.state()
    state.violations.clear()
    yield
    import gc

    gc.collect()
    violations, state.violations[:] = list(state.violations), []
    assert not violations, "stream protocol: " + "; ".join(violations[:3])
