"""One quality run, shared by the small-scale quality benchmarks (quality_depth_mixing.py, quality_moe.py).

A run trains `config` with the streamed runtime (Trainer, sim device, a budget the whole model fits) for
`steps` of 8 x 128 byte tokens from the built-in corpus, fp32, AdamW lr 3e-3 (10% warmup, cosine), weight
decay 0.1, clip 1.0; `seed` fixes init and data order, so every model of a seed sees the same tokens in the
same order. It ends with the validation loss over 32 x 8 x 128 held-out tokens.
"""

from __future__ import annotations

import statistics
import time

from megatrain.models import ModelConfig
from megatrain.planner import TrainSpec
from megatrain.runtime.config import RunConfig
from megatrain.runtime.trainer import Trainer

BUDGET = 256 * 2**20  # the whole model fits: the runs measure the model, not streaming
VAL_BATCHES = 32


def train_spec(steps: int, seed: int = 0) -> TrainSpec:
    return TrainSpec(micro_batch=8, seq_len=128, grad_accum=1, dtype="fp32", lr=3e-3, warmup_steps=steps // 10,
                     total_steps=steps, weight_decay=0.1, clip_norm=1.0, seed=seed)


def train_run(config: ModelConfig, seed: int, steps: int, data, host_policy: str = "exact",
              lr_scale: float = 1.0) -> tuple[dict, list[dict]]:
    """(summary, the last tenth of the step records). The summary: validation loss, mean train loss over the
    last tenth, median tokens/s (the first step excluded), parameters and wall seconds. `host_policy`: how the
    host holds AdamW state (megatrain/planner/host_policy.py); `lr_scale` multiplies the learning rate."""
    t0 = time.perf_counter()
    spec = train_spec(steps, seed)
    with Trainer(RunConfig(model=config, train=spec.replace(lr=spec.lr * lr_scale), gpu_mem=BUDGET, device="sim",
                           data=data[0], val_data=data[1], host_policy=host_policy)) as t:
        records = t.run(steps, progress=False)
        val = t.validation_loss(VAL_BATCHES)
    tail = records[-max(1, steps // 10):]
    return {"seed": seed, "val_loss": val, "train_loss": statistics.mean(r["loss"] for r in tail),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records[1:]), "params": config.n_params(),
            "seconds": time.perf_counter() - t0}, tail
