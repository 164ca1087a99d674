"""Flat parameter buffers and binding: run a stateless template on views into one buffer, copying nothing.

Where it sits: ir/trace.py computes each unit's layout with `flat_layout`; the runtime keeps one flat buffer
per unit on the host and per slot on the device, and runs units with `run_unit`. A unit's buffers (MoE
routing state, fp32) are packed after its parameters in the slot (`slot_buffers`, `buffer_views`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.func import functional_call

from megatrain.ir.model_ir import ParamSlice, TensorSpec, UnitIR

from .transformer import Carry, StepInputs

ALIGN = 32  # elements: offsets stay 64-byte aligned in bf16 and 128-byte aligned in fp32


def flat_layout(named_shapes: Iterable[tuple[str, tuple[int, ...]]]) -> tuple[tuple[ParamSlice, ...], int]:
    """Offsets of each parameter in a flat buffer, aligned; returns (slices, total elements)."""
    slices, offset = [], 0
    for name, shape in named_shapes:
        numel = 1
        for s in shape:
            numel *= s
        slices.append(ParamSlice(name=name, shape=tuple(shape), offset=offset, numel=numel))
        offset += -(-numel // ALIGN) * ALIGN
    return tuple(slices), offset


def template_layout(template: nn.Module) -> tuple[tuple[ParamSlice, ...], int]:
    return flat_layout((n, tuple(p.shape)) for n, p in template.named_parameters())


def views(flat: Tensor, layout: Iterable[ParamSlice]) -> dict[str, Tensor]:
    """Parameter views into `flat` by name: no copies."""
    return {p.name: flat[p.offset : p.offset + p.numel].view(p.shape) for p in layout}


def buffer_views(flat: Tensor, specs: Iterable[TensorSpec]) -> dict[str, Tensor]:
    """Buffer views into a flat fp32 tensor, packed in order with no padding: no copies."""
    out, offset = {}, 0
    for b in specs:
        out[b.name] = flat[offset : offset + b.numel].view(b.shape)
        offset += b.numel
    return out


def slot_buffers(slot: Tensor, unit: UnitIR, dtype: str) -> Tensor:
    """The flat fp32 region of a parameter slot (of compute dtype `dtype`) holding `unit`'s buffers."""
    start = unit.buffer_offset(dtype)
    return slot.view(torch.uint8)[start : start + unit.buffer_bytes].view(torch.float32)


def run_unit(template: nn.Module, params: dict[str, Tensor], carry: Carry, inputs: StepInputs,
             buffers: dict[str, Tensor] | None = None, **mode) -> Carry:
    """Run a template with bound parameters (and buffers) through torch.func.functional_call. `mode` goes to
    the template's forward (a depth mixing's record/side/rebuild, models/depth/depthssd.py)."""
    bound = params if not buffers else {**params, **buffers}
    return functional_call(template, bound, (carry, inputs), mode, strict=True)


def pack(tensors: dict[str, Tensor], layout: Iterable[ParamSlice], numel: int, dtype=None, out=None) -> Tensor:
    """Copy named tensors into a flat buffer laid out as `layout` (padding zeroed)."""
    layout = list(layout)
    if out is None:
        first = tensors[layout[0].name]
        out = torch.zeros(numel, dtype=dtype or first.dtype, device=first.device)
    for p in layout:
        out[p.offset : p.offset + p.numel].copy_(tensors[p.name].reshape(-1))
    return out
