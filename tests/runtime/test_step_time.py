"""A step's time runs until its state is final: the host optimizer is inside `step_time_s`, and the records of
back-to-back steps add up to no more than the run's wall time (megatrain/runtime/trainer.py `_final`)."""

import time

from megatrain.models import preset
from megatrain.planner import TrainSpec
from megatrain.runtime.config import RunConfig
from megatrain.runtime.store import HostStore
from megatrain.runtime.trainer import Trainer

SLEEP = 0.2  # seconds each unit's host optimizer step takes when slowed


def test_step_time_includes_the_host_optimizer(tmp_path, monkeypatch):
    from runtime_schedules import make_token_files

    data = make_token_files(tmp_path)[0]
    train = TrainSpec(micro_batch=2, seq_len=64, dtype="fp32", lr=3e-3, warmup_steps=1, total_steps=4)
    t = Trainer(RunConfig(model=preset("tiny"), train=train, gpu_mem=6 * 2**20, data=data, device="sim"))
    try:
        slow = {"on": False}
        original = HostStore.step_unit

        def step_unit(self, *args, **kw):
            if slow["on"]:
                time.sleep(SLEEP)
            return original(self, *args, **kw)

        monkeypatch.setattr(HostStore, "step_unit", step_unit)
        t0 = time.perf_counter()
        records = t.run(2, progress=False, handle_signals=False)
        slow["on"] = True  # only the last step's optimizer is slow: nothing of a later step waits for it
        records += t.run(1, progress=False, handle_signals=False)
        wall = time.perf_counter() - t0
        units = len(t.plan.ir.units)
        last = records[-1]
        assert [r["step"] for r in records] == [1, 2, 3]
        assert last["step_time_s"] >= units * SLEEP  # before: the compute alone, which does not wait for it
        assert last["tokens_per_s"] == train.tokens_per_step / last["step_time_s"]
        assert sum(r["step_time_s"] for r in records) <= wall
        # a step that overlapped the previous one's optimizer counts from that step's final state: not below 0
        assert all(r["step_time_s"] > 0 and r["compute_time_s"] > 0 for r in records)
    finally:
        t.close()
