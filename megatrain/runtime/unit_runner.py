"""How the engine runs a unit: its template bound to views of the slot holding its weights, on its inputs.

Where it sits: a mixin of the Engine (engine.py), whose forward and backward call it. A template (models/) is
bound to views of the slot (no copies) with torch.func.functional_call, tiled in chunks of the plan's
`ir.chunk_tokens` (models/tiled.py) when set, through its compiled runner where the run compiles units
(compiled.py). A forward keeping its graph, and a backward's recompute, run with autograd from the unit's
checkpoint; a replaying forward's attention record (models/replay.py) is kept only where the device ran the
kernel the trace saw.
"""

from __future__ import annotations

import warnings

import torch

from megatrain.ir.layout import buffer_views, slot_buffers, views
from megatrain.ir.model_ir import UnitIR
from megatrain.ir.trace import DTYPES
from megatrain.models import StepInputs, recompute_mode, run_unit
from megatrain.models.replay import Record, replay_attention


class UnitRunner:
    """Binding units to the engine's buffers (needs `bufs`, `ir`, `templates`, `runners`, `device`, `loss_chunk`,
    `unreplayed`)."""

    def _params(self, u: UnitIR, slot: int) -> dict[str, torch.Tensor]:
        return views(self.bufs[f"slot{slot}"], u.params)

    def _buffers(self, u: UnitIR, slot: int) -> dict[str, torch.Tensor] | None:
        """Views of the unit's buffers in its slot (None for a unit without)."""
        if not u.buffers:
            return None
        return buffer_views(slot_buffers(self.bufs[f"slot{slot}"], u, self.ir.dtype), u.buffers)

    def _run(self, u: UnitIR, params, carry, inputs, buffers, **mode):
        """Unit `u`'s template on bound parameters (models.run_unit, or its compiled runner)."""
        return self.runners[u.template](self.templates[u.template], params, carry, inputs, buffers, **mode)

    def _carry(self, u: UnitIR, mb: int) -> tuple[torch.Tensor, ...]:
        return () if not u.carry_in else self.bufs[f"carry.{u.name}.{mb}"]

    def _inputs(self, u: UnitIR, mb: int) -> StepInputs:
        tokens, targets, packed = self.bufs["batch"][mb]
        cos, sin = self.bufs["rope"]
        return StepInputs(tokens=tokens, targets=targets, cos=cos, sin=sin, loss_chunk=self.loss_chunk,
                          chunk_tokens=self.ir.chunk_tokens, **packed)

    def _forward_with_graph(self, u: UnitIR, slot: int, mb: int, side=None, recompute: bool = False, record=None):
        """Forward with autograd from the unit's checkpoint; returns (params, carry, out, saved bytes).
        `recompute`: for a backward that reads none of `out`'s values (models/units.py BlockUnit);
        `record`: (Record, its kept tensors) the recompute replays attention from (models/replay.py)."""
        params = {n: v.detach().requires_grad_() for n, v in self._params(u, slot).items()}
        buffers = self._buffers(u, slot)
        carry = tuple(c.detach().requires_grad_(c.is_floating_point()) for c in self._carry(u, mb))
        inputs = self._inputs(u, mb)
        # Saved bytes count what the graph adds: not the parameters, the carry, the batch or the RoPE tables.
        resident = (inputs.tokens, inputs.targets, inputs.cos, inputs.sin, *(buffers or {}).values())
        known = {t.untyped_storage().data_ptr() for t in (*params.values(), *carry, *resident)}
        saved: dict[int, int] = {}

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key not in known:
                saved[key] = t.untyped_storage().nbytes()
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mode = recompute_mode(u.kind) if recompute else {}
            if side is not None:
                mode["side"] = side
            if record is None:
                out = self._run(u, params, carry, inputs, buffers, **mode)
            else:  # eager: a compiled runner would not dispatch the fused call to the mode
                with replay_attention(*record):
                    out = run_unit(self.templates[u.template], params, carry, inputs, buffers, **mode)
        return params, carry, out, sum(saved.values())

    def _kept(self, u: UnitIR, rec: Record) -> tuple[torch.Tensor, ...] | None:
        """The tensors of a forward's attention record, or None where they are not the trace's (UnitIR.replay):
        a device whose SDPA chose another kernel than the one traced. The backward then recomputes attention,
        as without replay (same gradients, the time the plan saved not saved), and the run says so once."""
        got = [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in rec.tensors]
        want = [(tuple(s.shape), s.dtype) for s in u.replay]
        if got == want:
            return tuple(rec.tensors)
        if u.name not in self.unreplayed:
            self.unreplayed.add(u.name)
            warnings.warn(f"{u.name}: the device's fused attention ({', '.join(map(str, rec.ops))}) returned "
                          f"{got} where the plan traced {want}; its backward recomputes attention instead of "
                          "replaying it", RuntimeWarning, stacklevel=2)
        return None

    def _placeholder(self, u: UnitIR) -> tuple[torch.Tensor, ...]:
        """The attention buffer of a forward that could not record: the plan's shapes, nothing in them."""
        return tuple(self.device.empty(s.shape, DTYPES[s.dtype]) for s in u.replay)
