"""TrainSpec: what one optimizer step does, independent of the model and the machine.

Where it sits: an input of `plan()` next to the ModelIR (traced for `micro_batch x seq_len`) and the
Hardware; the runtime reads the optimizer fields. `grad_accum` is the Program's n_micro_batches.
Try it: `python -c "from megatrain.planner import TrainSpec; print(TrainSpec(micro_batch=1, seq_len=8192))"`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from megatrain.ir.base import IRModel

ALIASES = {"bf16": "bfloat16", "fp32": "float32"}
# Upper bounds of the numeric settings (a larger value is a typo, and would exhaust memory building the step)
MAX_MICRO_BATCH = 65536
MAX_SEQ_LEN = 2**24  # 16M tokens
MAX_GRAD_ACCUM = 65536
MAX_STEPS = 10**9


# Recipes: whole sets of optimizer defaults (RunConfig.from_settings fills the settings a run leaves out).
# hf-trainer is transformers.TrainingArguments' defaults, its warmup ramp included, so a recipe ported from the
# Hugging Face Trainer needs only the flags it changed (docs/FINETUNING.md, "Porting a Hugging Face recipe").
RECIPES: dict[str, dict] = {
    "megatrain": {},  # TrainSpec's own defaults: pretraining's (cosine to 0.1, decay 0.1, betas 0.9/0.95)
    "hf-trainer": {"lr": 5e-5, "schedule": "linear", "min_lr_ratio": 0.0, "warmup_steps": 0, "weight_decay": 0.0,
                   "betas": (0.9, 0.999), "eps": 1e-8, "clip_norm": 1.0, "warmup_style": "hf"},
}


class TrainSpec(IRModel):
    """Micro-batching, precision and the AdamW step (with an optional global-norm clip)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    micro_batch: int = Field(gt=0, le=MAX_MICRO_BATCH, description="sequences per micro-batch (the traced batch size)")
    seq_len: int = Field(gt=0, le=MAX_SEQ_LEN, description="tokens per sequence")
    grad_accum: int = Field(1, gt=0, le=MAX_GRAD_ACCUM, description="micro-batches per optimizer step")
    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16", description="compute dtype: what crosses the link and what the GPU computes in (bf16|fp32)"
    )
    lr: float = Field(3e-4, gt=0, description="peak AdamW learning rate")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW beta1, beta2")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    weight_decay: float = Field(0.1, ge=0, description="decoupled weight decay, on weight matrices only: not on "
                                "norms, biases or depth-mixing coefficients (models.decays)")
    clip_norm: float | None = Field(None, gt=0, description="global gradient-norm clip; None turns clipping off")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="linear warmup steps of the LR schedule")
    warmup_style: Literal["megatrain", "hf"] = Field(
        "megatrain", description="the warmup's ramp: megatrain lr*(s+1)/W (step s, 0-based: the first step already "
        "moves the weights), or hf lr*s/W as transformers' schedulers (the first step at lr 0)")
    total_steps: int = Field(1000, gt=0, le=MAX_STEPS, description="steps of the LR schedule (the run's length)")
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine", description="after warmup: cosine or linear decay to min_lr_ratio x lr at total_steps, constant, "
        "or wsd (warmup-stable-decay: constant, then a linear decay over the last decay_fraction of the steps)")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the schedule's floor as a fraction of lr")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: the fraction of the post-warmup steps that "
                                  "decays")
    seed: int = Field(0, ge=0, lt=2**63, description="seed for init and data order")

    @field_validator("dtype", mode="before")
    @classmethod
    def _alias(cls, v: str) -> str:
        v = str(v).removeprefix("torch.")
        if ALIASES.get(v, v) not in ("bfloat16", "float32"):
            raise ValueError(f"dtype {v!r} is not supported; use bf16 (bfloat16) or fp32 (float32)")
        return ALIASES.get(v, v)

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"betas must lie in [0, 1), got {v}")
        return v

    @model_validator(mode="after")
    def _warmup(self) -> TrainSpec:
        if self.warmup_steps > self.total_steps:
            raise ValueError(f"warmup_steps {self.warmup_steps} is longer than the run (total_steps "
                             f"{self.total_steps}): the learning rate would never reach its peak; lower warmup_steps "
                             "or raise total_steps")
        return self

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len * self.grad_accum
