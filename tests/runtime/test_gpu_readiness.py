"""CPU twins of the GPU-readiness fixes (issue 16) that have no better home: the metrics' gradient norm is the
step's own, the host threads' CPU budget, and the device memory report. The CUDA halves are in test_cuda.py."""

import time

import pytest
import torch
from runtime_schedules import make_token_files

from megatrain.models import preset
from megatrain.planner import TrainSpec
from megatrain.runtime.reference import EagerTrainer
from megatrain.runtime.store import HostStore
from megatrain.runtime.trainer import Trainer

TINY = preset("tiny")


def test_the_logged_grad_norm_is_the_steps_own_when_the_host_stream_lags(tmp_path, monkeypatch):
    """Engine.end() waits for the compute stream only; clip_grads runs later on the host stream. The record
    must carry that step's global norm (the eager reference's clip_grad_norm_, to the bit), not the one before."""
    train_file, _ = make_token_files(tmp_path)
    clip = HostStore.clip_grads

    def late_clip(self, *a, **kw):
        time.sleep(0.05)  # the host stream behind the compute, as a slow optimizer makes it on a GPU
        return clip(self, *a, **kw)

    monkeypatch.setattr(HostStore, "clip_grads", late_clip)
    train = TrainSpec(micro_batch=2, seq_len=64, grad_accum=2, dtype="fp32", lr=3e-3, warmup_steps=1,
                      total_steps=6, clip_norm=0.5)
    with Trainer(TINY, train, 6 * 2**20, data=train_file, delays=(0.0, 0.001)) as t:
        records = t.run(6, progress=False, handle_signals=False)
        batches = [t.batcher.batch(s) for s in range(6)]

    norms = []
    clip_grad_norm = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **kw: norms.append(float(
        clip_grad_norm(*a, **kw))))
    eager = EagerTrainer(TINY, train)
    for b in batches:
        eager.step(b)
    assert [r["grad_norm"] for r in records] == norms
    assert len(set(norms)) == len(norms)  # each step's differs: a lagging read could not pass


def test_grad_norm_of_a_failed_device_raises_instead_of_waiting():
    from runtime_schedules import plans_by_shape

    from megatrain.runtime.device import DeviceError, SimDevice
    from megatrain.runtime.engine import Engine

    train = TrainSpec(micro_batch=2, seq_len=64, dtype="fp32", total_steps=2, clip_norm=1.0)
    p = next(iter(plans_by_shape(TINY, train, budgets_mib=(64,)).values()))
    with SimDevice(p.gpu_budget_bytes) as dev:
        engine = Engine(p.ir, p.program, dev, HostStore(p.ir, train, program=p.program))
        dev.submit("host", lambda: 1 / 0, "instruction 3 clip_grads()")
        engine.step_index = 1
        with pytest.raises(DeviceError, match="clip_grads"):
            engine.grad_norm()
