"""Flat buffers: where each parameter of a unit lives in one buffer, and views into it that copy nothing.

Where it sits: ir/trace.py lays each unit out with `template_layout` (UnitIR.params); the runtime keeps one
flat buffer per unit on the host and per slot on the device, and binds a template to `views` of it
(models/units.py `run_unit`). A unit's buffers (MoE routing state, fp32) are packed after its parameters in
the slot (`slot_buffers`, `buffer_views`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from .model_ir import ParamSlice, TensorSpec, UnitIR

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


def pack(tensors: dict[str, Tensor], layout: Iterable[ParamSlice], numel: int, dtype=None, out=None) -> Tensor:
    """Copy named tensors into a flat buffer laid out as `layout` (padding zeroed)."""
    layout = list(layout)
    if out is None:
        first = tensors[layout[0].name]
        out = torch.zeros(numel, dtype=dtype or first.dtype, device=first.device)
    for p in layout:
        out[p.offset : p.offset + p.numel].copy_(tensors[p.name].reshape(-1))
    return out
