"""What test_checkpoint.py and test_checkpoint_faults.py share: Trainers on the tiny model that reuse one
another's plans (tracing is the slow part), and snapshots of a store's state."""

import torch

from megatrain.models import preset
from megatrain.planner import TrainSpec
from megatrain.runtime.config import RunConfig
from megatrain.runtime.store import HostStore
from megatrain.runtime.trainer import Trainer

TINY = preset("tiny")
BUDGET = 6 * 2**20
SPEC = TrainSpec(micro_batch=2, seq_len=64, dtype="fp32", lr=3e-3, warmup_steps=1, total_steps=6)
_PLANS: dict = {}


def make(token_files, train=SPEC, model=TINY, data=None, **kw) -> Trainer:
    """A Trainer on the tiny model, reusing the plan of an earlier one with the same settings."""
    key = (model.model_dump_json(), train.to_json(), kw.get("on_nan", "abort"))
    config = RunConfig(model=model, train=train, gpu_mem=BUDGET, device="sim", data=data or token_files[0], **kw)
    t = Trainer(config, plan=_PLANS.get(key))
    _PLANS.setdefault(key, t.plan)
    return t


def snapshot(store: HostStore) -> dict[str, torch.Tensor]:
    return {k: v.clone() for unit in store.units for k, v in store.state_tensors(unit).items()}


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
