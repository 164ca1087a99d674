"""Attention replay: a recompute takes the fused attention's outputs from its forward instead of running it.

Where it sits: a block's backward recomputes its forward from the checkpoint (runtime/engine.py). At long
context the fused causal attention is most of that forward (90% of a 7B block's FLOPs at 256k tokens), and
its output is small: the attention output (B, H, T, hd) in the compute dtype, the size of the block's input,
and its log-sum-exp (B, H, T) in fp32. So a block the planner marks `replay` (planner/placement.py) records
them in its forward (`record_attention`), the program keeps them with the checkpoint (buffer
`attn.{unit}.{mb}`, on device or offloaded with it), and the backward's recompute runs under
`replay_attention`: the fused op returns the recorded tensors instead of computing, below autograd, so
autograd records the very node it records in the forward, saving the same query, key, value, output and
log-sum-exp. The backward then runs the same kernel on the same values: the gradients are the same bits.
Try it: `pytest tests/models/test_replay.py -q`.

Both modes intercept only the fused attention kernels SDPA dispatches to (the CPU's flash kernel, CUDA's
flash, memory-efficient and cuDNN kernels); a recompute that calls another, or calls them in another order
or on other shapes, is refused rather than replayed wrongly. The contexts only make a mode current for this
thread; the model enters it around each attention call alone (`attention_scope`, models/layers.py
causal_attention), so the block's other ops never pass through Python dispatch: over the whole block, every
op did, and `small`'s streamed step at 56 MiB (2 x 128 tokens, CPU) ran 8% slower with replay than without.
Packed micro-batches attend per document with a data-dependent number of calls, so only unpacked units replay
(ir/trace.py records nothing for them).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
FUSED = (aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_flash_attention.default,
         aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default)
# the kernels whose log-sum-exp is computed only when asked (a no-grad forward does not): their flag's position
_LSE_ARG = {aten._scaled_dot_product_efficient_attention.default: 4,
            aten._scaled_dot_product_cudnn_attention.default: 4}
KEPT = 2  # of each call's outputs, the attention output and its log-sum-exp travel with the checkpoint


@dataclass
class Record:
    """What one unit's forward recorded: per fused call, its op, the query's shape, and its outputs. `tensors`
    are the outputs the program holds (KEPT per call, the buffer `attn.{unit}.{mb}`); `rest` the others (CUDA
    kernels' sequence offsets, maxima and RNG state: scalars or empty), which stay where they are."""

    ops: list = field(default_factory=list)
    shapes: list = field(default_factory=list)
    tensors: list = field(default_factory=list)
    rest: list = field(default_factory=list)


def _with_lse(func, args, kwargs):
    at = _LSE_ARG.get(func)
    if at is None:
        return args, kwargs
    if "compute_log_sumexp" in kwargs:
        return args, {**kwargs, "compute_log_sumexp": True}
    if len(args) > at:
        return (*args[:at], True, *args[at + 1:]), kwargs
    return args, {**kwargs, "compute_log_sumexp": True}


class _Recording(TorchDispatchMode):
    def __init__(self, record: Record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in FUSED:
            return func(*args, **kwargs)
        args, kwargs = _with_lse(func, args, kwargs)
        out = func(*args, **kwargs)
        r = self.record
        r.ops.append(func)
        r.shapes.append(tuple(args[0].shape))
        r.tensors.extend(out[:KEPT])
        r.rest.append(tuple(out[KEPT:]))
        return out


class _Replaying(TorchDispatchMode):
    def __init__(self, record: Record, tensors):
        super().__init__()
        self.record, self.tensors, self.calls = record, tuple(tensors), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in FUSED:
            return func(*args, **kwargs)
        r, k = self.record, self.calls
        if k >= len(r.ops) or r.ops[k] is not func or r.shapes[k] != tuple(args[0].shape):
            want = f"{r.ops[k]} on a query of shape {r.shapes[k]}" if k < len(r.ops) else "no further call"
            raise RuntimeError(f"attention replay: the recompute's fused attention call {k} is {func} on a query "
                               f"of shape {tuple(args[0].shape)}, but its forward recorded {want}; plan this unit "
                               "without replay")
        self.calls += 1
        # fresh tensor objects on the recorded storage: autograd attaches its node to them, not to the buffer's
        kept = tuple(t.detach() for t in self.tensors[KEPT * k : KEPT * (k + 1)])
        return (*kept, *r.rest[k])


_current = threading.local()  # .mode: the record or replay mode of this thread's unit, or None


@contextlib.contextmanager
def _current_mode(mode: TorchDispatchMode):
    before = getattr(_current, "mode", None)
    _current.mode = mode
    try:
        yield mode
    finally:
        _current.mode = before


def attention_scope():
    """The current record or replay mode, to enter around one attention call (a no-op context without one)."""
    mode = getattr(_current, "mode", None)
    return mode if mode is not None else contextlib.nullcontext()


def record_attention(record: Record):
    """A context in which this thread's fused attention calls run (their log-sum-exp computed) and are
    appended to `record`."""
    return _current_mode(_Recording(record))


@contextlib.contextmanager
def replay_attention(record: Record, tensors=None):
    """A context in which this thread's fused attention calls return `record`'s outputs in order, computing
    nothing; `tensors`: the kept outputs where they are now (the checkpoint reloaded), default the recorded
    ones. Refused at the end if the calls were fewer than recorded."""
    with _current_mode(_Replaying(record, record.tensors if tensors is None else tensors)) as mode:
        yield mode
    if mode.calls != len(record.ops):
        raise RuntimeError(f"attention replay: the forward recorded {len(record.ops)} fused attention "
                           f"call(s), the recompute made {mode.calls}; plan this unit without replay")
