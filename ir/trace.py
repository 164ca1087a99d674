"""Tracing: build a ModelIR from a model config, on the meta device, with no weight memory.

Where it sits: first stage of the pipeline (docs/DESIGN.md 2): ModelConfig -> templates -> ModelIR -> planner.
Try it: `megatrain inspect --model llama3-70b --seq-len 8192`.

Each distinct (template, carry shapes) pair is traced once, however many units run it:
- torch.fx (make_fx) records the template's forward as a graph of aten ops (its node count is kept);
- FlopCounterMode counts forward and backward FLOPs;
- saved-tensor hooks measure what autograd keeps for backward (parameters and inputs excluded);
- a dispatch mode follows every storage an op creates until it dies, giving the transient peak inside the
  unit for a no-grad forward and for forward-with-grad followed by autograd.grad.
Units with MoE layers (models/moe.py) trace with static shapes: every expert takes the expected tokens, so
FLOPs are those of the expected active tokens; their memory is measured again with ET experts at training
capacity (routing.capacity_bound), so the plan bounds what a step can keep. Their buffers are recorded.
"""

from __future__ import annotations

import time
import weakref

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from megatrain.models import routing
from megatrain.models.binding import run_unit, template_layout
from megatrain.models.config import ModelConfig
from megatrain.models.moe import moe_layers
from megatrain.models.presets import load_model_config
from megatrain.models.transformer import (
    StepInputs,
    rope_tables,
    template_key,
    templates,
    tied_params,
    unit_names,
)

from .base import dtype_bytes
from .model_ir import ModelIR, TensorSpec, UnitIR

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
TARGETS = ("cuda", "cpu")
MAX_TOKENS = 2**21  # tokens per micro-batch: 2M, four 512k-token sequences

# FlopCounterMode knows CUDA's fused attention kernels but not the CPU's: count it with the same formulas.
_aten = torch.ops.aten
flop_registry.setdefault(_aten._scaled_dot_product_flash_attention_for_cpu,
                         flop_registry[_aten._scaled_dot_product_flash_attention])
flop_registry.setdefault(_aten._scaled_dot_product_flash_attention_for_cpu_backward,
                         flop_registry[_aten._scaled_dot_product_flash_attention_backward])


def _gqa_heads(formula, query: int):
    """A fused-attention FLOP formula that takes grouped-query shapes (fewer key/value heads, which the kernel
    broadcasts): key and value are counted at the query's head count. Older torch asserts equal heads."""
    if getattr(formula, "megatrain_gqa", False):
        return formula

    def count(*args, **kwargs):
        q = args[query]
        wide = [torch.empty((*t.shape[:1], q.shape[1], *t.shape[2:]), dtype=t.dtype, device="meta")
                if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[1] != q.shape[1] else t
                for t in args[query + 1 : query + 3]]
        return formula(*args[: query + 1], *wide, *args[query + 3 :], **kwargs)

    count.megatrain_gqa = True
    return count


def _any_out_dtype(formula):
    """addmm's FLOP formula for every overload: `addmm.dtype` passes its out_dtype positionally."""
    if getattr(formula, "megatrain_dtype", False):
        return formula

    def count(self, mat1, mat2, *_, out_val=None, **__):
        return formula(self, mat1, mat2, out_val=out_val)

    count.megatrain_dtype = True
    return count


for _op, _query in ((_aten._scaled_dot_product_flash_attention, 0),
                    (_aten._scaled_dot_product_flash_attention_for_cpu, 0),
                    (_aten._scaled_dot_product_flash_attention_backward, 1),
                    (_aten._scaled_dot_product_flash_attention_for_cpu_backward, 1)):
    flop_registry[_op] = _gqa_heads(flop_registry[_op], _query)
flop_registry[_aten.addmm] = _any_out_dtype(flop_registry[_aten.addmm])


def canonical_dtype(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    dtype = ALIASES.get(dtype, dtype)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported compute dtype {dtype!r}; use bf16 (bfloat16) or fp32 (float32)")
    return dtype


class _LiveBytes(TorchDispatchMode):
    """Follows storages created by ops: current and peak live bytes since the mode was entered."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key = storage._cdata
        if key in self.live:
            return
        n = storage.nbytes()
        self.live[key] = n
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)


def _unit_inputs(kind: str, config: ModelConfig, mb: int, seq: int, dt: torch.dtype, loss_chunk: int,
                 target: str, packed: bool = False):
    tokens = torch.zeros(mb, seq, dtype=torch.long)
    cos, sin = rope_tables(config, seq, dt)
    # a packed micro-batch is traced as one document per row: the most attention FLOPs and memory any
    # packing can need, plus the per-token RoPE gather that packing adds
    packing = dict(positions=tokens, segments=(((0, seq),),) * mb) if packed and kind == "block" else {}
    return StepInputs(tokens=tokens if kind == "embed" else None, targets=tokens if kind == "head" else None,
                      cos=cos, sin=sin, loss_chunk=loss_chunk, target=target, **packing)


def _buffers(template) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(b.shape, dtype=b.dtype) for n, b in template.named_buffers()}


def _measure_unit(template, carry_in: list[TensorSpec], inputs: StepInputs, dt: torch.dtype) -> dict:
    """_measure as a training step runs the unit; an ET unit's memory again at its routing capacity."""
    with routing.step_context(None, 1.0):
        m = _measure(template, carry_in, inputs, dt)
        if any(layer.moe.router == "et" for _, layer in moe_layers(template)):
            with routing.capacity_bound():
                bound = _measure(template, carry_in, inputs, dt)
            m.update({k: bound[k] for k in ("saved_bytes", "peak_fwd_bytes", "peak_bwd_bytes")})
    return m


def _measure(template, carry_in: list[TensorSpec], inputs: StepInputs, dt: torch.dtype) -> dict:
    """FLOPs, saved bytes, transient peaks and fx graph size of one template, all on meta tensors."""
    params = {n: torch.empty(p.shape, dtype=dt, requires_grad=True) for n, p in template.named_parameters()}
    buffers = _buffers(template)
    carry = tuple(torch.empty(s.shape, dtype=DTYPES[s.dtype], requires_grad=True) for s in carry_in)
    known = {t.untyped_storage()._cdata for t in (*params.values(), *buffers.values(), *carry)}
    for t in (inputs.tokens, inputs.targets, inputs.cos, inputs.sin):
        if t is not None:
            known.add(t.untyped_storage()._cdata)

    graph = make_fx(lambda p, c: run_unit(template, p, c, inputs, buffers))(params, carry)
    graph_nodes = len(graph.graph.nodes)

    with torch.no_grad(), _LiveBytes() as fwd_mem:
        out = run_unit(template, params, carry, inputs, buffers)
    del out

    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        key = t.untyped_storage()._cdata
        if key not in known:
            saved[key] = t.untyped_storage().nbytes()
        return t

    fwd_flops, bwd_flops = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with _LiveBytes() as bwd_mem, torch.enable_grad():  # a caller's no_grad() must not hide the backward
        with fwd_flops, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run_unit(template, params, carry, inputs, buffers)
        grads_out = [torch.ones_like(o) for o in out]
        with bwd_flops:
            grads = torch.autograd.grad(out, [*params.values(), *carry], grads_out, allow_unused=True)
        del out, grads, grads_out
    return dict(flops_fwd=fwd_flops.get_total_flops(), flops_bwd=bwd_flops.get_total_flops(),
                saved_bytes=sum(saved.values()), peak_fwd_bytes=fwd_mem.peak, peak_bwd_bytes=bwd_mem.peak,
                graph_nodes=graph_nodes)


def _carry_out(template, carry_in: list[TensorSpec], inputs: StepInputs, dt: torch.dtype, unit: str):
    """The carry-out specs of one no-grad forward, and the bytes a unit that can rebuild its carry-in from its
    carry-out records in that forward (None for other units)."""
    params = {n: torch.empty(p.shape, dtype=dt) for n, p in template.named_parameters()}
    carry = tuple(torch.empty(s.shape, dtype=DTYPES[s.dtype]) for s in carry_in)
    rebuild = getattr(template, "can_rebuild", False)
    with torch.no_grad():
        out = run_unit(template, params, carry, inputs, _buffers(template), **({"record": True} if rebuild else {}))
    out, side = out if rebuild else (out, None)
    for i, t in enumerate(out):
        if not t.is_contiguous():  # an offloaded copy would be contiguous, and kernels may sum differently
            raise ValueError(f"unit {unit} returns a non-contiguous carry (output {i}); make it .contiguous()")
    specs = [TensorSpec(name=f"{unit}.out{i}", shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
             for i, t in enumerate(out)]
    return specs, (sum(t.nbytes for t in side) if side is not None else None)


def trace(model: str | ModelConfig, micro_batch: int, seq_len: int, dtype: str | torch.dtype = "bfloat16",
          loss_chunk: int = 1024, target: str = "cuda", packed: bool = False) -> ModelIR:
    """Trace `model` (a preset name, a config file, or a ModelConfig) for micro-batches of
    `micro_batch x seq_len` tokens computed in `dtype`, as the `target` ("cuda" or "cpu") runs it; `packed`
    for micro-batches that pack several documents per row (attention within each document)."""
    t0 = time.perf_counter()
    config = load_model_config(model)
    if micro_batch <= 0 or seq_len <= 0:
        raise ValueError(f"micro_batch and seq_len must be positive, got {micro_batch} and {seq_len}")
    if micro_batch * seq_len > MAX_TOKENS:
        raise ValueError(f"micro_batch x seq_len = {micro_batch * seq_len:,} tokens exceeds {MAX_TOKENS:,} per "
                         "micro-batch; use a smaller --micro-batch and more --grad-accum")
    if seq_len > config.max_seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the model's max_seq_len {config.max_seq_len}; "
                         "lower --seq-len or raise max_seq_len in the config")
    if config.sliding_window is not None and seq_len > config.sliding_window:
        raise ValueError(f"seq_len {seq_len} exceeds the model's sliding attention window of {config.sliding_window} "
                         "tokens, which megatrain does not implement (it attends fully); use --seq-len "
                         f"{config.sliding_window} or less")
    if target not in TARGETS:
        raise ValueError(f"unknown trace target {target!r}; use one of {', '.join(TARGETS)}")
    dname = canonical_dtype(dtype)
    dt = DTYPES[dname]
    tmpls = templates(config)
    cache: dict[tuple, dict] = {}
    units: list[UnitIR] = []
    carry_in: list[TensorSpec] = []
    with torch.device("meta"):
        for index, name in enumerate(unit_names(config)):
            key = template_key(config, name)
            kind = tmpls[key].kind
            tmpl = tmpls[key]
            inputs = _unit_inputs(kind, config, micro_batch, seq_len, dt, loss_chunk, target, packed)
            cache_key = (key, tuple((s.shape, s.dtype) for s in carry_in))
            if cache_key not in cache:
                layout, numel = template_layout(tmpl)
                out, rebuild_bytes = _carry_out(tmpl, carry_in, inputs, dt, name)
                buffers = tuple(TensorSpec(name=n, shape=tuple(b.shape), dtype="float32")
                                for n, b in tmpl.named_buffers())
                cache[cache_key] = dict(layout=layout, flat_numel=numel, carry_out=out, buffers=buffers,
                                        rebuild_bytes=rebuild_bytes,
                                        **_measure_unit(tmpl, carry_in, inputs, dt))
            m = cache[cache_key]
            carry_out = [s.replace(name=f"{name}.out{i}") for i, s in enumerate(m["carry_out"])]
            units.append(UnitIR(
                name=name, index=index, kind=kind, template=key, params=m["layout"], flat_numel=m["flat_numel"],
                tied=tied_params(config, name), buffers=m["buffers"],
                carry_in=tuple(s.replace(name=f"{name}.in{i}") for i, s in enumerate(carry_in)),
                carry_out=tuple(carry_out), flops_fwd=m["flops_fwd"], flops_bwd=m["flops_bwd"],
                saved_bytes=m["saved_bytes"], peak_fwd_bytes=m["peak_fwd_bytes"],
                peak_bwd_bytes=m["peak_bwd_bytes"], graph_nodes=m["graph_nodes"], rebuild_bytes=m["rebuild_bytes"]))
            carry_in = [] if kind == "head" else carry_out
    names = [u.name for u in units]
    edges = [(a, b, "carry") for a, b in zip(names, names[1:])]
    edges += [(u.tied[p].split(".")[0], u.name, "tied") for u in units for p in u.tied]
    hd = config.head_dim
    resident = (TensorSpec(name="rope.cos", shape=(seq_len, hd), dtype=dname),
                TensorSpec(name="rope.sin", shape=(seq_len, hd), dtype=dname))
    return ModelIR(model=config.name, config=config.model_dump(), micro_batch=micro_batch, seq_len=seq_len,
                   dtype=dname, target=target, packed=packed, units=tuple(units), resident=resident, edges=tuple(edges),
                   trace_seconds=time.perf_counter() - t0)


__all__ = ["trace", "canonical_dtype", "dtype_bytes"]
