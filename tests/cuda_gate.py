"""Whether a test run that asked for the CUDA tests may go on (tests/conftest.py's pytest_configure; the
device script benchmarks/gpu/run.sh sets MEGATRAIN_REQUIRE_CUDA=1)."""

import torch

REQUIRE_CUDA_ENV = "MEGATRAIN_REQUIRE_CUDA"


def cuda_run_without_a_gpu(markexpr: str, env: dict) -> str | None:
    """Why a run that asked for the CUDA tests must fail here (None: it may go on): `-m cuda` or
    MEGATRAIN_REQUIRE_CUDA=1 on a machine where torch sees no GPU would otherwise pass with all of them skipped."""
    import megatrain  # noqa: F401  (MEGATRAIN_FAKE_CUDA=1 installs the fake CUDA backend on import)

    asked = markexpr.strip() == "cuda" or env.get(REQUIRE_CUDA_ENV, "") == "1"
    if not asked or torch.cuda.is_available():
        return None
    return (f"the CUDA tests were asked for (-m {markexpr.strip() or '...'}, {REQUIRE_CUDA_ENV}="
            f"{env.get(REQUIRE_CUDA_ENV, '')!r}) but torch sees no GPU (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda}): every one would be skipped")

