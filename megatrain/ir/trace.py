"""Tracing: build a ModelIR from a model config, on the meta device, with no weight memory.

Where it sits: first stage of the pipeline (docs/DESIGN.md 2): ModelConfig -> templates -> ModelIR -> planner.
Try it: `megatrain inspect --model llama3-70b --seq-len 8192`.

Each distinct (template, carry shapes) pair is traced once, however many units run it:
- torch.fx (make_fx) records the template's forward as a graph of aten ops, whose node count prices per-op
  overhead (`graph_nodes`; a scaled trace counts the ops its no-grad forward dispatches, plus inputs and
  output, instead: make_fx is most of a trace's time);
- FlopCounterMode's formulas count forward and backward FLOPs (scaled.FlopCount, without its module hooks,
  from a copy of torch's table completed for the CPU's attention: neither import nor trace changes torch's);
- saved-tensor hooks measure what autograd keeps for backward (parameters and inputs excluded);
- a dispatch mode follows every storage an op creates until it dies, giving the transient peak inside the
  unit for a no-grad forward and for forward-with-grad followed by autograd.grad.
Long sequences (over LONG_SEQ tokens) are traced at a short length and scaled exactly (scaled.py), so the
cost does not grow with the sequence; they are also priced untiled and at each candidate chunk size
(`UnitIR.chunk_options`) for the planner's `chunks` pass, which sets `ModelIR.chunk_tokens`.
Units with MoE layers (models/moe.py) trace with static shapes: every expert takes the expected tokens, so
FLOPs are those of the expected active tokens; their memory is measured again with ET experts at training
capacity (routing.capacity_bound), so the plan bounds what a step can keep. Their buffers are recorded.
"""

from __future__ import annotations

import time
from collections import Counter

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from megatrain.models import replay, routing, tiled
from megatrain.models.config import ModelConfig
from megatrain.models.layers import StepInputs, rope_tables
from megatrain.models.moe import moe_layers
from megatrain.models.presets import load_model_config
from megatrain.models.units import recompute_mode, run_unit, template_key, templates, tied_params, unit_names

from .base import dtype_bytes
from .layout import template_layout
from .model_ir import ChunkFigures, ModelIR, TensorSpec, UnitIR
from .scaled import FlopCount, LiveBytes, Measured, Scale, choose_scale

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
TARGETS = ("cuda", "cpu")
MAX_TOKENS = 2**21  # tokens per micro-batch: 2M, four 512k-token sequences
LONG_SEQ = 8192  # longer sequences are traced at a short length and scaled, and priced at several chunk sizes
MIN_CHUNK = 512  # the smallest chunk a trace prices for the planner's chunks pass

def canonical_dtype(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    dtype = ALIASES.get(dtype, dtype)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported compute dtype {dtype!r}; use bf16 (bfloat16) or fp32 (float32)")
    return dtype


def _unit_inputs(kind: str, config: ModelConfig, mb: int, seq: int, dt: torch.dtype, loss_chunk: int,
                 target: str, packed: bool = False, chunk: int | None = None):
    tokens = torch.zeros(mb, seq, dtype=torch.long)
    cos, sin = rope_tables(config, seq, dt)
    # a packed micro-batch is traced as one document per row: the most attention FLOPs and memory any
    # packing can need, plus the per-token RoPE gather that packing adds
    packing = dict(positions=tokens, segments=(((0, seq),),) * mb) if packed and kind == "block" else {}
    return StepInputs(tokens=tokens if kind == "embed" else None, targets=tokens if kind == "head" else None,
                      cos=cos, sin=sin, loss_chunk=loss_chunk, target=target, chunk_tokens=chunk, **packing)


def _buffers(template) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(b.shape, dtype=b.dtype) for n, b in template.named_buffers()}


def _measure_unit(template, carry_in: list[TensorSpec], inputs: StepInputs, dt: torch.dtype,
                  scale: Scale | None) -> Measured:
    """_measure as a training step runs the unit; an ET unit's memory again at its routing capacity."""
    with routing.step_context(None, 1.0):
        m = _measure(template, carry_in, inputs, dt, scale)
        if any(layer.moe.router == "et" for _, layer in moe_layers(template)):
            with routing.capacity_bound():
                bound = _measure(template, carry_in, inputs, dt, scale)
            m.saved, m.fwd_sums, m.bwd_sums = bound.saved, bound.fwd_sums, bound.bwd_sums
            m.bwd_replay_sums = bound.bwd_replay_sums
    return m


def _measure(template, carry_in: list[TensorSpec], inputs: StepInputs, dt: torch.dtype, scale: Scale | None) -> Measured:
    """FLOPs, saved bytes, transient peaks and fx graph size of one template, all on meta tensors, classed by
    `scale` so that they can be evaluated at other sequence lengths and chunk sizes (scaled.py)."""
    params = {n: torch.empty(p.shape, dtype=dt, requires_grad=True) for n, p in template.named_parameters()}
    buffers = _buffers(template)
    carry = tuple(torch.empty(s.shape, dtype=DTYPES[s.dtype], requires_grad=True) for s in carry_in)
    existing = [*params.values(), *buffers.values(), *carry,
                *(t for t in (inputs.tokens, inputs.targets, inputs.cos, inputs.sin, inputs.positions) if t is not None)]
    known = {t.untyped_storage()._cdata for t in existing}

    graph_nodes = None
    if scale is None:  # NOTE: make_fx is most of a trace's time; a scaled trace counts dispatched ops instead
        graph = make_fx(lambda p, c: run_unit(template, p, c, inputs, buffers))(params, carry)
        graph_nodes = len(graph.graph.nodes)

    before = Counter(tiled.iterations())
    fwd_flops, rec_flops, bwd_flops = FlopCount(), FlopCount(), FlopCount()
    with torch.no_grad(), LiveBytes(scale, existing) as fwd_mem, fwd_flops:
        out = run_unit(template, params, carry, inputs, buffers)
        fwd_mem.exclude(out)  # the next unit's carry (the head's: the loss), a program buffer
    del out
    iters = tiled.iterations() - before

    saved: dict[int, tuple] = {}
    with LiveBytes(scale, existing) as bwd_mem, torch.enable_grad():  # a caller's no_grad() must not hide the backward

        def pack(t: torch.Tensor):
            key = t.untyped_storage()._cdata
            if key not in known:
                saved[key] = bwd_mem.storage_class(t)
            return t

        # as a backward's recompute runs it (a forward that keeps its graph saves the same tensors)
        with rec_flops, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run_unit(template, params, carry, inputs, buffers, **recompute_mode(template.kind))
        grads_out = [torch.ones_like(o) for o in out]
        with bwd_flops:
            grads = torch.autograd.grad(out, [*params.values(), *carry], grads_out, allow_unused=True)
        # the incoming gradient and the carry's gradient are program buffers (dcarry); the recomputed output
        # and the parameters' gradients are the backward's own
        bwd_mem.exclude([*grads_out, *(g for g in grads[len(params):] if g is not None)])
        fwd_sums, bwd_sums = fwd_mem.sums, bwd_mem.sums
        del out, grads, grads_out
    saved_classes: Counter = Counter()
    for cls, n in saved.values():
        saved_classes[cls] += n
    replay_sums = _measure_replay(template, params, carry, inputs, buffers, existing, scale, dt)
    return Measured(scale=scale, loss_chunk=inputs.loss_chunk, flops_fwd=fwd_flops.counts,
                    flops_bwd=bwd_flops.counts, flops_recompute=rec_flops.counts, saved=saved_classes, fwd_sums=fwd_sums,
                    bwd_sums=bwd_sums, bwd_replay_sums=replay_sums, graph_nodes=graph_nodes if graph_nodes is not None else
                    fwd_mem.ops + len(params) + len(carry) + 1, ops=fwd_mem.ops,
                    region_ops=fwd_mem.region_ops, region_iters=iters)


def _replays(template, inputs: StepInputs, dt: torch.dtype) -> bool:
    """Whether the unit's backward may replay its fused attention (models/replay.py): a block of unpacked
    sequences (packed ones attend per document, a data-dependent number of calls) whose target runs the
    flash kernel the trace stands for (CUDA runs fp32 through the memory-efficient one, whose log-sum-exp is
    padded to 32 rows: not recorded)."""
    flash = inputs.target == "cpu" or dt in (torch.bfloat16, torch.float16)
    return template.kind == "block" and inputs.segments is None and flash


def _measure_replay(template, params, carry, inputs: StepInputs, buffers, existing, scale: Scale | None,
                    dt: torch.dtype):
    """The storage sums of a backward whose recompute replays attention (None: the unit cannot): the record
    is made by a no-grad forward first and, a program buffer, not counted."""
    if not _replays(template, inputs, dt):
        return None
    rec = replay.Record()
    with torch.no_grad(), replay.record_attention(rec):
        run_unit(template, params, carry, inputs, buffers)
    if not rec.ops:
        return None
    with LiveBytes(scale, [*existing, *rec.tensors]) as mem, torch.enable_grad():
        with replay.replay_attention(rec):
            out = run_unit(template, params, carry, inputs, buffers, **recompute_mode(template.kind))
        grads_out = [torch.ones_like(o) for o in out]
        grads = torch.autograd.grad(out, [*params.values(), *carry], grads_out, allow_unused=True)
        mem.exclude([*grads_out, *(g for g in grads[len(params):] if g is not None)])
        sums = mem.sums
        del out, grads, grads_out
    return sums


def _carry_out(template, carry_in: list[TensorSpec], inputs: StepInputs, dt: torch.dtype, unit: str,
               scale: Scale | None):
    """The carry-out specs of one no-grad forward, and the bytes (classed) that a unit which can rebuild its
    carry-in from its carry-out records in that forward (None for other units)."""
    params = {n: torch.empty(p.shape, dtype=dt) for n, p in template.named_parameters()}
    carry = tuple(torch.empty(s.shape, dtype=DTYPES[s.dtype]) for s in carry_in)
    rebuild = getattr(template, "can_rebuild", False)
    rec = replay.Record()
    with torch.no_grad(), replay.record_attention(rec):
        out = run_unit(template, params, carry, inputs, _buffers(template), **({"record": True} if rebuild else {}))
    out, side = out if rebuild else (out, None)
    attn = [TensorSpec(name=f"{unit}.attn{i}", shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
            for i, t in enumerate(rec.tensors)] if _replays(template, inputs, dt) else []
    for i, t in enumerate(out):
        if not t.is_contiguous():  # an offloaded copy would be contiguous, and kernels may sum differently
            raise ValueError(f"unit {unit} returns a non-contiguous carry (output {i}); make it .contiguous()")
    specs = [TensorSpec(name=f"{unit}.out{i}", shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
             for i, t in enumerate(out)]
    if side is None:
        return specs, None, attn
    classed: Counter = Counter()
    for t in side:
        classed[scale.classify(t.shape) if scale is not None else (0, 0)] += t.nbytes
    return specs, classed, attn


def chunk_candidates(seq_len: int) -> tuple[int, ...]:
    """The chunk sizes a trace prices for the planner: powers of two from MIN_CHUNK to half the sequence."""
    out, c = [], MIN_CHUNK
    while 2 * c <= seq_len:
        out.append(c)
        c *= 2
    return tuple(reversed(out))


def _dims(config: ModelConfig, tmpls: dict) -> set[int]:
    """Every dimension (and parameter size) a unit's tensors have besides the sequence's: a short trace length
    must divide none of them."""
    c = config
    dims = {c.d_model, c.ffn_dim, c.vocab_size, c.n_heads, c.kv_heads, c.head_dim, c.head_dim // 2,
            c.n_heads * c.head_dim, c.kv_heads * c.head_dim, c.n_layers, 2 * c.n_layers}
    for t in tmpls.values():
        for p in (*t.parameters(), *t.buffers()):
            dims.update((*p.shape, p.numel()))
    return dims


def _check(config: ModelConfig, micro_batch: int, seq_len: int, target: str, chunk_tokens: int | None) -> None:
    for name, v in (("micro_batch", micro_batch), ("seq_len", seq_len)):
        if isinstance(v, bool) or not hasattr(type(v), "__index__"):  # int, numpy's integers
            raise ValueError(f"{name} must be an integer, got {v!r}")
    if micro_batch <= 0 or seq_len <= 0:
        raise ValueError(f"micro_batch and seq_len must be positive, got {micro_batch} and {seq_len}")
    if micro_batch * seq_len > MAX_TOKENS:
        raise ValueError(f"micro_batch x seq_len = {micro_batch * seq_len:,} tokens exceeds {MAX_TOKENS:,} per "
                         "micro-batch; use a smaller --micro-batch and more --grad-accum")
    if seq_len > config.max_seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the model's max_seq_len {config.max_seq_len}; "
                         "lower --seq-len or raise max_seq_len in the model config (max_position_embeddings in a "
                         "Hugging Face folder's config.json)")
    if config.sliding_window is not None and seq_len > config.sliding_window:
        raise ValueError(f"seq_len {seq_len} exceeds the model's sliding attention window of {config.sliding_window} "
                         "tokens, which megatrain does not implement (it attends fully); use --seq-len "
                         f"{config.sliding_window} or less")
    if target not in TARGETS:
        raise ValueError(f"unknown trace target {target!r}; use one of {', '.join(TARGETS)}")
    if chunk_tokens is not None and chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be a positive number of tokens (or None: untiled), got {chunk_tokens}")


def trace(model: str | ModelConfig, micro_batch: int, seq_len: int, dtype: str | torch.dtype = "bfloat16",
          loss_chunk: int = 1024, target: str = "cuda", packed: bool = False, chunk_tokens: int | None = None,
          chunk_options: bool | None = None, scaled: bool | None = None) -> ModelIR:
    """Trace `model` (a preset name, a config file, or a ModelConfig) for micro-batches of
    `micro_batch x seq_len` tokens computed in `dtype`, as the `target` ("cuda" or "cpu") runs it; `packed`
    for micro-batches that pack several documents per row (attention within each document).

    `chunk_tokens` tiles the units' token-wise work in chunks of that many tokens (None, or at least seq_len:
    untiled). `chunk_options` also prices the untiled units and every `chunk_candidates` size, for the
    planner's `chunks` pass; `scaled` traces at a short length and scales the figures exactly (scaled.py).
    Both default to on for sequences longer than LONG_SEQ, except for MoE models (routing is traced as is).
    """
    t0 = time.perf_counter()
    config = load_model_config(model)
    _check(config, micro_batch, seq_len, target, chunk_tokens)
    chunk = chunk_tokens if chunk_tokens is not None and chunk_tokens < seq_len else None
    moe, long = config.moe is not None, seq_len > LONG_SEQ
    explicit = scaled is not None or chunk_options is not None
    scaled = long and not moe if scaled is None else scaled
    want = long and chunk is None and not moe if chunk_options is None else chunk_options
    options = chunk_candidates(seq_len) if want else ()
    if moe and (scaled or options):
        raise ValueError("an MoE model routes over the whole micro-batch, which a scaled trace does not follow; "
                         "trace it with scaled=False and chunk_options=False")
    dname = canonical_dtype(dtype)
    dt = DTYPES[dname]
    tmpls = templates(config)
    scale = None
    if scaled or options:
        try:
            scale = choose_scale(seq_len, micro_batch, loss_chunk, _dims(config, tmpls), True)
        except ValueError:
            if explicit:
                raise
            scaled, options = False, ()  # NOTE: no short length differs from every dimension: trace as it runs
    run = _Runner(config, micro_batch, seq_len, dt, loss_chunk, target, packed, scale)
    cache: dict[tuple, dict] = {}
    units: list[UnitIR] = []
    carry_in: list[TensorSpec] = []
    carry_s: list[TensorSpec] = []  # the same carries at the scale's trace length
    with torch.device("meta"):
        for index, name in enumerate(unit_names(config)):
            key = template_key(config, name)
            tmpl = tmpls[key]
            cache_key = (key, tuple((s.shape, s.dtype) for s in carry_in))
            if cache_key not in cache:
                cache[cache_key] = run.template(tmpl, name, carry_in, carry_s, chunk, scaled, options)
            m = cache[cache_key]
            carry_out = [s.replace(name=f"{name}.out{i}") for i, s in enumerate(m["carry_out"])]
            units.append(UnitIR(
                name=name, index=index, kind=tmpl.kind, template=key, params=m["layout"], flat_numel=m["flat_numel"],
                tied=tied_params(config, name), buffers=m["buffers"],
                carry_in=tuple(s.replace(name=f"{name}.in{i}") for i, s in enumerate(carry_in)),
                carry_out=tuple(carry_out), chunk_options=m["options"],
                replay=tuple(s.replace(name=f"{name}.attn{i}") for i, s in enumerate(m["replay"])), **m["figures"]))
            carry_in = [] if tmpl.kind == "head" else carry_out
            carry_s = [] if tmpl.kind == "head" else m["carry_s"]
    names = [u.name for u in units]
    edges = [(a, b, "carry") for a, b in zip(names, names[1:])]
    edges += [(u.tied[p].split(".")[0], u.name, "tied") for u in units for p in u.tied]
    hd = config.head_dim
    resident = (TensorSpec(name="rope.cos", shape=(seq_len, hd), dtype=dname),
                TensorSpec(name="rope.sin", shape=(seq_len, hd), dtype=dname))
    return ModelIR(model=config.name, config=config.model_dump(), micro_batch=micro_batch, seq_len=seq_len,
                   dtype=dname, target=target, packed=packed, units=tuple(units), resident=resident, edges=tuple(edges),
                   chunk_tokens=chunk, traced_seq_len=scale.seq if scaled else None,
                   trace_seconds=time.perf_counter() - t0)


class _Runner:
    """Measures each template as `trace` asks: untiled and tiled, directly at seq_len or at `scale`."""

    def __init__(self, config, micro_batch, seq_len, dt, loss_chunk, target, packed, scale: Scale | None):
        self.config, self.mb, self.seq, self.dt = config, micro_batch, seq_len, dt
        self.loss_chunk, self.target, self.packed, self.scale = loss_chunk, target, packed, scale

    def _inputs(self, kind: str, seq: int, chunk: int | None) -> StepInputs:
        return _unit_inputs(kind, self.config, self.mb, seq, self.dt, self.loss_chunk, self.target, self.packed,
                            chunk)

    def template(self, tmpl, name: str, carry_in, carry_s, chunk, scaled: bool, options: tuple[int, ...]) -> dict:
        kind, sc = tmpl.kind, self.scale
        untiled_scale = Scale(sc.seq, None, sc.batch) if sc is not None else None
        layout, numel = template_layout(tmpl)
        buffers = tuple(TensorSpec(name=n, shape=tuple(b.shape), dtype="float32") for n, b in tmpl.named_buffers())
        out: dict = dict(layout=layout, flat_numel=numel, buffers=buffers, carry_s=[])
        direct = not scaled
        if direct:
            specs, side, attn = _carry_out(tmpl, carry_in, self._inputs(kind, self.seq, None), self.dt, name, None)
            out.update(carry_out=specs, rebuild=None if side is None else sum(side.values()), replay=attn)
        if sc is not None:
            specs_s, side_s, attn_s = _carry_out(tmpl, carry_s, self._inputs(kind, sc.seq, None), self.dt, name, sc)
            out["carry_s"] = specs_s
            if not direct:
                out["carry_out"] = [s.replace(shape=sc.scale_shape(s.shape, self.seq)) for s in specs_s]
                out["replay"] = [s.replace(shape=sc.scale_shape(s.shape, self.seq)) for s in attn_s]

        def measure(chunk_s: int | None, on_scale: bool) -> Measured:
            if on_scale:
                return _measure_unit(tmpl, carry_s, self._inputs(kind, sc.seq, chunk_s), self.dt,
                                     sc if chunk_s is not None else untiled_scale)
            return _measure_unit(tmpl, carry_in, self._inputs(kind, self.seq, chunk_s), self.dt, None)

        untiled = measure(None, scaled) if chunk is None or options else None
        on_scale = scaled or bool(options)
        tiled_m = None
        if chunk is not None or options:  # an embedding ignores chunking: its untiled figures hold for any chunk
            tiled_m = untiled if kind == "embed" and untiled is not None else measure(
                sc.chunk if on_scale else chunk, on_scale)
        out["figures"] = untiled.at(self.seq, None) if chunk is None else tiled_m.at(self.seq, chunk)
        out["figures"]["rebuild_bytes"] = out.pop("rebuild", None) if direct else _scaled_side(side_s, sc, self.seq)
        menu = [(None, untiled)] + [(c, tiled_m) for c in options] if options else []
        out["options"] = tuple(ChunkFigures(chunk_tokens=c, **_option(m.at(self.seq, c))) for c, m in menu)
        return out


def _option(f: dict) -> dict:
    return {k: f[k] for k in ("flops_fwd", "flops_bwd", "flops_recompute", "saved_bytes", "peak_fwd_bytes", "peak_bwd_bytes",
                              "peak_bwd_replay_bytes", "graph_nodes")}


def _scaled_side(side, scale: Scale, seq: int) -> int | None:
    return None if side is None else sum(scale.scale_bytes(c, n, seq, None) for c, n in side.items())


__all__ = ["trace", "canonical_dtype", "dtype_bytes"]
