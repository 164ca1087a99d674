"""Validation: the engine runs an evaluation program (planner/evaluation.py) as it runs a step program.

Where it sits: the Trainer calls `evaluate(engine, batches)` between steps. The evaluation program for this
rank's batch count is planned beside the engine's step program, emitted through codegen and compiled once
(`Evaluation.eval_module`), then run on the engine: `begin_eval` places the batches, the instructions stream
the weights through the step's slots with prefetch, and `end_eval` sums the batches' losses on the device in
batch order and reads the sum once. Units run in eval mode: MoE routing takes its inference rule (ET: the
pure threshold test). In a world every rank calls it with the same batches: each evaluates every R-th one, a
sharded unit's slot is completed by an all_gather, and the loss is summed across ranks.

Its events are the evaluation's own (planner/evaluation.py EVENT_PREFIX), recorded at an index no earlier
evaluation used, so neither a step nor a later evaluation can take one of its records for its own.
"""

from __future__ import annotations

import types

import torch

from megatrain.codegen import emit, load
from megatrain.models.loss import IGNORE_INDEX
from megatrain.planner.evaluation import eval_program


class Evaluation:
    """The engine's evaluation entry and exit (needs `ir`, `program`, `device`, `comm`, `losses`, `_place`)."""

    _eval_modules: dict[int, types.ModuleType]
    eval_events: int | None = None  # the event index of the evaluation running (None: a step is)
    _last_eval_events = -1

    def eval_module(self, n_batches: int) -> types.ModuleType:
        """The compiled evaluation program of `n_batches` batches beside this engine's step program."""
        if n_batches not in self._eval_modules:
            program = eval_program(self.ir, self.program, n_batches)
            source = emit(program, title=f"{self.ir.model}: evaluation of {n_batches} batch(es)")
            self._eval_modules[n_batches] = load(source, "megatrain_eval")
        return self._eval_modules[n_batches]

    def begin_eval(self, batch: list[tuple[torch.Tensor, ...]]) -> None:
        """Place this rank's validation batches on the device (the step's batch buffer: the step is done)."""
        self.eval_events = max(self.step_index, self._last_eval_events + 1)
        self._last_eval_events = self.eval_events
        self.eval_tokens = sum(int((mb[1] != IGNORE_INDEX).sum()) for mb in batch)  # on the host: no device sync
        self.losses = [torch.zeros((), dtype=torch.float32)] * len(batch)
        self._place(batch)

    def end_eval(self) -> float:
        """The mean token loss: the batches' losses summed on the device (one read of it), across ranks."""
        losses, result = self.losses, []

        def total():
            s = torch.zeros((), dtype=torch.float32, device=self.device.torch_device)
            for x in losses:  # in batch order, on the device: one read of the loss at the end, not one a batch
                s += x
            result.append(float(s))

        self.device.submit("compute", total, "end_eval()")
        try:
            self.device.synchronize()
        finally:
            self.eval_events = None
        loss, n_tokens = result[0], self.eval_tokens
        if self.comm is not None:
            loss, n_tokens = self.comm.sum([loss, float(n_tokens)], what="the evaluation loss")
        return loss / max(n_tokens, 1)


def evaluate(engine, batches: list[tuple[torch.Tensor, ...]]) -> float:
    """Mean token loss of `batches` under the current weights, after the step's streams drain: the evaluation
    program of this rank's share of them (every R-th in a world) run on `engine`."""
    engine.device.synchronize()
    mine = batches if engine.comm is None else batches[engine.comm.rank :: engine.comm.size]
    module = engine.eval_module(len(mine))
    for template in engine.templates.values():
        template.eval()
    try:
        return module.evaluate(engine, mine)
    finally:
        for template in engine.templates.values():
            template.train()
