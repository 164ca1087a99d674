"""Host optimizer pieces: the learning-rate schedule, global-norm clipping, AdamW's weight-decay groups.

The hyperparameters are the TrainSpec's (planner/train.py): one source for planner, runtime and reference.

Where it sits: the host store (store.py) applies AdamW unit by unit on its fp32 flat masters under its host
policy (host_state.py, torch's fused CPU kernel); the trainer asks `lr_at(step)` before each step. The eager
reference in tests uses the same `lr_at`, so schedules cannot drift apart.
"""

from __future__ import annotations

import math

import torch

from megatrain.planner.train import TrainSpec


def lr_at(cfg: TrainSpec, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warmup over `warmup_steps` (lr*(s+1)/W, or
    under warmup_style "hf" lr*s/W as transformers' schedulers), then the TrainSpec's schedule from lr down to
    min_lr_ratio * lr at `total_steps` (cosine, linear, constant, or wsd: constant until the last
    `decay_fraction` of the post-warmup steps, then linear). After warmup both styles agree with transformers'
    linear and cosine schedules at min_lr_ratio 0."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + (cfg.warmup_style != "hf")) / cfg.warmup_steps
    span = cfg.total_steps - cfg.warmup_steps
    if span <= 0 or cfg.schedule == "constant":
        return cfg.lr
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "wsd":
        decay = cfg.decay_fraction * span
        progress = min(1.0, max(0.0, (step - (cfg.total_steps - decay)) / decay))
    else:
        progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "cosine":
        return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr - (cfg.lr - floor) * progress


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor torch.nn.utils.clip_grad_norm_ multiplies gradients by."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def param_groups(named: list[tuple[str, torch.Tensor]], cfg: TrainSpec) -> list[dict]:
    """torch.optim parameter groups with the host store's weight-decay rule (models.decays): the eager
    reference and users' own loops train what the streamed store trains."""
    from megatrain.models import decays

    groups = [{"params": [p for n, p in named if decays(n, tuple(p.shape))], "weight_decay": cfg.weight_decay},
              {"params": [p for n, p in named if not decays(n, tuple(p.shape))], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
