"""Planner speed: llama3-70b and dense-120b in about a second (the residency pass included); a 32-configuration
tune under ten.

Run: `make bench` or `.venv/bin/python -m pytest benchmarks/bench_planner.py --benchmark-only -o addopts=""`.
Traces are made once per module (tracing has its own benchmark, bench_trace.py); `test_tune_end_to_end`
includes tracing each micro-batch.
"""

import functools
import time

import pytest

from megatrain.planner import TrainSpec, plan, tune
from megatrain.planner.loading import trace_model

BUDGETS = ["24GiB", "32GiB", "40GiB", "48GiB", "56GiB", "64GiB", "72GiB", "80GiB"]
MICRO_BATCHES = [1, 2, 3, 4]


@functools.cache
def _ir(model: str, micro_batch: int, seq_len: int = 8192):
    return trace_model(model, micro_batch, seq_len, "bfloat16")


@pytest.mark.parametrize("model, hardware, budget, grad_accum", [
    ("llama3-70b", "h100-sxm", "80GiB", 1), ("dense-120b", "h200", "140GiB", 1),
    ("llama3-70b", "h100-sxm", "80GiB", 8), ("dense-120b", "h200", "140GiB", 8),
])
def test_plan(benchmark, model, hardware, budget, grad_accum):
    ir = _ir(model, 1)
    train = TrainSpec(micro_batch=1, seq_len=8192, grad_accum=grad_accum)
    p = benchmark.pedantic(plan, args=(ir, hardware, train, budget), rounds=5, iterations=1, warmup_rounds=1)
    benchmark.extra_info.update(instructions=len(p.program.instrs), tokens_per_s=round(p.tokens_per_s),
                                peak_gib=round(p.peak_gpu_bytes / 2**30, 2))
    if grad_accum == 1:
        assert benchmark.stats.stats.median < 1.0


def test_tune_32_configurations(benchmark):
    irs = {mb: _ir("llama3-70b", mb) for mb in MICRO_BATCHES}
    train = TrainSpec(micro_batch=1, seq_len=8192)
    result = benchmark.pedantic(tune, args=(irs[1], "h100-sxm", train, BUDGETS, MICRO_BATCHES),
                                kwargs={"trace_fn": lambda model, mb, spec: irs[mb]}, rounds=3, iterations=1)
    assert len(result.rows) == 32
    benchmark.extra_info["feasible"] = sum(r.feasible for r in result.rows)
    assert benchmark.stats.stats.median < 10.0


def test_tune_end_to_end_with_tracing(benchmark):
    def run():
        t = time.perf_counter()
        result = tune("llama3-70b", "h100-sxm", TrainSpec(micro_batch=1, seq_len=8192), BUDGETS, MICRO_BATCHES)
        return result, time.perf_counter() - t

    result, seconds = benchmark.pedantic(run, rounds=1, iterations=1)
    assert len(result.rows) == 32
    benchmark.extra_info["seconds"] = round(seconds, 2)


def test_plan_llama3_8b_at_1m_tokens_with_tracing(benchmark):
    """Issue 15: tracing (scaled: the cost does not grow with the sequence) plus planning, under 2 s."""
    from long_context import plan_case

    plan_case("tiny", 128, "cpu", None)  # torch's one-time setup is not the planner's
    p, _, _ = benchmark.pedantic(plan_case, args=("llama3-8b", 2**20, "h200", None), rounds=3, iterations=1)
    benchmark.extra_info.update(chunk_tokens=p.ir.chunk_tokens, step_s=round(p.step_time_s),
                                peak_gib=round(p.peak_gpu_bytes / 2**30, 1))
    assert p.feasible and p.ir.chunk_tokens is not None
    assert benchmark.stats.stats.median < 2.0
