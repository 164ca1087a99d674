"""Streamed MoE training equals eager training, routing buffers included; resume and memory hold for MoE too.

As in test_exactness.py: moe-tiny cut to 3 layers (a dense block, two MoE blocks) in fp32 with gradient
accumulation, over plans with one and two parameter slots and checkpoints on device, on host and kept. After
3 optimizer steps every parameter and every routing buffer (ET thresholds and update counts, DeepSeek
biases) is bit-identical to build_eager + AdamW (megatrain/runtime/reference.py) on the same batches, and so are the
losses: the buffers are updated once per step from the first forwards' statistics, never from a backward's
recompute. ET thresholds from step 2 on (one warmup step) with a capacity factor low enough that drops and
pads happen; token choice runs with the Switch aux loss (softmax gate, top-2) and with bias balancing; expert
choice learns its EMA cutoff (its causal evaluation) like ET. Each
plan runs in a device pool of exactly its predicted peak: for MoE the plan is an upper bound.
"""

import json

import pytest
import torch
from runtime_schedules import make_batches, make_token_files, placements_of, plans_by_shape, streamed_train

from megatrain.models import ModelConfig, preset
from megatrain.planner import TrainSpec
from megatrain.runtime.config import RunConfig
from megatrain.runtime.export import export_weights
from megatrain.runtime.reference import EagerTrainer
from megatrain.runtime.trainer import Trainer

BASE = preset("moe-tiny")
CASES = {
    "et": ({"router": "et", "warmup_steps": 1, "capacity_factor": 0.25}, 3, 1.0),
    "tc-aux": ({"router": "tc", "balance": "aux", "gate": "softmax", "top_k": 2, "aux_loss_coef": 0.01}, 3, None),
    "tc-bias": ({"router": "tc", "balance": "bias", "bias_rate": 0.01}, 2, 1.0),
    "ec": ({"router": "ec", "momentum": 0.9}, 2, 1.0),
}


def moe_config(**moe) -> ModelConfig:
    return ModelConfig(**{**BASE.model_dump(), "n_layers": 3, "moe": {**BASE.moe.model_dump(), **moe}})


def _train(grad_accum, clip, steps=3):
    return TrainSpec(micro_batch=2, seq_len=64, grad_accum=grad_accum, dtype="fp32", lr=2e-3, warmup_steps=1,
                     total_steps=steps, weight_decay=0.1, clip_norm=clip)


@pytest.mark.parametrize("case", CASES)
def test_streamed_moe_equals_eager_buffers_included(case):
    moe, grad_accum, clip = CASES[case]
    config, train = moe_config(**moe), _train(grad_accum, clip)
    batches = make_batches(config, train, steps=3)
    eager = EagerTrainer(config, train)
    eager_losses, metrics = [], []
    for b in batches:
        eager_losses.append(eager.step(b))
        metrics.append(eager.routing_metrics())
    buffers = dict(eager.model.named_buffers())
    plans = plans_by_shape(config, train, budgets_mib=(6, 8, 12, 24))  # 6: a 1-slot schedule (traced workspace excludes program buffers)
    assert {n for n, _ in plans} == {1, 2} and {"device", "host", "keep"} <= placements_of(plans)
    for p in plans.values():
        store, losses, peak = streamed_train(p, batches, budget=p.peak_buffer_bytes)
        assert losses == eager_losses
        master, got = store.named_master(), store.named_buffers()
        for name, param in eager.model.named_parameters():
            assert torch.equal(master[name], param.detach()), name
        assert sorted(got) == sorted(buffers)
        for name, buf in buffers.items():
            assert torch.equal(got[name], buf), name
        assert peak <= p.peak_buffer_bytes
    if case == "et":
        assert all(float(b) == 3 for n, b in buffers.items() if n.endswith("updates"))  # one update per step
        assert metrics[0]["moe_drop_rate"] == metrics[0]["moe_pad_rate"] == 0  # step 1: expert choice
        assert metrics[0]["moe_load_max_over_mean"] == 1
        assert metrics[2]["moe_drop_rate"] > 0 and metrics[2]["moe_pad_rate"] > 0  # capacity at work
    if case in ("et", "ec"):  # the threshold lag is logged once the EMA has an update
        assert "moe_threshold_lag" not in metrics[0] and metrics[2]["moe_threshold_lag_abs"] > 0
    if case == "ec":
        assert all(float(b) == 3 for n, b in buffers.items() if n.endswith("updates"))
        assert metrics[2]["moe_load_max_over_mean"] == 1  # expert choice in training throughout
    if case == "tc-aux":
        assert metrics[0]["moe_aux_loss"] > 0 and metrics[0]["moe_experts_per_token"] == 2
    if case == "tc-bias":
        assert all(b.abs().max() > 0 for b in buffers.values())


def test_random_stream_delays_change_nothing_for_moe():
    moe, grad_accum, clip = CASES["et"]
    config, train = moe_config(**moe), _train(grad_accum, clip)
    batches = make_batches(config, train, steps=3)
    p = min(plans_by_shape(config, train, budgets_mib=(8,)).values(), key=lambda q: q.n_slots)
    ref, ref_losses, _ = streamed_train(p, batches)
    store, losses, _ = streamed_train(p, batches, delays=(0.0, 0.002), seed=3)
    assert losses == ref_losses
    want, got = ref.state_tensors, store.state_tensors
    assert all(torch.equal(got(u)[k], want(u)[k]) for u in store.units for k in want(u))


# -- the trainer: metrics, checkpoints, resume, export ----------------------------------------------------------
SPEC = TrainSpec(micro_batch=2, seq_len=64, grad_accum=2, dtype="fp32", lr=3e-3, warmup_steps=1, total_steps=6)
ET = moe_config(warmup_steps=3)  # thresholds from step 4: a run resumed at step 2 crosses the switch
BUDGET = 16 * 2**20
_PLANS: dict = {}


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    return make_token_files(tmp_path_factory.mktemp("tokens"))


def make(token_files, **kw) -> Trainer:
    t = Trainer(RunConfig(model=ET, train=SPEC, gpu_mem=BUDGET, device="sim", data=token_files[0],
                          val_data=token_files[1], **kw), plan=_PLANS.get("et"))
    _PLANS.setdefault("et", t.plan)
    return t


def snapshot(store) -> dict[str, torch.Tensor]:
    return {k: v.clone() for unit in store.units for k, v in store.state_tensors(unit).items()}


def test_trainer_logs_routing_metrics(token_files, tmp_path):
    with make(token_files, metrics=tmp_path / "m.jsonl") as t:
        t.run(2, eval_every=2, progress=False)
    recs = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and recs[-1]["val_loss"] > 0
    for rec in recs:
        assert set(rec["moe_layers"]) == {"blocks.1", "blocks.2"}
        for row in rec["moe_layers"].values():
            assert len(row["load"]) == 8 and sum(row["load"]) == pytest.approx(row["experts_per_token"], abs=1e-3)
        assert rec["moe_experts_per_token"] == 1  # expert choice during warmup: exactly k per expert
        assert 0 < rec["moe_zero_expert_share"] < 1
        assert {"moe_drop_rate", "moe_pad_rate", "moe_load_max_over_mean"} <= set(rec)
        assert rec["peak_device_bytes"] <= rec["planned_peak_device_bytes"]


def test_moe_resume_is_bit_identical_buffers_included(token_files, tmp_path):
    with make(token_files) as t:
        straight = t.run(5, progress=False)
        want = snapshot(t.store)
    assert float(want["buffer/blocks.1.mlp.updates"]) == 5 and want["buffer/blocks.1.mlp.threshold"].any()
    with make(token_files, checkpoint_dir=tmp_path / "ck", checkpoint_every=2) as t:
        t.run(2, progress=False)
    ckpt = tmp_path / "ck" / "step-00000002"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    unit = next(u for u in manifest["units"] if u["name"] == "blocks.1")
    assert unit["buffers"] == [{"name": "blocks.1.mlp.threshold", "shape": [8]},
                               {"name": "blocks.1.mlp.updates", "shape": []}]
    assert "buffers" not in manifest["units"][0]  # dense units keep the dense layout
    with make(token_files, resume=ckpt) as t:
        assert float(t.store.named_buffers()["blocks.1.mlp.updates"]) == 2
        resumed = t.run(3, progress=False)
        got = snapshot(t.store)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[2:]]
    assert [r["moe_layers"] for r in resumed] == [r["moe_layers"] for r in straight[2:]]

    with pytest.raises(ValueError, match="no Hugging Face equivalent; export it with --names megatrain"):
        export_weights(ckpt, tmp_path / "hf.safetensors")
    export_weights(ckpt, tmp_path / "m.safetensors", names="megatrain")
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "m.safetensors")
    assert float(exported["blocks.1.mlp.updates"]) == 2 and "blocks.1.mlp.experts.up_proj.weight" in exported
