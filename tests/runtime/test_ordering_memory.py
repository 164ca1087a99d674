"""Ordering and memory on the sim device.

Ordering: with random delays in every stream worker, a missing or misplaced wait would let a stream read a
slot or checkpoint too early and change the result; five seeds must give weights bit-identical to the run
without delays. Memory: the pool's measured peak of program buffers never exceeds the budget and equals the
plan's prediction exactly; a pool smaller than that fails with the out-of-memory error, not a wrong result.
"""

import pytest
import torch
from runtime_schedules import MIB, make_batches, plans_by_shape, streamed_train

from megatrain.models import preset
from megatrain.planner import TrainSpec
from megatrain.runtime.stream_device import DeviceError, DeviceOutOfMemory

TINY = preset("tiny")
TRAIN = TrainSpec(micro_batch=2, seq_len=64, grad_accum=2, dtype="fp32", lr=1e-3, clip_norm=1.0, total_steps=3)


@pytest.fixture(scope="module")
def plans():
    return plans_by_shape(TINY, TRAIN, budgets_mib=(4, 6, 8, 64))


def test_random_stream_delays_change_nothing(plans):
    batches = make_batches(TINY, TRAIN, steps=2)
    for p in plans.values():
        reference, ref_losses, _ = streamed_train(p, batches)
        want = reference.named_master()
        for seed in range(5):
            store, losses, _ = streamed_train(p, batches, delays=(0.0, 0.002), seed=seed)
            assert losses == ref_losses
            got = store.named_master()
            assert all(torch.equal(got[n], want[n]) for n in want), f"seed {seed}, plan {p.n_slots} slots"


def test_measured_peak_equals_plan_and_fits_budget(plans):
    batches = make_batches(TINY, TRAIN, steps=2)
    for p in plans.values():
        _, _, peak = streamed_train(p, batches, delays=(0.0, 0.001))
        assert peak == p.peak_buffer_bytes
        assert peak <= p.gpu_budget_bytes


def test_undersized_pool_fails_with_out_of_memory(plans):
    p = min(plans.values(), key=lambda q: q.gpu_budget_bytes)
    batches = make_batches(TINY, TRAIN, steps=1)
    with pytest.raises((DeviceError, DeviceOutOfMemory)) as e:
        streamed_train(p, batches, budget=p.peak_buffer_bytes - 1)
    err = e.value if isinstance(e.value, DeviceOutOfMemory) else e.value.__cause__
    assert isinstance(err, DeviceOutOfMemory)
    assert "device out of memory" in str(e.value) and "raise --gpu-mem" in str(e.value)
    assert p.gpu_budget_bytes >= 4 * MIB
