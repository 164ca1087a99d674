"""`--recipe hf-trainer`: a recipe ported from the Hugging Face Trainer trains the weights transformers.Trainer
trains, to fp32 round-off, warmup included (HF's ramp lr*s/W puts the first step at lr 0, megatrain's own
lr*(s+1)/W does not: the test fails under it by far more than round-off).

Both train the same small random Llama (tests/runtime/hf_models.py) on the same batches: megatrain's windows of
seq_len + 1 tokens, which HF reads as input_ids = labels of seq_len + 1 tokens (its loss shifts them, so the
two score the same seq_len predictions per sequence), in megatrain's data order (a sequential sampler).
"""

import pytest
import torch
from hf_models import save_hf_model

from megatrain.planner.train import RECIPES, TrainSpec
from megatrain.runtime.config import RunConfig
from megatrain.runtime.optim import lr_at

pytest.importorskip("transformers")

STEPS, WARMUP, LR, SEQ, MB = 5, 2, 2e-3, 16, 2


def hf_name(name: str) -> str:
    """megatrain's eager parameter name as transformers' Llama spells it."""
    name = name.replace("blocks.", "model.layers.").replace("embed.embed_tokens", "model.embed_tokens")
    return name.replace("head.norm", "model.norm").replace("head.lm_head", "lm_head")


def test_hf_warmup_ramp_is_transformers_schedulers():
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    p = torch.nn.Parameter(torch.zeros(1))
    for schedule, make in (("linear", get_linear_schedule_with_warmup), ("cosine", get_cosine_schedule_with_warmup)):
        spec = TrainSpec(micro_batch=1, seq_len=8, lr=1.0, total_steps=10, warmup_steps=3, schedule=schedule,
                         min_lr_ratio=0.0, warmup_style="hf")
        opt = torch.optim.SGD([p], lr=1.0)
        sched = make(opt, 3, 10)
        for step in range(10):
            assert lr_at(spec, step) == pytest.approx(sched.get_last_lr()[0], rel=1e-12, abs=1e-15), (schedule, step)
            opt.step()
            sched.step()
    assert lr_at(spec.replace(warmup_style="megatrain"), 0) == pytest.approx(1 / 3)  # megatrain's own ramp


def test_the_recipe_fills_what_the_run_leaves_out_and_flags_win():
    base = {"model": "tiny", "seq-len": 64, "steps": 100, "gpu-mem": "6MiB", "recipe": "hf-trainer"}
    t = RunConfig.from_settings(base).train
    assert {f: getattr(t, f) for f in RECIPES["hf-trainer"]} == RECIPES["hf-trainer"]
    t = RunConfig.from_settings({**base, "lr": 1e-4, "warmup": 10, "clip-norm": 0.5}).train
    assert (t.lr, t.warmup_steps, t.clip_norm, t.schedule) == (1e-4, 10, 0.5, "linear")
    assert RunConfig.from_settings({**base, "clip-norm": 0}).train.clip_norm is None  # HF's max_grad_norm 0: off
    plain = RunConfig.from_settings({k: v for k, v in base.items() if k != "recipe"}).train
    assert (plain.lr, plain.warmup_steps, plain.warmup_style) == (3e-4, 10, "megatrain")  # megatrain's defaults


def test_the_recipe_is_training_arguments_defaults():
    """Read from transformers' own TrainingArguments (its fields' defaults: building one needs accelerate)."""
    import dataclasses

    from transformers import TrainingArguments

    hf = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    r = RECIPES["hf-trainer"]
    assert (hf["learning_rate"], hf["weight_decay"], hf["max_grad_norm"]) == (r["lr"], r["weight_decay"], r["clip_norm"])
    assert ((hf["adam_beta1"], hf["adam_beta2"]), hf["adam_epsilon"]) == (r["betas"], r["eps"])
    assert str(getattr(hf["lr_scheduler_type"], "value", hf["lr_scheduler_type"])) == r["schedule"] == "linear"
    assert hf["warmup_steps"] == r["warmup_steps"] == 0 and not hf.get("warmup_ratio") and r["min_lr_ratio"] == 0


def megatrain_run(tmp_path):
    """The ported recipe trained by megatrain: its weights by HF name, and HF's rows (input_ids = labels)."""
    from runtime_schedules import make_token_files

    from megatrain.runtime.trainer import Trainer

    folder = tmp_path / "llama"
    save_hf_model(folder, "llama", seed=4)
    train_bin, _ = make_token_files(tmp_path)
    # the recipe whole, and the flags the HF run changed (learning rate, warmup, steps, batch)
    cfg = RunConfig.from_settings({"model": str(folder), "recipe": "hf-trainer", "lr": LR, "warmup": WARMUP,
                                   "steps": STEPS, "seq-len": SEQ, "micro-batch": MB, "dtype": "fp32",
                                   "device": "sim", "hardware": "cpu", "gpu-mem": "64MiB", "data": str(train_bin),
                                   "no-progress": True})
    with Trainer(cfg) as trainer:
        batches = [trainer.batcher.batch(step) for step in range(STEPS)]
        trainer.run(STEPS)
        ours = {hf_name(k): v.clone() for k, v in trainer.store.named_master().items()}
    rows = []
    for [(x, y)] in batches:  # one micro-batch a step; y is x shifted by one token
        assert torch.equal(x[:, 1:], y[:, :-1])
        rows.append(torch.cat([x, y[:, -1:]], dim=1))
    return folder, ours, rows


def assert_same_weights(ours, model, folder):
    import transformers

    want = dict(model.named_parameters())
    assert set(ours) == set(want)
    start = dict(transformers.AutoModelForCausalLM.from_pretrained(folder).named_parameters())
    moved = max((want[k].detach() - start[k].detach()).abs().max().item() for k in want)
    assert moved > 100 * 1e-6  # the weights moved by far more than the tolerance below
    for name, w in want.items():
        torch.testing.assert_close(ours[name], w.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_ported_recipe_reproduces_the_hf_trainers_step(tmp_path):
    """transformers.Trainer's inner loop with its own pieces (its decay groups, `get_scheduler` of its defaults,
    torch's AdamW and clip_grad_norm_), for machines without accelerate, which the Trainer itself needs."""
    import transformers

    folder, ours, rows = megatrain_run(tmp_path)
    transformers.utils.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").train()
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    groups = [{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.0},
              {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    sched = transformers.get_scheduler("linear", opt, num_warmup_steps=WARMUP, num_training_steps=STEPS)
    for ids in rows:
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    assert_same_weights(ours, model, folder)


def test_ported_recipe_reproduces_transformers_trainer(tmp_path):
    import transformers
    from torch.utils.data import SequentialSampler

    pytest.importorskip("accelerate")  # transformers.Trainer needs it (the dev extra installs it)
    folder, ours, rows = megatrain_run(tmp_path)
    flat = [r for ids in rows for r in ids]

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(flat)

        def __getitem__(self, i):
            return {"input_ids": flat[i], "labels": flat[i]}

    class InOrder(transformers.Trainer):  # megatrain's data order, not a shuffle
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    transformers.utils.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=STEPS, learning_rate=LR,
                                          warmup_steps=WARMUP, per_device_train_batch_size=MB, use_cpu=True,
                                          report_to=[], save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True, optim="adamw_torch", dataloader_num_workers=0)
    InOrder(model=model, args=args, train_dataset=Rows()).train()
    assert_same_weights(ours, model, folder)
