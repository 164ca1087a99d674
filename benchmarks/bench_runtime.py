"""Streamed training on the sim device against eager PyTorch with per-block activation checkpointing.

Run: `make bench`, or `.venv/bin/python -m pytest benchmarks/bench_runtime.py --benchmark-only -o addopts="" -s`.
Same model (small, fp32), same tokens, same optimizer; the streamed run holds at most 56 MiB of program
buffers (the fp32 parameters alone are 75 MiB) while eager keeps the whole model and its gradients resident.
Both are timed in interleaved rounds in one process, so the ratio is measured under the same machine load.
A streamed step is timed until its state is final (its host optimizer done, `Engine.final_time`), not until
`train_step` returns (which is before the host optimizer finishes): each round times two back-to-back
streamed steps and keeps the period between their final states, the steady step.
The plan's predicted step time, planned with a profile `megatrain probe` measures on this machine at the start
of the benchmark, is recorded next to the measured one.
"""

import statistics
import time

import torch

from megatrain.models import preset
from megatrain.planner import TrainSpec
from megatrain.runtime.config import RunConfig
from megatrain.runtime.machine_probe import probe
from megatrain.runtime.reference import EagerTrainer
from megatrain.runtime.trainer import Trainer

SPEC = TrainSpec(micro_batch=2, seq_len=128, grad_accum=4, dtype="fp32", lr=1e-3, clip_norm=1.0, total_steps=100)
BUDGET = 56 * 2**20
ROUNDS = 4


def _batches(n):
    g = torch.Generator().manual_seed(0)
    shape = (SPEC.micro_batch, SPEC.seq_len)
    return [[(torch.randint(0, 256, shape, generator=g), torch.randint(0, 256, shape, generator=g))
             for _ in range(SPEC.grad_accum)] for _ in range(n)]


def _timed(fn, batch):
    t0 = time.perf_counter()
    fn(batch)
    return time.perf_counter() - t0


def _streamed_period(trainer, batch) -> float:
    """Seconds between the final states of two back-to-back steps (host optimizer included)."""
    first = trainer.engine.step_index
    trainer.train_step(batch)
    trainer.train_step(batch)
    a, b = (trainer.engine.final_time(first + k) for k in range(2))
    return b - a


def test_streamed_vs_eager_checkpointed(benchmark):
    batches = _batches(ROUNDS + 1)
    eager = EagerTrainer(preset("small"), SPEC, checkpoint_blocks=True)
    measured_hw = probe(device="cpu", quick=True)
    with Trainer(RunConfig(model="small", train=SPEC, gpu_mem=BUDGET, hardware=measured_hw, device="sim")) as streamed:
        streamed.train_step(batches[0])  # warm-up both
        eager.step(batches[0])
        s_times, e_times = [], []
        for b in batches[1:]:
            s_times.append(_streamed_period(streamed, b))
            e_times.append(_timed(eager.step, b))
        streamed.device.synchronize()
        benchmark.pedantic(streamed.train_step, args=(batches[1],), rounds=2, iterations=1)
        ratio = statistics.median(s_times) / statistics.median(e_times)
        predicted = streamed.plan.step_time_s
        benchmark.extra_info.update(
            streamed_median_s=statistics.median(s_times), eager_checkpointed_median_s=statistics.median(e_times),
            ratio=ratio, predicted_step_s=predicted, tokens_per_step=SPEC.tokens_per_step,
            planned_peak_buffer_bytes=streamed.plan.peak_buffer_bytes,
            measured_peak_buffer_bytes=streamed.device.measured_peak_bytes())
        print(f"\nstreamed {statistics.median(s_times):.3f} s/step, eager+checkpointing "
              f"{statistics.median(e_times):.3f} s/step, ratio {ratio:.3f}; predicted {predicted:.3f} s/step; "
              f"device peak {streamed.device.measured_peak_bytes() / 2**20:.1f} MiB "
              f"(plan {streamed.plan.peak_buffer_bytes / 2**20:.1f} MiB)")
        assert streamed.device.measured_peak_bytes() <= BUDGET
