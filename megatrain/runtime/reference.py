"""Eager PyTorch training of the same model: the ground truth streamed training must equal.

Where it sits: tests (exactness) and benchmarks (the eager-with-checkpointing baseline) call it. It uses
`build_eager` and torch.optim.AdamW exactly as a PyTorch user would, with the same learning-rate schedule
(`optim.lr_at`), the same weight-decay groups (`optim.param_groups`: matrices only) and
torch.nn.utils.clip_grad_norm_; nothing of the streaming runtime.

Host policies (planner/host_policy.py): `host_policy="exact"` is torch.optim.AdamW as above. Any other policy
trains with `PolicyAdamW`: the host store's own step (host_state.adamw_step) on the model's parameters, with the
gradients rounded to the policy's held dtype after the clip norm is taken from them in fp32, as the streamed
step does (norms on the device, rounding on the way to the host). Same function, same values: streamed
training under a policy equals this bit for bit.

MoE models: each block's forward runs in a routing step context (models/routing.py) with its own log per
micro-batch; after optimizer.step() every block's routing buffers are updated from its logs, the update the
host store applies after each unit's AdamW step. A checkpointed block's recompute records nothing.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from megatrain.models import ModelConfig, StepInputs, build_eager, decays, packing, rope_tables, routing
from megatrain.models.loss import IGNORE_INDEX
from megatrain.models.moe import moe_layers, update_buffers
from megatrain.planner.host_policy import resolve
from megatrain.planner.train import TrainSpec

from .host_adamw import grad_dtype, new_moments
from .host_state import adamw_step
from .optim import clip_coefficient, lr_at, param_groups


def _loss_sum(model, tokens, targets, checkpoint_blocks: bool, loss_chunk: int, logs: list[routing.RoutingLog],
              loss_scale: float, positions=None, chunk_tokens: int | None = None) -> torch.Tensor:
    """The model's own loss (its head's chunked cross-entropy), optionally with per-block activation
    checkpointing, the usual memory-saving baseline. Block i records its routing statistics in logs[i].
    `positions` (B, T) for a packed micro-batch; `chunk_tokens` tiles the units as a plan's ModelIR says."""
    cos, sin = rope_tables(model.config, tokens.shape[1], model.embed.embed_tokens.weight.dtype, tokens.device)
    packed = packing(positions.cpu(), tokens.device) if positions is not None else {}
    inputs = StepInputs(tokens=tokens, targets=targets, cos=cos, sin=sin, loss_chunk=loss_chunk,
                        chunk_tokens=chunk_tokens, **packed)
    carry = model.embed((), inputs)
    for block, log in zip(model.blocks, logs):
        run = _routed(block, log, loss_scale)
        carry = checkpoint(run, carry, inputs, use_reentrant=False) if checkpoint_blocks else run(carry, inputs)
    return model.head(carry, inputs)[0]


def _routed(block, log: routing.RoutingLog, loss_scale: float):
    """block(carry, inputs) in a routing step context that records in `log` on the first call only (a
    checkpoint's recompute routes the same way and must not record again)."""
    calls = 0

    def run(carry, inputs):
        nonlocal calls
        calls += 1
        with routing.step_context(log if calls == 1 else None, loss_scale):
            return block(carry, inputs)

    return run


class PolicyAdamW:
    """AdamW under a host policy on named parameters: the host store's step (host_state.adamw_step) with
    the clip factor from the fp32 gradients' global norm and the gradients rounded to the policy's held dtype."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], cfg: TrainSpec, policy: str):
        self.policy, self.cfg = resolve(policy), cfg
        self.params = [p for _, p in named]
        self.decay = [decays(n, tuple(p.shape)) for n, p in named]
        self.moments = [new_moments(self.policy, tuple(p.shape), n) for n, p in named]
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in self.params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self, lr: float) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        clip = None
        if self.cfg.clip_norm is not None:
            clip = clip_coefficient(torch.nn.utils.get_total_norm(grads), self.cfg.clip_norm)
        held = [g.to(grad_dtype(self.policy)) for g in grads]
        adamw_step(self.policy, [p.detach() for p in self.params], held, self.moments, self.steps, self.cfg, lr,
                   self.decay, clip)


class EagerTrainer:
    """build_eager + torch.optim.AdamW (fused, as the host store runs it), one step per call; under another
    host policy, PolicyAdamW."""

    def __init__(self, config: ModelConfig, optim: TrainSpec, seed: int = 0, dtype: torch.dtype = torch.float32,
                 checkpoint_blocks: bool = False, loss_chunk: int = 1024, host_policy: str = "exact",
                 chunk_tokens: int | None = None):
        self.model = build_eager(config, seed=seed, dtype=dtype)
        self.optim, self.checkpoint_blocks, self.loss_chunk = optim, checkpoint_blocks, loss_chunk
        self.chunk_tokens = chunk_tokens
        self.host_policy = resolve(host_policy).name
        if self.host_policy == "exact":
            self.opt = torch.optim.AdamW(param_groups(list(self.model.named_parameters()), optim), lr=optim.lr,
                                         betas=optim.betas, eps=optim.eps, fused=True)
        else:
            self.opt = PolicyAdamW(list(self.model.named_parameters()), optim, self.host_policy)
        self.step_index = 0
        self.routing_logs: list[list[routing.RoutingLog]] = []  # the last step's, per micro-batch and block

    def step(self, micro_batches: list[tuple[torch.Tensor, ...]]) -> float:
        """One optimizer step over the micro-batches ((tokens, targets) or (tokens, targets, positions) for
        packed ones); returns the mean token loss."""
        lr = lr_at(self.optim, self.step_index)
        for group in getattr(self.opt, "param_groups", ()):
            group["lr"] = lr
        n_tokens = sum(int((mb[1] != IGNORE_INDEX).sum()) for mb in micro_batches)
        total = 0.0
        self.opt.zero_grad(set_to_none=True)
        self.routing_logs = [[routing.RoutingLog() for _ in self.model.blocks] for _ in micro_batches]
        for (tokens, targets, *positions), logs in zip(micro_batches, self.routing_logs):
            loss = _loss_sum(self.model, tokens, targets, self.checkpoint_blocks, self.loss_chunk, logs,
                             1.0 / n_tokens, *positions, chunk_tokens=self.chunk_tokens)
            (loss / n_tokens).backward()
            total += float(loss.detach())
        self._update(lr)
        for i, block in enumerate(self.model.blocks):
            if moe_layers(block):
                update_buffers(block, dict(block.named_buffers()), [logs[i].records for logs in self.routing_logs])
        self.step_index += 1
        return total / n_tokens

    def _update(self, lr: float) -> None:
        """The optimizer step on the model's gradients (clipped first when the spec clips)."""
        if isinstance(self.opt, PolicyAdamW):
            self.opt.step(lr)  # clips inside, as the host store does
        else:
            if self.optim.clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim.clip_norm)
            self.opt.step()

    def routing_metrics(self) -> dict:
        """The last step's routing metrics, as Engine.routing_metrics reports them."""
        moe = self.model.config.moe
        if moe is None:
            return {}
        logs = {f"blocks.{i}": [logs[i].records for logs in self.routing_logs] for i in range(len(self.model.blocks))}
        return routing.summarize(logs, moe.top_k)


def eager_train(config: ModelConfig, batches: list[list[tuple[torch.Tensor, torch.Tensor]]], optim: TrainSpec,
                seed: int = 0, dtype: torch.dtype = torch.float32, checkpoint_blocks: bool = False,
                loss_chunk: int = 1024, host_policy: str = "exact", chunk_tokens: int | None = None):
    """Train for len(batches) steps; each step is a list of (tokens, targets) micro-batches; `chunk_tokens`
    tiles the units (a plan's `ir.chunk_tokens`).

    Returns (model, losses): the per-step mean token loss, like the streamed engine reports."""
    trainer = EagerTrainer(config, optim, seed, dtype, checkpoint_blocks, loss_chunk, host_policy, chunk_tokens)
    losses = [trainer.step(b) for b in batches]
    return trainer.model, losses


class MixedEagerTrainer(EagerTrainer):
    """fp32 master weights, compute in `compute_dtype` (bf16): the usual mixed precision, and what a bf16
    streamed run does. Each step the masters are rounded into a compute copy of the model (torch's
    `.to(bfloat16)` bits, whichever place a plan casts at: planner/cast.py), every micro-batch runs forward and
    backward on it, its gradients are summed into fp32 master gradients (the first copied, later ones added in
    fp32, as the streamed gradient slot accumulates), and the optimizer steps the masters. Dense models only."""

    def __init__(self, config: ModelConfig, optim: TrainSpec, seed: int = 0,
                 compute_dtype: torch.dtype = torch.bfloat16, loss_chunk: int = 1024, host_policy: str = "exact"):
        if config.moe is not None:
            raise ValueError("MixedEagerTrainer trains dense models; an MoE's routing buffers are not stepped here")
        super().__init__(config, optim, seed, torch.float32, loss_chunk=loss_chunk, host_policy=host_policy)
        self.compute = build_eager(config, seed=seed, dtype=compute_dtype)

    def step(self, micro_batches: list[tuple[torch.Tensor, ...]]) -> float:
        lr = lr_at(self.optim, self.step_index)
        for group in getattr(self.opt, "param_groups", ()):
            group["lr"] = lr
        masters = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, p in self.compute.named_parameters():
                p.copy_(masters[name])
        n_tokens = sum(int((mb[1] != IGNORE_INDEX).sum()) for mb in micro_batches)
        total = 0.0
        self.opt.zero_grad(set_to_none=True)
        for tokens, targets, *positions in micro_batches:
            self.compute.zero_grad(set_to_none=True)
            logs = [routing.RoutingLog() for _ in self.compute.blocks]
            loss = _loss_sum(self.compute, tokens, targets, self.checkpoint_blocks, self.loss_chunk, logs,
                             1.0 / n_tokens, *positions)
            (loss / n_tokens).backward()
            total += float(loss.detach())
            for name, p in self.compute.named_parameters():
                m, g = masters[name], p.grad if p.grad is not None else torch.zeros_like(p)
                if m.grad is None:
                    m.grad = g.float()
                else:
                    m.grad.add_(g)
        self._update(lr)
        self.step_index += 1
        return total / n_tokens


def mixed_train(config: ModelConfig, batches: list[list[tuple[torch.Tensor, torch.Tensor]]], optim: TrainSpec,
                seed: int = 0, host_policy: str = "exact"):
    """MixedEagerTrainer over `batches` in the TrainSpec's compute dtype; returns (fp32 master model, losses)."""
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[optim.dtype]
    trainer = MixedEagerTrainer(config, optim, seed, dtype, host_policy=host_policy)
    losses = [trainer.step(b) for b in batches]
    return trainer.model, losses
